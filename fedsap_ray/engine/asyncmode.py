"""Asynchronous training on the simulated device clock (``devices.mode=async``; docs/guides/device-time.md).

FedBuff (Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous Aggregation", Algorithm 1) on
the device model of :mod:`fedsap_ray.data.devices`, with sub-models; ``buffer_size=1`` is FedAsync (Xie et al.
2019) with FedBuff's delta update. Pure, no Ray: the backend is asked only ``backend.train(plans)``.

The engine (:class:`AsyncServer`, one :meth:`~AsyncServer.round` call per server step):

- ``concurrency`` clients train at once (Algorithm 1 line 2, "run clients concurrently"). A client started
  when the server holds model version v (v server steps done) downloads that model, trains the sub-model
  its strategy gives it for round v + 1 (:meth:`FedAvg.configure_clients`, so its plan, seed, learning rate,
  mask and jitter are those of round v + 1 of a synchronous run), and finishes at
  start + :func:`fedsap_ray.data.devices.client_time` (its speed, bandwidths, jitter). Unavailable clients
  (:func:`fedsap_ray.data.devices.available` for round v + 1) are not started.
- An event queue on simulated time holds the clients in flight, ordered by (finish time, client id), so
  ties are broken by client id. Each arrival joins the buffer (or is discarded when staler than
  ``max_staleness``: recorded as a ``straggler``); at the ``buffer_size``-th buffered arrival the server
  takes a step (Algorithm 1 lines 10-13, below) and the version becomes v + 1.
- Once every arrival of a simulated instant is processed, the freed slots start new clients at that same
  instant on the model of that moment (the steps taken at the instant included). A client is busy from
  its start until its update is applied or discarded, so it has one update in flight or buffered at
  most, and trains at most once on each version.
- The engine's state after a step (the event queue with each update's plan, result and downloaded model, the
  buffer, the discarded arrivals, the clock, the dispatch counters) goes into the step's checkpoint
  (:meth:`AsyncServer.state_dict`), so a resumed run continues exactly (:meth:`AsyncServer.load_state_dict`).
- Clients started at one instant do not depend on each other and go to ``backend.train`` together, so
  the tables are those of the local backend on any backend. Selection is seeded: the first start of
  version v draws from ``rng_for(seed, v + 1, -1, "sample")``, exactly a synchronous round's draw
  (:meth:`fedsap_ray.algorithms.sampling.Sampler.sample`), later ones from
  ``rng_for(seed, v + 1, j, "async-sample")``.

The server step (FedBuff Algorithm 1 line 11: Delta_bar = sum of the buffered s(tau_i) Delta_i; line 12:
x <- x + eta_g Delta_bar), our reading with sub-models and sample counts: with Delta_i = y_i - x_{v_i}
on the coordinates m_i client i uploaded (what it trained minus what it downloaded; m_i is its result's
``ClientResult.mask``, the plan's mask or one a client hook chose, DapperFL's pruned model) and
tau_i = V - v_i its staleness at the server's version V,

    x_j <- x_j + eta_g * sum_i n_i s(tau_i) [m_i]_j Delta_ij / sum_i n_i [m_i]_j

for every coordinate some buffered client covered (others keep their value bit for bit). It is computed
by the strategy's own :meth:`merge` (:func:`fedsap_ray.algorithms.aggregation.masked_weighted_average`, sample
weights n_i) over the "recovered" values z_i = x|m_i + eta_g s(tau_i) Delta_i, whose coordinate-wise
weighted mean is the line above; FedMP's R2SP merge and DapperFL's reconstruction (pruned coordinates
refilled from the current model) then average over every buffered client as they do synchronously. An
update trained on the current version with eta_g s(tau_i) = 1 contributes its trained values themselves
(z_i = y_i), so with equal device times, ``concurrency`` = a round's clients and
``buffer_size`` = ``concurrency`` every step is the synchronous round, bit for bit
(tests/engine/test_asyncmode.py). FedBuff averages the buffer with weight 1/K; the sample-weighted,
coordinate-wise mean is this simulator's aggregation rule and equals it for equal sample counts.

Evaluation: every ``training.eval_every`` steps, or with ``asynchronous.eval_every_s`` every t simulated
seconds (:func:`crossed`), and always at the last step; evaluating never changes training.

When the settings alone make the run the synchronous one (:func:`synchronous_equivalent`: every client trains
every step, the buffer waits for all of them, so every update is fresh and applied whole), the engine says so
once, when it starts: one :class:`RunNote` line on stderr, so nobody reads the run as asynchronous training.
"""
from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np

