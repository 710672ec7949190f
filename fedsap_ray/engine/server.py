"""The round loop (docs/architecture.md#one-round), pure and backend-agnostic.

    plans          = strategy.configure_round(state, t)        # ClientPlan per sampled client
    results        = backend.train(plans)                      # ClientResult per client, any order, any worker
    check_results(plans, results)                              # each holds its values at ClientResult.mask
    sim            = clock.round(t, strategy.train_macs and the bytes of each result)  # simulated device time
    recorder.count_coverage(the plans of the clients not in sim.stragglers)  # updates that reach the model
    in_time        = results of the clients not in sim.stragglers  # past the deadline (devices.policy)
    in_time, dp    = privacy.clip(t, in_time, downloaded)      # privacy.*: each delta clipped to C (local: noised)
    with privacy.release(t):                                   # central: every merge a noisy sum (algorithms/dpnoise.py)
        state, records = strategy.aggregate(state, plans, in_time, t)  # RoundOutput: ServerState + RoundRecords
                         or no_update(state, t)                # none in time: state unchanged
    records        = privacy.record(t, records, dp)            # rounds.dp_* and clients.dp_*; C adapts; epsilon
    if sim.stragglers:
        records.clients += client_cost(strategy, plan, result) of each straggler  # what it cost, recorded
    if on_schedule(t, training.eval_every):                    # and always the last round
        before     = eval_compiles()                           # resources.compile=train+eval: shapes so far
        evaluation = evaluate_modes(strategy.eval_sets(state, eval_domains)), evaluate_deployed(deployed models)
        times.eval_compiles = round_compiles(resources.compile, before)  # rounds.eval_compiles
    summary        = recorder.record(t, plans, results, records, evaluation, times, sim)  # every table's rows

Data flows one way: the strategy returns everything it computed in :class:`~fedsap_ray.common.messages.RoundOutput`
and the server asks it for nothing after ``aggregate`` but the models to evaluate. Recording, where
ground truth enters the results, is the job of the recorder the server is handed (:class:`RoundRecorder`; the
run's session builds a :class:`fedsap_ray.results.recorder.Recorder`), so the engine imports nothing of results/.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping
from typing import Protocol

import numpy as np
from torch import nn

from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.algorithms.aggregation import masked_weighted_average
from fedsap_ray.algorithms.records import client_cost
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundOutput, RoundRecords, ServerState, check_results
from fedsap_ray.common.seeding import rng_for
from fedsap_ray.data.devices import DeviceClock, SimRound
from fedsap_ray.engine.evaluate import DeployedModel, evaluate_deployed, evaluate_modes
from fedsap_ray.engine.compiled import eval_compiles, round_compiles
from fedsap_ray.engine.privacy import PrivateRounds
from fedsap_ray.engine.summary import DEPLOYED, PhaseTimes, RoundEvaluation, RoundSummary

__all__ = ["DEPLOYED", "Backend", "RoundRecorder", "RoundSummary", "Server", "deployed_sample", "on_schedule"]


class RoundRecorder(Protocol):
    """What the round loop asks of the recorder it is handed (``fedsap_ray.results.recorder.Recorder`` is one): the
    coverage of the updates that reached the model, every table's rows of a round, and the simulated clock so far."""

    sim_elapsed_s: float

    def count_coverage(self, plans: Mapping[int, ClientPlan]) -> None: ...

    def record(self, t: int, plans: Mapping[int, ClientPlan], results: list[ClientResult], records: RoundRecords,
               evaluation: RoundEvaluation, times: PhaseTimes, sim: SimRound) -> RoundSummary: ...


class Backend(Protocol):
    name: str

    def start(self, ctx: RunContext) -> None: ...

    def train(self, plans: dict[int, ClientPlan]) -> list[ClientResult]: ...

    def close(self) -> None: ...


