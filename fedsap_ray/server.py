"""The round loop (docs/architecture.md#one-round), pure and backend-agnostic.

    plans   = strategy.configure_round(state, t)
    results = backend.train(plans)             # any order, any worker
    state   = strategy.aggregate(state, results, t)
    metrics = evaluate(strategy.eval_sets(state, eval_domains))
    writer.add(rows of rounds, clients, layers, allocations); writer.flush()

The server is the recording side: it holds the whole federation, so what a strategy must not
know (true domains, TV distances) enters the results here (``true_domain``, ``tv_distance``,
``ari_domain``) and evaluation gets the domain structure as an explicit argument
(:class:`~fedsap_ray.data.base.EvalDomains`). Each table's rows come from one method
(``_rounds_rows``, ``_clients_rows``, ``_layers_rows``, ``_allocations_rows``) and may hold only
core columns and the ones the strategy declares (:attr:`Strategy.columns`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from torch import nn

from fedsap_ray.algorithms.base import RunContext, Strategy
from fedsap_ray.algorithms.grouping import agreement
from fedsap_ray.evaluate import DeployedModel, evaluate_deployed, evaluate_domains, summarise
from fedsap_ray.messages import ClientPlan, ClientResult, ServerState
from fedsap_ray.results import CORE_TABLES, DATA_TABLES, GLOBAL_DOMAIN, RunWriter
from fedsap_ray.seeding import rng_for

DEPLOYED = "deployed"  # the eval mode of each client's own model (fedsap_ray.evaluate)


class Backend(Protocol):
    name: str

    def start(self, ctx: RunContext) -> None: ...

    def train(self, plans: dict[int, ClientPlan]) -> list[ClientResult]: ...

    def close(self) -> None: ...


@dataclass
class RoundSummary:
    round: int
    evaluated: bool
    global_accuracy: float
    best_global_accuracy: float
    worst_domain: str | None
    worst_domain_accuracy: float
    avg_capacity: float
    bytes_up: int
    bytes_down: int
    train_loss: float
    wall_s: float
    per_domain: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the round columns (strategy's and ground-truth ones)
    progress: str = ""  # the strategy's part of the progress line (Strategy.progress_text)
    deployed_accuracy: float | None = None  # the 'deployed' eval mode's global figure (None: not evaluated)
    worst_client_accuracy: float | None = None  # ... and its worst client


class Server:
    """One round at a time: strategy + backend + evaluation + results rows."""

    def __init__(self, ctx: RunContext, strategy: Strategy, backend: Backend, writer: RunWriter,
                 eval_models: list[nn.Module], device) -> None:
        self.ctx, self.strategy, self.backend, self.writer = ctx, strategy, backend, writer
        self.eval_scratch, self.device = eval_models, device
        self.best_by_mode: dict[str, float] = {}  # best-so-far global accuracy per eval mode
        self.primary_mode: str | None = None  # the first eval mode: drives global/best accuracy
        self.last_global = float("nan")
        self.last_summary: RoundSummary | None = None
        self.trainable = ctx.trainable
        # per domain, the union of its clients' plan coverage since initialisation (papers/003 Proposition 3
        # per domain); every client has a domain, so the union over domains is the run's coverage
        self.domain_covered = {d: np.zeros_like(self.trainable) for d in ctx.federation.domains}
        self.deployed_clients, self.deployed_sampled = deployed_sample(ctx)
        self.eval_domains = ctx.federation.eval_domains()  # evaluation-only ground truth (Strategy.eval_sets)
        self.allowed_columns = {t: {c.name for c in [*CORE_TABLES[t], *strategy.declared_columns(t)]}
                                for t in DATA_TABLES}  # what each table's rows may hold (_add)

    @property
    def best(self) -> float:
        """Best-so-far global accuracy of the primary eval mode (NaN before any evaluation)."""
        return float("nan") if self.primary_mode is None else self.best_by_mode.get(self.primary_mode, float("nan"))

    def metrics_state(self) -> dict[str, Any]:
        """The running metrics a checkpoint must carry so a resumed run writes the same rows."""
        return {"best_by_mode": dict(self.best_by_mode), "primary_mode": self.primary_mode,
                "last_global": self.last_global,
                "domain_covered": {d: m.copy() for d, m in self.domain_covered.items()}}

    def restore_metrics(self, m: dict[str, Any]) -> None:
        self.best_by_mode = dict(m["best_by_mode"])
        self.primary_mode, self.last_global = m["primary_mode"], m["last_global"]
        self.domain_covered = {d: np.asarray(v, dtype=bool).copy() for d, v in m["domain_covered"].items()}

    def round(self, state: ServerState, t: int) -> ServerState:
        t0 = time.perf_counter()
        plans = self.strategy.configure_round(state, t)
        if not plans:
            raise RuntimeError(f"round {t}: the strategy selected no clients")
        for plan in plans.values():
            dom = self.domain_covered[self.ctx.federation.clients[plan.client_id].domain]
            if plan.mask is None:
                dom[:] = True
            else:
                dom |= plan.mask
        results = sorted(self.backend.train(plans), key=lambda r: r.client_id)
        missing = set(plans) - {r.client_id for r in results}
        if missing:
            raise RuntimeError(f"round {t}: no result from clients {sorted(missing)}")
        new_state = self.strategy.aggregate(state, results, t)
        cfg = self.ctx.cfg
        evaluated = _due(t, cfg.training.eval_every, cfg.training.rounds)
        by_mode: dict[str, dict[str, tuple[float, float]]] = {}
        if evaluated:
            for mode, models in self.strategy.eval_sets(new_state, self.eval_domains).items():
                by_mode[mode] = evaluate_domains(self.eval_scratch, self.ctx.layout, models,
                                                 self.ctx.federation.test, self.device)
        deployed_now = _due(t, cfg.training.deployed_every, cfg.training.rounds)
        deployed = (self._evaluate_deployed(new_state) if evaluated and deployed_now and cfg.training.eval_deployed
                    else {})
        summary = self._record(new_state, t, plans, results, by_mode, deployed, time.perf_counter() - t0)
        self.last_summary = summary
        return new_state

    def _update_best(self, mode: str, accuracy: float) -> float:
        """The best-so-far global accuracy of ``mode`` after this round's ``accuracy``."""
        prev = self.best_by_mode.get(mode, float("nan"))
        self.best_by_mode[mode] = accuracy if np.isnan(prev) else max(prev, accuracy)
        return self.best_by_mode[mode]

    def _evaluate_deployed(self, state: ServerState) -> dict[int, tuple[float, float]]:
        """(accuracy, loss) of every evaluated client's deployed model on its own domain (fedsap_ray.evaluate)."""
        fed = self.ctx.federation
        models = []
        for cid in self.deployed_clients:
            params, mask = self.strategy.deployed_model(state, cid)
            models.append(DeployedModel(cid, fed.clients[cid].domain, params, mask))
        weights = ({c.client_id: c.label_counts for c in fed.clients} if len(fed.domains) == 1 else None)
        bn_data = ({cid: fed.client_data(cid) for cid in self.deployed_clients}
                   if self.ctx.cfg.training.deployed_bn == "client" else None)
        return evaluate_deployed(self.eval_scratch, self.ctx.layout, models, fed.test, self.device,
                                 fed.num_classes, weights, bn_data)

    def _deployed_rows(self, per_client: dict[int, tuple[float, float]], common: dict[str, Any],
                       coverage: dict[str, float], run_coverage: float) -> list[dict[str, Any]]:
        """Per domain: the sample-weighted mean over its evaluated clients and its worst client; the global
        row: the unweighted mean over domains (as for the other modes) and the worst client overall."""
        fed = self.ctx.federation
        by_domain: dict[str, list[int]] = {}
        for cid in per_client:
            by_domain.setdefault(fed.clients[cid].domain, []).append(cid)
        per_domain: dict[str, tuple[float, float]] = {}
        rows: list[dict[str, Any]] = []
        for d in fed.domains:
            ids = by_domain.get(d)
            if not ids:
                continue
            w = np.array([fed.clients[c].n_samples for c in ids], dtype=np.float64)
            w = w / w.sum() if w.sum() > 0 else np.full(len(ids), 1.0 / len(ids))
            acc = float(sum(wi * per_client[c][0] for wi, c in zip(w, ids)))
            loss = float(sum(wi * per_client[c][1] for wi, c in zip(w, ids)))
            per_domain[d] = (acc, loss)
            worst = min(ids, key=lambda c: (per_client[c][0], c))
            rows.append(dict(domain=d, accuracy=acc, loss=loss, n_test=len(fed.test[d]), n_eval_clients=len(ids),
                             worst_client_id=worst, worst_client_accuracy=per_client[worst][0]))
        s = summarise(per_domain)
        best = self._update_best(DEPLOYED, s["global_accuracy"])
        worst = min(per_client, key=lambda c: (per_client[c][0], c))
        rows.append(dict(domain=GLOBAL_DOMAIN, accuracy=s["global_accuracy"], loss=s["loss"],
                         n_test=sum(len(fed.test[d]) for d in per_domain), n_eval_clients=len(per_client),
                         worst_client_id=worst, worst_client_accuracy=per_client[worst][0]))
        g = dict(global_accuracy=s["global_accuracy"], best_global_accuracy=best,
                 worst_domain_accuracy=s["worst_domain_accuracy"])
        return [dict(eval_mode=DEPLOYED, evaluated=True, eval_clients_sampled=self.deployed_sampled,
                     domain_coverage=coverage.get(r["domain"], run_coverage), **r, **g, **common) for r in rows]

    # --- recording: one function per table; ground truth enters here, never in the strategy -------------
    def _record(self, state: ServerState, t: int, plans: dict[int, ClientPlan], results: list[ClientResult],
                by_mode: dict[str, dict[str, tuple[float, float]]], deployed: dict[int, tuple[float, float]],
                wall: float) -> RoundSummary:
        """Write this round's rows of every table, flush, and summarise the round for the progress line."""
        cost = self._round_cost(plans, results)
        columns = self._round_columns(state)
        rows, deployed_global = self._rounds_rows(t, cost, columns, by_mode, deployed, wall)
        self._add("rounds", rows)
        self._add("clients", self._clients_rows(state, t, plans, results))
        self._add("layers", self._layers_rows(state, t, plans))
        self._add("allocations", self._allocations_rows(state, t))
        self.writer.flush()
        primary = self.primary_mode if by_mode else None
        per_domain = by_mode.get(primary, {}) if primary else {}
        worst_dom = min(per_domain, key=lambda d: per_domain[d][0]) if per_domain else None
        worst = summarise(per_domain)["worst_domain_accuracy"] if per_domain else float("nan")
        return RoundSummary(round=t, evaluated=bool(by_mode), global_accuracy=self.last_global,
                            best_global_accuracy=self.best, worst_domain=worst_dom, worst_domain_accuracy=worst,
                            avg_capacity=cost["avg_capacity"], bytes_up=cost["bytes_up"],
                            bytes_down=cost["bytes_down"], train_loss=cost["train_loss"], wall_s=wall,
                            per_domain={d: a for d, (a, _) in per_domain.items()}, extra=columns,
                            progress=self.strategy.progress_text(columns),
                            deployed_accuracy=deployed_global.get("accuracy"),
                            worst_client_accuracy=deployed_global.get("worst_client_accuracy"))

    def _add(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Rows of ``table``, which may hold only core columns and the strategy's declared ones."""
        allowed = self.allowed_columns[table]
        for r in rows:
            extra = set(r) - allowed
            if extra:
                raise KeyError(f"{table}: {type(self.strategy).__name__} wrote columns {sorted(extra)} it does not "
                               f"declare (Strategy.columns)")
        self.writer.add(table, rows)

    def _round_cost(self, plans: dict[int, ClientPlan], results: list[ClientResult]) -> dict[str, Any]:
        """What the round's clients trained and sent (the same on every ``rounds`` row of the round)."""
        n_total = sum(r.n_samples for r in results)
        return dict(n_clients=len(results),
                    bytes_up=sum(r.bytes_up + plans[r.client_id].side_bytes_up for r in results),
                    bytes_down=sum(p.bytes_down for p in plans.values()),
                    train_loss=float(sum(r.train_loss * r.n_samples for r in results) / max(n_total, 1)),
                    avg_capacity=float(np.mean([p.capacity_used for p in plans.values()])))

    def _round_columns(self, state: ServerState) -> dict[str, Any]:
        """The strategy's declared round columns plus those computed here from ground truth: ``ari_domain``
        of the client groups it formed this round against the true domains."""
        columns = dict(self.strategy.round_columns(state))
        groups = self.strategy.client_groups(state)
        if groups is not None:
            columns["ari_domain"] = agreement(groups, [c.domain for c in self.ctx.federation.clients])
        return columns

    def _rounds_rows(self, t: int, cost: dict[str, Any], columns: dict[str, Any],
                     by_mode: dict[str, dict[str, tuple[float, float]]], deployed: dict[int, tuple[float, float]],
                     wall: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """``rounds``: per eval mode one row per test domain and a global row (or one unevaluated row), then
        the deployed rows; updates best-so-far accuracies. Returns (rows, the deployed global row or {})."""
        fed = self.ctx.federation
        n_trainable = int(self.trainable.sum())
        ever_covered = np.logical_or.reduce(list(self.domain_covered.values()))
        frozen = n_trainable - int((ever_covered & self.trainable).sum())
        coverage = {d: int((m & self.trainable).sum()) / n_trainable for d, m in self.domain_covered.items()}
        common: dict[str, Any] = dict(round=t, avg_capacity=cost["avg_capacity"], frozen_params=frozen,
                                      n_clients=cost["n_clients"], bytes_up=cost["bytes_up"],
                                      bytes_down=cost["bytes_down"], train_loss=cost["train_loss"],
                                      round_wall_s=wall, **columns)
        rows = []
        primary = next(iter(by_mode), None)
        for mode, per_domain in by_mode.items():
            s = summarise(per_domain)
            best = self._update_best(mode, s["global_accuracy"])
            if mode == primary:
                self.primary_mode, self.last_global = mode, s["global_accuracy"]
            g = dict(global_accuracy=s["global_accuracy"], best_global_accuracy=best,
                     worst_domain_accuracy=s["worst_domain_accuracy"])
            for d, (acc, loss) in per_domain.items():
                rows.append(dict(domain=d, eval_mode=mode, evaluated=True, accuracy=acc, loss=loss,
                                 n_test=len(fed.test[d]), domain_coverage=coverage.get(d), **g, **common))
            rows.append(dict(domain=GLOBAL_DOMAIN, eval_mode=mode, evaluated=True, accuracy=s["global_accuracy"],
                             loss=s["loss"], n_test=sum(len(v) for v in fed.test.values()),
                             domain_coverage=1.0 - frozen / n_trainable, **g, **common))
        deployed_global: dict[str, Any] = {}
        if deployed:
            rows.extend(self._deployed_rows(deployed, common, coverage, 1.0 - frozen / n_trainable))
            deployed_global = rows[-1]
        if not by_mode:
            rows.append(dict(domain=GLOBAL_DOMAIN, eval_mode=None, evaluated=False,
                             best_global_accuracy=None if np.isnan(self.best) else self.best,
                             domain_coverage=1.0 - frozen / n_trainable, **common))
        return rows, deployed_global

    def _clients_rows(self, state: ServerState, t: int, plans: dict[int, ClientPlan],
                      results: list[ClientResult]) -> list[dict[str, Any]]:
        """``clients``: one row per client that trained; ``true_domain`` and ``tv_distance`` are ground truth
        added here, the strategy adds its declared columns (:meth:`Strategy.client_columns`)."""
        fed = self.ctx.federation
        rows = []
        for r in results:
            plan = plans[r.client_id]
            spec = fed.clients[r.client_id]
            row = dict(round=t, client_id=r.client_id, true_domain=spec.domain, pruning_ratio=spec.pruning_ratio,
                       capacity_max=spec.capacity, capacity_used=plan.capacity_used, tv_distance=spec.tv_distance,
                       n_samples=r.n_samples, train_loss=r.train_loss,
                       params_trained=self.strategy.params_trained(plan, r),
                       macs_per_sample=self.strategy.mask_macs(plan.mask),  # a strategy may refine it below
                       train_macs=self.strategy.train_macs(plan, r), bytes_up=r.bytes_up + plan.side_bytes_up,
                       bytes_down=plan.bytes_down, wall_s=r.wall_s, worker=r.worker, gpu_id=r.gpu_id)
            row.update(self.strategy.client_columns(state, plan, r))
            rows.append(row)
        return rows

    def _layers_rows(self, state: ServerState, t: int, plans: dict[int, ClientPlan]) -> list[dict[str, Any]]:
        """``layers``: the strategy's rows (where each client's channel budget went), if it writes any."""
        return [dict(round=t, **r) for r in self.strategy.layer_rows(state, plans)]

    def _allocations_rows(self, state: ServerState, t: int) -> list[dict[str, Any]]:
        """``allocations``: the strategy's rows, each with the client's ``tv_distance`` (ground truth) added."""
        fed = self.ctx.federation
        return [dict(round=t, **r, tv_distance=fed.clients[r["client_id"]].tv_distance)
                for r in self.strategy.allocation_rows(state, t)]


def _due(t: int, every: int, rounds: int) -> bool:
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