from fedsap_ray.algorithms.records import client_cost
from fedsap_ray.data.devices import SimRound, available, client_time, round_size
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.engine.evaluate import evaluate_modes
from fedsap_ray.engine.compiled import eval_compiles, round_compiles
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundOutput, RoundRecords, ServerState, check_results
from fedsap_ray.persist.messagetree import plan_from_tree, plan_tree, result_from_tree, result_tree
from fedsap_ray.engine.summary import PhaseTimes, RoundEvaluation, RoundSummary
from fedsap_ray.common.seeding import rng_for
from fedsap_ray.engine.server import Server, downloaded, on_schedule
from fedsap_ray.algorithms.staleness import update_factor, weight_for
from fedsap_ray.persist.statecheck import BadCheckpoint, check_params

__all__ = ["AsyncServer", "AsyncStrategy", "RunNote", "Update", "crossed", "synchronous_equivalent"]

#: The engine's part of a checkpoint (:meth:`AsyncServer.state_dict`): its format name and version. A checkpoint
#: of another version (or none: an asynchronous run checkpointed before it could be resumed) is refused.
ENGINE_FORMAT, ENGINE_VERSION = "fedbuff", 1
UPDATE_FIELDS = ("client_id", "version", "start_s", "finish_s", "sim_s", "plan", "result")

PROGRESS = "  step: {updates_applied} updates, staleness mean {staleness_mean:.2f} max {staleness_max}"


class AsyncStrategy(Protocol):
    """What the asynchronous engine asks of a strategy besides the contract
    (:class:`~fedsap_ray.algorithms.contract.Strategy`): FedAvg's extension points
    (:class:`~fedsap_ray.algorithms.fedavg.FedAvg` and its supported subclasses have them, and
    :class:`~fedsap_ray.algorithms.dapperfl.DapperFL`)."""

    def configure_clients(self, state: ServerState, t: int, clients: list[int]) -> dict[int, ClientPlan]: ...

    def merge(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
              t: int) -> np.ndarray: ...

    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> Any: ...

    def records(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                t: int) -> RoundRecords: ...



@dataclass(frozen=True)
class Update:
    """One client's update from its start to its arrival: the version it downloaded (``base``: that version's
    full parameter vector, never mutated), its plan and result, and its simulated start and finish."""

    client_id: int
    version: int
    start_s: float
    finish_s: float
    base: np.ndarray
    plan: ClientPlan
    result: ClientResult
    sim_s: float  # its simulated seconds (clients.sim_time_s): fedsap_ray.data.devices.client_time; finish = start + sim_s

    def downloaded(self) -> np.ndarray:
        """The values it downloaded at the coordinates its result holds (what its delta is taken from):
        ``ClientResult.mask``, the plan's own mask object or one a client hook chose within the download
        (DapperFL's pruned model of the full model it received; messages.py)."""
        return downloaded(self.plan, self.result)  # the plan's start: ``base`` itself unless an overlay mixes in


def crossed(before_s: float, after_s: float, every_s: float, per: int = 1) -> bool:
    """Whether a step that moves the simulated time from ``before_s`` to ``after_s`` (the previous and this step's
    ``rounds.sim_elapsed_s``) reaches or passes a multiple of ``per`` x ``every_s`` seconds.

    Our reading of "evaluate every t simulated seconds" (issue 44): the model changes only at server steps, so
    the model of time k t is the one of the first step at or after k t; that step is evaluated, once, however
    many multiples it passes. Periods are counted as floor(sim_elapsed_s / t), one float division of the recorded
    times, and ``per`` periods (``training.deployed_every``) as whole numbers of them, so a step due for ``per``
    is due for 1 as well (the deployed evaluation is always a subset of the evaluations), and the schedule is a
    function of the recorded times alone (the same on a resume that restores ``sim_elapsed_s``)."""
    return math.floor(after_s / every_s) // per > math.floor(before_s / every_s) // per


class RunNote(UserWarning):
    """A note on a run that changes nothing in it (printed once, one line, attributed to the package)."""