class Server:
    """One round at a time: strategy + backend + evaluation; the recorder writes the rows."""

    def __init__(self, ctx: RunContext, strategy: Strategy, backend: Backend, recorder: RoundRecorder,
                 deployed_clients: list[int], eval_models: list[nn.Module], device) -> None:
        self.ctx, self.strategy, self.backend, self.recorder = ctx, strategy, backend, recorder
        self.eval_scratch, self.device = eval_models, device
        self.deployed_clients = deployed_clients  # whose deployed model is evaluated (deployed_sample)
        self.eval_domains = ctx.federation.eval_domains()  # evaluation-only ground truth (Strategy.eval_sets)
        self.clock = DeviceClock(ctx.cfg, strategy.sampler.devices())  # simulated device time, the strategy's devices
        self.privacy = PrivateRounds.for_config(ctx.cfg, ctx.layout)  # privacy.* (engine/privacy.py); None when off

    def round(self, state: ServerState, t: int) -> tuple[ServerState, RoundSummary]:
        """Round ``t`` from ``state``: the new state and the round's summary (its rows are written).

        The round's wall time is split into its phases (``rounds.train_s``, ``eval_s``, ``server_s``;
        :class:`~fedsap_ray.engine.summary.PhaseTimes`): the backend's ``train`` call, the evaluation,
        and the strategy's plans and aggregation."""
        clock = time.perf_counter
        t0 = clock()
        plans = self.strategy.configure_round(state, t)
        if not plans and not (self.privacy is not None and self.privacy.poisson):
            raise RuntimeError(f"round {t}: the strategy selected no clients")
        t_plans = clock()
        results = sorted(self.backend.train(plans), key=lambda r: r.client_id) if plans else []
        t_trained = clock()
        missing = set(plans) - {r.client_id for r in results}
        if missing:
            raise RuntimeError(f"round {t}: no result from clients {sorted(missing)}")
        check_results(plans, results, type(self.strategy).__name__)  # what each result holds (messages.py)
        # aggregate's client_records asks for train_macs again; no cache: an O(parameters) count, small beside a
        # round (docs/guides/performance.md)
        sim = self.clock.round(t, {r.client_id: (self.strategy.train_macs(plans[r.client_id], r),
                                                 plans[r.client_id].bytes_down,
                                                 r.bytes_up + plans[r.client_id].side_bytes_up) for r in results})
        # coverage counts the clients whose update reached the model: a straggler trained, but what it trained
        # was discarded (under wait_all every client is aggregated, so nothing changes there)
        self.recorder.count_coverage({cid: p for cid, p in plans.items() if cid not in sim.stragglers})
        in_time = [r for r in results if r.client_id not in sim.stragglers]
        own = plans if len(in_time) == len(plans) else {r.client_id: plans[r.client_id] for r in in_time}
        dp: dict[int, dict] = {}
        if self.privacy is not None:  # privacy.*: each update's delta clipped to C (engine/privacy.py)
            in_time, dp = self.privacy.clip(t, in_time, lambda r: downloaded(plans[r.client_id], r))
        with self.privacy.release(t) if self.privacy is not None else contextlib.nullcontext():
            out = (self.strategy.aggregate(state, own, in_time, t) if in_time
                   else self._no_update(state, t))  # none in time, or an empty Poisson sample
        if self.privacy is not None:  # rounds.dp_*, clients.dp_*; C adapts; the release composed
            out = self.privacy.record(t, out, dp)
        if sim.stragglers:  # left out of aggregation (fedsap_ray.data.devices); recorded with what they spent
            out = out.with_client_rows({r.client_id: client_cost(self.strategy, plans[r.client_id], r)
                                        for r in results if r.client_id in sim.stragglers})
        new_state = out.state
        t_aggregated = clock()
        cfg = self.ctx.cfg
        evaluated = on_schedule(t, cfg.training.eval_every, cfg.training.rounds)
        compiles_before = eval_compiles()
        by_mode: dict[str, dict[str, tuple[float, float]]] = {}
        if evaluated:
            by_mode = evaluate_modes(self.eval_scratch, self.ctx.layout,
                                     self.strategy.eval_sets(new_state, self.eval_domains),
                                     self.ctx.federation.test, self.device, compile=cfg.resources.compile)
        deployed_now = on_schedule(t, cfg.training.deployed_every, cfg.training.rounds)
        deployed = (self._evaluate_deployed(new_state) if evaluated and deployed_now and cfg.training.eval_deployed
                    else {})
        ev = RoundEvaluation(by_mode=by_mode, deployed=deployed)
        t_end = clock()
        eval_s = t_end - t_aggregated if evaluated else 0.0  # a round not evaluated spends nothing there
        moved = getattr(self.backend, "moved", (0, 0))  # the Ray pool's count; nothing moves in-process
        times = PhaseTimes(train_s=t_trained - t_plans, eval_s=eval_s,
                           server_s=(t_end - t0) - (t_trained - t_plans) - eval_s, moved_down=moved[0], moved_up=moved[1],
                           eval_compiles=round_compiles(cfg.resources.compile, compiles_before))
        return new_state, self.recorder.record(t, plans, results, out.records, ev, times, sim)

    def _no_update(self, state: ServerState, t: int) -> RoundOutput:
        """A round no update reached: the state renumbered, unchanged, except for a private round whose Poisson
        sample was empty, which still releases its noise (the analysis counts a release every round)."""
        if self.privacy is not None and self.privacy.poisson:
            return RoundOutput(dataclasses.replace(state, round=t, params=masked_weighted_average(state.params, [])),
                               RoundRecords())
        return RoundOutput.unchanged(state, t)  # every client a straggler: public device times, nothing released

    def _evaluate_deployed(self, state: ServerState) -> dict[int, tuple[float, float]]:
        """(accuracy, loss) of every evaluated client's deployed model on its own domain (fedsap_ray.engine.evaluate)."""
        fed = self.ctx.federation
        models = []
        for cid in self.deployed_clients:
            params, mask = self.strategy.deployed_model(state, cid)
            models.append(DeployedModel(cid, fed.clients[cid].domain, params, mask))
        weights = ({c.client_id: c.label_counts for c in fed.clients} if len(fed.domains) == 1 else None)
        bn_data = ({cid: fed.client_data(cid) for cid in self.deployed_clients}
                   if self.ctx.cfg.training.deployed_bn == "client" else None)
        return evaluate_deployed(self.eval_scratch, self.ctx.layout, models, fed.test, self.device,
                                 fed.num_classes, weights, bn_data, sliced=self.ctx.cfg.training.submodel == "sliced",
                                 compile=self.ctx.cfg.resources.compile)