def synchronous_equivalent(cfg: Any) -> str | None:
    """Why an asynchronous run of ``cfg`` is the synchronous run step for step (the same tables, but for the
    asynchronous columns and the simulated clock's float rounding), or None when it need not be.

    The settings alone decide it when every client of the federation trains every step: ``concurrency`` =
    ``buffer_size`` = a synchronous round's clients = all of them (``training.participation`` 1). A client
    arriving early frees no slot (every other client is busy), the step waits for all, every update is fresh
    (staleness 0, every staleness rule weighs it 1) and with ``server_lr`` 1 it is applied as the synchronous
    mean. Availability below 1, a trace, or ``eval_every_s`` change who trains or when it is evaluated; with
    fewer clients per step the run equals the synchronous one only when every client's simulated time is the
    same, which the settings cannot say (docs/guides/device-time.md#asynchronous-training)."""
    dev, a = cfg.devices, cfg.asynchronous
    n = cfg.data.num_clients
    concurrency = a.concurrency or round_size(cfg, n)
    buffer = a.buffer_size or concurrency
    if dev.mode != "async" or not round_size(cfg, n) == concurrency == buffer == n or a.server_lr != 1 \
            or dev.availability < 1 or dev.trace is not None or a.eval_every_s is not None:
        return None
    return (f"devices.mode=async with asynchronous.concurrency = buffer_size = {n} = every client "
            "(training.participation=1) and server_lr=1 is the synchronous run: each step waits for every client's "
            "fresh update (staleness 0); lower asynchronous.concurrency or buffer_size for asynchronous training")


class AsyncServer(Server):
    """The asynchronous engine (module docstring); ``round(state, t)`` runs until server step ``t`` and
    records it as round ``t`` of every table."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.ctx.cfg
        self.acfg = cfg.asynchronous
        n = len(self.ctx.federation.clients)
        self.concurrency = self.acfg.concurrency or round_size(cfg, n)
        self.buffer_size = self.acfg.buffer_size or self.concurrency
        self.astrategy = cast(AsyncStrategy, self.strategy)
        self.now = 0.0  # the simulated clock: the instant of the last event
        self.last_step_s = 0.0  # the instant of the last server step
        self.flight: list[tuple[float, int, Update]] = []  # heap by (finish, client id)
        self.buffer: list[Update] = []  # arrived since the last step, to be applied
        self.discarded: list[Update] = []  # arrived since the last step, too stale (max_staleness)
        self.dispatch_due = True  # start clients before the next arrival (the run's start, after a step)
        self.dispatch_version, self.dispatch_index = -1, 0  # starts on one version so far (selection seeds)
        self.train_s = 0.0  # wall seconds in backend.train since the last step
        note = synchronous_equivalent(cfg)
        if note is not None:  # once, at the start: one line attributed to the package, not to a source line
            warnings.warn_explicit(note, RunNote, filename="fedsap_ray", lineno=0, module="fedsap_ray.engine.asyncmode")

    # --- the event loop --------------------------------------------------------------------------
    def round(self, state: ServerState, t: int) -> tuple[ServerState, RoundSummary]:
        """Process arrivals in simulated-time order until the ``buffer_size``-th buffered one; take step ``t``."""
        if state.round != t - 1:
            raise RuntimeError(f"server step {t} from model version {state.round}")
        t0 = time.perf_counter()
        if self.dispatch_due:
            self._dispatch(state)
            self.dispatch_due = False
        while True:
            if not self.flight:
                raise self._stalled(state)
            _, _, u = heapq.heappop(self.flight)
            self.now = u.finish_s
            staleness = state.round - u.version
            limit = self.acfg.max_staleness
            (self.discarded if limit is not None and staleness > limit else self.buffer).append(u)
            instant_done = not self.flight or self.flight[0][0] != self.now
            if len(self.buffer) >= self.buffer_size:
                # the instant's other arrivals come first in the next call; then the freed slots start
                self.dispatch_due = instant_done
                return self._step(state, t, t0)
            if instant_done:
                self._dispatch(state)

    def _dispatch(self, state: ServerState) -> None:
        """Start clients in the free slots, at ``self.now``, on ``state`` (module docstring: who, which seeds)."""
        free = self.concurrency - len(self.flight)
        if free <= 0:
            return
        cfg, v = self.ctx.cfg, state.round
        t = v + 1
        if v != self.dispatch_version:
            self.dispatch_version, self.dispatch_index = v, 0
        busy = {u.client_id for _, _, u in self.flight} | {u.client_id for u in self.buffer}
        pool = [c for c in available(cfg, self.clock.devices, t) if c not in busy]
        m = min(free, len(pool))
        if m == 0:
            return
        if m >= len(pool):
            chosen = pool
        else:
            j = self.dispatch_index
            rng = rng_for(cfg.seed, t, -1, "sample") if j == 0 else rng_for(cfg.seed, t, j, "async-sample")
            chosen = sorted(int(pool[i]) for i in rng.choice(len(pool), size=m, replace=False))
        self.dispatch_index += 1
        plans = self.astrategy.configure_clients(state, t, chosen)
        t_train = time.perf_counter()
        results = self.backend.train(plans)
        self.train_s += time.perf_counter() - t_train
        missing = set(plans) - {r.client_id for r in results}
        if missing:
            raise RuntimeError(f"server step {t}: no result from clients {sorted(missing)}")
        check_results(plans, results, type(self.strategy).__name__)  # what each result holds (messages.py)
        for r in sorted(results, key=lambda r: r.client_id):
            plan = plans[r.client_id]
            sim_s = client_time(cfg, self.clock.devices[r.client_id], t, r.client_id,
                                self.strategy.train_macs(plan, r), plan.bytes_down, r.bytes_up + plan.side_bytes_up)
            u = Update(r.client_id, v, self.now, self.now + sim_s, state.params, plan, r, sim_s)
            heapq.heappush(self.flight, (u.finish_s, u.client_id, u))

    def _stalled(self, state: ServerState) -> Exception:
        """Nothing in flight and no client to start: only unavailable clients can cause it (buffer_size <=
        data.num_clients, and a client whose update waits in the buffer is the only other idle one)."""
        dev = self.ctx.cfg.devices
        where = (f"at simulated time {self.now:.6g}s no client is in flight and none can start on model version "
                 f"{state.round} (buffer {len(self.buffer)}/{self.buffer_size}: the other clients are unavailable)")
        if dev.availability < 1 or dev.trace is not None:
            return ConfigError(f"invalid devices.availability={dev.availability}: {where}; raise the availability "
                               "(or the trace's), or lower asynchronous.buffer_size")
        return RuntimeError(where)

    # --- the server step -----------------------------------------------------------------------------
    def _step(self, state: ServerState, t: int, t0: float) -> tuple[ServerState, RoundSummary]:
        """Apply the buffer to ``state`` (module docstring), evaluate, record step ``t`` as round ``t``."""
        applied = sorted(self.buffer, key=lambda u: u.client_id)
        dropped = sorted(self.discarded, key=lambda u: u.client_id)
        self.buffer, self.discarded = [], []
        s = self.astrategy
        stal = {u.client_id: state.round - u.version for u in [*applied, *dropped]}
        weight = {u.client_id: weight_for(self.acfg, stal[u.client_id]) for u in applied}
        dp: dict[int, dict[str, Any]] = {}
        if self.privacy is not None:  # each delta clipped against the version its client downloaded, before s(tau)
            by_id = {u.client_id: u for u in applied}
            clipped, dp = self.privacy.clip(t, [u.result for u in applied], lambda r: by_id[r.client_id].downloaded())
            applied = [dataclasses.replace(u, result=r) for u, r in zip(applied, clipped)]
        recovered = [dataclasses.replace(u.result, values=self._recovered(state, u, update_factor(self.acfg,
                                                                                                  stal[u.client_id])))
                     for u in applied]
        masks = {u.client_id: u.result.mask for u in applied}
        with self.privacy.release(t) if self.privacy is not None else contextlib.nullcontext():
            params = s.merge(state, {u.client_id: u.plan for u in applied}, recovered, t)
        if self.privacy is not None:  # running variances the noise pushed below 0 set to 0 (post-processing)
            params = self.privacy.post_process(params)
        new_state = ServerState(round=t, params=params,
                                strategy_state=s.after_aggregate(state, params, recovered, masks, t))
        plans = {u.client_id: u.plan for u in applied}
        records = s.records(new_state, plans, [u.result for u in applied], t)
        if self.privacy is not None:  # rounds.dp_*, clients.dp_*; C adapts; the step's release composed
            records = self.privacy.record(t, RoundOutput(new_state, records), dp).records
        clients = {cid: dict(row) for cid, row in records.clients.items()}
        for u in applied:
            clients[u.client_id].update(version_trained=u.version, version_applied=state.round,
                                        staleness=stal[u.client_id], sim_arrival_s=u.finish_s,
                                        staleness_weight=weight[u.client_id])
        for u in dropped:
            clients[u.client_id] = {**client_cost(self.strategy, u.plan, u.result), "version_trained": u.version, "version_applied": None,
                                    "staleness": stal[u.client_id], "sim_arrival_s": u.finish_s,
                                    "staleness_weight": None}
        applied_stal = [stal[u.client_id] for u in applied]
        columns = dict(records.rounds, updates_applied=len(applied),
                       staleness_mean=float(np.mean(applied_stal)) if applied_stal else None,
                       staleness_max=max(applied_stal) if applied_stal else None)
        records = dataclasses.replace(records, rounds=columns, clients=clients, progress=records.progress + PROGRESS)
        self.recorder.count_coverage(plans)  # coverage counts the updates that reached the model
        every = [*applied, *dropped]
        sim = SimRound({u.client_id: u.sim_s for u in every}, frozenset(u.client_id for u in dropped),
                       self.now - self.last_step_s)
        self.last_step_s = self.now
        compiles_before = eval_compiles()
        ev, eval_s = self._evaluate(new_state, t, sim.round_s)
        total = time.perf_counter() - t0
        times = PhaseTimes(train_s=self.train_s, eval_s=eval_s, server_s=max(total - self.train_s - eval_s, 0.0),
                           eval_compiles=round_compiles(self.ctx.cfg.resources.compile, compiles_before))
        self.train_s = 0.0
        summary = self.recorder.record(t, {u.client_id: u.plan for u in every},
                                       sorted((u.result for u in every), key=lambda r: r.client_id),
                                       records, ev, times, sim)
        return new_state, summary

    @staticmethod
    def _recovered(state: ServerState, u: Update, factor: float) -> np.ndarray:
        """z = x|m + factor (y - x_v|m): the values whose weighted mean applies ``factor`` x the update's delta
        to the current model; the trained values themselves when fresh with factor 1 (module docstring)."""
        if u.version == state.round and factor == 1.0:
            return u.result.values
        current = state.params if u.result.mask is None else state.params[u.result.mask]
        delta = u.result.values.astype(np.float64) - u.downloaded().astype(np.float64)
        return (current.astype(np.float64) + factor * delta).astype(np.float32)

    def _evaluate(self, state: ServerState, t: int, round_s: float) -> tuple[RoundEvaluation, float]:
        """Server step ``t``'s evaluation (every ``training.eval_every`` steps, or every
        ``asynchronous.eval_every_s`` simulated seconds by :func:`crossed`, and the last), as the synchronous
        round evaluates: (the evaluation, its wall seconds). ``round_s``: the step's ``sim_round_s``."""
        cfg = self.ctx.cfg
        every_s, last = self.acfg.eval_every_s, cfg.training.rounds
        if every_s is None:
            evaluated = on_schedule(t, cfg.training.eval_every, last)
            deployed_now = on_schedule(t, cfg.training.deployed_every, last)
        else:  # before: the previous step's recorded sim_elapsed_s; after: this one's, as the recorder adds it
            before = self.recorder.sim_elapsed_s
            evaluated = crossed(before, before + round_s, every_s) or t == last
            deployed_now = crossed(before, before + round_s, every_s, cfg.training.deployed_every) or t == last
        if not evaluated:
            return RoundEvaluation(), 0.0
        t0 = time.perf_counter()
        by_mode = evaluate_modes(self.eval_scratch, self.ctx.layout, self.strategy.eval_sets(state, self.eval_domains),
                                 self.ctx.federation.test, self.device, compile=cfg.resources.compile)
        deployed = self._evaluate_deployed(state) if deployed_now and cfg.training.eval_deployed else {}
        return RoundEvaluation(by_mode=by_mode, deployed=deployed), time.perf_counter() - t0

    # --- checkpoint state (the round's checkpoint holds it: fedsap_ray.run.session, fedsap_ray.persist.messagetree) ------------
    def state_dict(self) -> dict[str, Any]:
        """The engine's state after a server step, as a checkpoint tree (:mod:`fedsap_ray.persist.treecodec`): the clock,
        the dispatch counters (selection seeds), the event queue (heap order) with every update in flight, the
        buffer and the discarded arrivals, each update with its plan, its result and its version's downloaded
        vector, stored once per version (``bases``) however many updates downloaded it. Wall time (``train_s``) is
        not state. :meth:`load_state_dict` gives the engine back; the run then continues as if never stopped."""
        lists = {"flight": [u for _, _, u in self.flight], "buffer": self.buffer, "discarded": self.discarded}
        bases: dict[int, np.ndarray] = {}
        for u in itertools.chain(*lists.values()):
            known = bases.setdefault(u.version, u.base)
            if known is not u.base and not np.array_equal(known, u.base):  # one model per version, never mutated
                raise RuntimeError(f"two updates of model version {u.version} downloaded different vectors")
        tree: dict[str, Any] = {"format": ENGINE_FORMAT, "version": ENGINE_VERSION, "now": self.now,
                                "last_step_s": self.last_step_s, "dispatch_due": self.dispatch_due,
                                "dispatch_version": self.dispatch_version, "dispatch_index": self.dispatch_index,
                                "bases": bases}
        for name, updates in lists.items():
            tree[name] = [{"client_id": u.client_id, "version": u.version, "start_s": u.start_s, "finish_s": u.finish_s,
                           "sim_s": u.sim_s, "plan": plan_tree(u.plan, u.base),
                           "result": result_tree(u.result)} for u in updates]
        return tree

    def load_state_dict(self, tree: Any, state: ServerState, where: str) -> None:
        """Restore :meth:`state_dict`'s ``tree``, written after server step ``state.round``. Everything is checked
        before anything is set, each refusal a :class:`~fedsap_ray.persist.statecheck.BadCheckpoint` (exit 2) that starts
        with ``where`` and names the field (``engine.flight[2]: ...``)."""
        if tree is None:
            raise BadCheckpoint(f"{where} holds no asynchronous engine state (the event queue and the clients in "
                                "flight) for this devices.mode=async run (written before such runs could be resumed, or "
                                "edited); start the run again (--run-id ID --overwrite)")

        def bad(path: str, what: str) -> BadCheckpoint:
            return BadCheckpoint(f"{where}: engine{path}{'' if what.startswith(':') else ' '}{what}")

        if type(tree) is not dict:
            raise bad("", f"is {type(tree).__name__}; a dict")
        if (tree.get("format"), tree.get("version")) != (ENGINE_FORMAT, ENGINE_VERSION):
            raise bad("", f"is format {tree.get('format')!r} version {tree.get('version')!r}; this fedsap_ray reads "
                          f"{ENGINE_FORMAT!r} version {ENGINE_VERSION}: start the run again (--run-id ID --overwrite)")
        keys = {"format", "version", "now", "last_step_s", "dispatch_due", "dispatch_version", "dispatch_index",
                "bases", "flight", "buffer", "discarded"}
        if set(tree) != keys:
            raise bad("", f"has the fields {sorted(tree)}; the engine's are {sorted(keys)}")
        now, last = tree["now"], tree["last_step_s"]
        for name in ("now", "last_step_s"):
            if not _is_float(tree[name]) or not 0 <= tree[name] < math.inf:
                raise bad(f".{name}", f"is {tree[name]!r:.40}; a finite time >= 0")
        if last > now:
            raise bad(".last_step_s", f"is {last}, after the clock ({now})")
        v = state.round
        if type(tree["dispatch_due"]) is not bool:
            raise bad(".dispatch_due", f"is {tree['dispatch_due']!r:.40}; true or false")
        if not _is_int(tree["dispatch_version"]) or not -1 <= tree["dispatch_version"] <= v:
            raise bad(".dispatch_version", f"is {tree['dispatch_version']!r:.40}; a model version in [-1, {v}]")
        if not _is_int(tree["dispatch_index"]) or tree["dispatch_index"] < 0:
            raise bad(".dispatch_index", f"is {tree['dispatch_index']!r:.40}; an integer >= 0")
        bases = tree["bases"]
        if type(bases) is not dict or not all(_is_int(k) and 0 <= k <= v for k in bases):
            raise bad(".bases", f"is not a dict keyed by model versions 0-{v}")
        n_params, n_clients = self.ctx.layout.size, len(self.ctx.federation.clients)
        for k, x in bases.items():
            check_params(x, n_params, where, name=f"engine.bases[{k}]")
        if v in bases:  # the current version's download is the model itself (and shares its object again)
            if not np.array_equal(bases[v], state.params):
                raise bad(f".bases[{v}]", "differs from the checkpoint's model of that version")
            bases = {**bases, v: state.params}
        lists: dict[str, list[Update]] = {}
        for name, limit in (("flight", self.concurrency), ("buffer", self.buffer_size - 1), ("discarded", n_clients)):
            items = tree[name]
            if type(items) is not list or len(items) > limit:
                raise bad(f".{name}", f"is not a list of at most {limit} updates")
            lists[name] = [self._update_from_tree(u, bases, f".{name}[{i}]", n_clients, bad)
                           for i, u in enumerate(items)]
        for u in lists["flight"]:
            if u.finish_s < now:
                raise bad(".flight", f"holds client {u.client_id} arriving at {u.finish_s}, before the clock ({now})")
        for name in ("buffer", "discarded"):
            for u in lists[name]:
                if u.finish_s > now:
                    raise bad(f".{name}", f"holds client {u.client_id} arriving at {u.finish_s}, after the clock ({now})")
        ids = [u.client_id for u in itertools.chain(*lists.values())]
        if len(set(ids)) != len(ids):
            raise bad("", f"holds two updates of one client (clients {sorted(ids)}); a client has one at most")
        self.flight = [(u.finish_s, u.client_id, u) for u in lists["flight"]]
        heapq.heapify(self.flight)  # the stored heap order: a no-op
        self.buffer, self.discarded = lists["buffer"], lists["discarded"]
        self.now, self.last_step_s = now, last
        self.dispatch_due, self.dispatch_version = tree["dispatch_due"], tree["dispatch_version"]
        self.dispatch_index, self.train_s = tree["dispatch_index"], 0.0

    def _update_from_tree(self, tree: Any, bases: Mapping[int, np.ndarray], path: str, n_clients: int,
                          bad: Callable[[str, str], BadCheckpoint]) -> Update:
        """One stored update, checked: its client, version (one of ``bases``), times, plan and result."""
        if type(tree) is not dict or set(tree) != set(UPDATE_FIELDS):
            raise bad(path, f"is not a dict of the fields {list(UPDATE_FIELDS)}")
        cid, version = tree["client_id"], tree["version"]
        if not _is_int(cid) or not 0 <= cid < n_clients:
            raise bad(f"{path}.client_id", f"is {cid!r:.40}; a client id in [0, {n_clients})")
        if not _is_int(version) or version not in bases:
            raise bad(f"{path}.version", f"is {version!r:.40}; a version whose vector engine.bases holds")
        start, finish, sim = tree["start_s"], tree["finish_s"], tree["sim_s"]
        if not all(_is_float(x) and 0 <= x < math.inf for x in (start, finish, sim)) or start + sim != finish:
            raise bad(path, f"has start_s {start!r:.30}, sim_s {sim!r:.30}, finish_s {finish!r:.30}; finite times "
                            ">= 0 with finish_s = start_s + sim_s")
        try:
            plan = plan_from_tree(tree["plan"], bases[version])
            result = result_from_tree(tree["result"])
            if (plan.client_id, result.client_id) != (cid, cid) or (plan.round, result.round) != (version + 1,) * 2:
                raise ValueError(f"plan and result are of client {plan.client_id}/{result.client_id}, round "
                                 f"{plan.round}/{result.round}; the update's are client {cid}, round {version + 1}")
            if plan.params.size != bases[version].size:
                raise ValueError(f"plan.params holds {plan.params.size} values; the model {bases[version].size}")
            check_results({cid: plan}, [result], type(self.strategy).__name__)
        except (TypeError, ValueError) as e:
            raise bad(path, f": {e}") from e
        return Update(cid, version, start, finish, bases[version], plan, result, sim)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_float(x: Any) -> bool:
    return isinstance(x, (float, np.floating))