def downloaded(plan: ClientPlan, result: ClientResult) -> np.ndarray:
    """What the plan's client downloaded at the coordinates its result holds (its update is taken from it)."""
    return plan.source if result.mask is None else plan.source[result.mask]


def on_schedule(t: int, every: int, rounds: int) -> bool:
    """Whether round ``t`` is one of every ``every``-th rounds or the last (eval_every, deployed_every)."""
    return t % every == 0 or t == rounds


def deployed_sample(ctx: RunContext) -> tuple[list[int], bool]:
    """(clients whose deployed model is evaluated, whether that is a sample): every client up to
    ``training.eval_clients``; above it, a seeded sample fixed for the whole run (so curves compare round
    to round), stratified by domain (each domain gets its share, at least one client)."""
    fed, cfg = ctx.federation, ctx.cfg
    n, k = len(fed.clients), cfg.training.eval_clients
    if n <= k:
        return list(range(n)), False
    rng = rng_for(cfg.seed, 0, -1, "deployed-eval")
    chosen: list[int] = []
    for d in fed.domains:
        ids = [c.client_id for c in fed.clients if c.domain == d]
        if ids:
            take = min(len(ids), max(1, int(round(k * len(ids) / n))))
            chosen.extend(int(i) for i in rng.choice(ids, size=take, replace=False))
    return sorted(chosen), True
