"""The recording side of a round: every results table's rows, where ground truth enters the results.

:class:`Recorder` turns what a round produced (plans, results, the strategy's
:class:`~fedsap_ray.common.messages.RoundRecords`, the evaluation) into rows of ``rounds``, ``clients``,
``layers`` and ``allocations`` and writes them. It holds the whole federation, so what a strategy
must not know enters here: ``true_domain`` and ``tv_distance`` of every client, and ``ari_domain``,
the agreement of the client groups a strategy formed with the true domains. Rows may hold only
core columns and the ones the strategy declares (``Strategy.columns``). Its running metrics
(best-so-far accuracies, per-domain coverage) are what a checkpoint must carry besides the
strategy's state (:meth:`Recorder.metrics_state`), so a resumed run writes the same rows.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsap_ray.common.columns import Column
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.algorithms.declarations import declared_columns
from fedsap_ray.data.devices import SimRound
from fedsap_ray.engine.evaluate import summarise
from fedsap_ray.algorithms.grouping import agreement
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundRecords
from fedsap_ray.engine.summary import DEPLOYED, PhaseTimes, RoundEvaluation, RoundSummary
from fedsap_ray.results.schema import CORE_TABLES, DATA_TABLES, GLOBAL_DOMAIN
from fedsap_ray.results.writer import RunWriter

if TYPE_CHECKING:
    from fedsap_ray.algorithms import Strategy

TABLES_DECLARED = ("rounds", "clients", "layers", "allocations")  # the tables a strategy may declare columns of

class Recorder:
    """Rows of every table for one run; one method per table."""

    def __init__(self, ctx: RunContext, declared: Mapping[str, list[Column]], writer: RunWriter,
                 strategy_name: str, deployed_sampled: bool) -> None:
        self.ctx, self.writer, self.strategy_name = ctx, writer, strategy_name
        self.deployed_sampled = deployed_sampled  # whether the deployed clients are a sample (training.eval_clients)
        self.best_by_mode: dict[str, float] = {}  # best-so-far global accuracy per eval mode
        self.primary_mode: str | None = None  # the first eval mode: drives global/best accuracy
        self.last_global = float("nan")
        self.sim_elapsed_s = 0.0  # simulated device seconds of the rounds so far (fedsap_ray.data.devices)
        self.trainable = ctx.trainable
        # per domain, the union of its clients' plan coverage since initialisation (papers/003 Proposition 3
        # per domain); every client has a domain, so the union over domains is the run's coverage
        self.domain_covered = {d: np.zeros_like(self.trainable) for d in ctx.federation.domains}
        self.allowed_columns = {t: {c.name for c in [*CORE_TABLES[t], *declared.get(t, [])]}
                                for t in DATA_TABLES}  # what each table's rows may hold (_add)

    @classmethod
    def for_strategy(cls, ctx: RunContext, strategy: Strategy, writer: RunWriter, deployed_sampled: bool) -> Recorder:
        """The recorder of a run of ``strategy``: rows may hold the core columns and the ones it declares."""
        return cls(ctx, {t: declared_columns(type(strategy), t) for t in TABLES_DECLARED}, writer, type(strategy).__name__,
                   deployed_sampled=deployed_sampled)

    @property
    def best(self) -> float:
        """Best-so-far global accuracy of the primary eval mode (NaN before any evaluation): the papers' selection
        figure (``rounds.best_global_accuracy``), and what a kept ``best`` model is kept by (a round that strictly
        raises it: :mod:`fedsap_ray.results.kept`)."""
        return float("nan") if self.primary_mode is None else self.best_by_mode.get(self.primary_mode, float("nan"))

    def metrics_state(self) -> dict[str, Any]:
        """The running metrics a checkpoint must carry so a resumed run writes the same rows."""
        return {"best_by_mode": dict(self.best_by_mode), "primary_mode": self.primary_mode,
                "last_global": self.last_global, "sim_elapsed_s": self.sim_elapsed_s,
                "domain_covered": {d: m.copy() for d, m in self.domain_covered.items()}}

    def restore_metrics(self, m: dict[str, Any]) -> None:
        self.best_by_mode = dict(m["best_by_mode"])
        self.primary_mode, self.last_global = m["primary_mode"], m["last_global"]
        self.sim_elapsed_s = float(m.get("sim_elapsed_s", 0.0))  # checkpoints from before simulated time: 0
        self.domain_covered = {d: np.asarray(v, dtype=bool).copy() for d, v in m["domain_covered"].items()}

    def count_coverage(self, plans: Mapping[int, ClientPlan]) -> None:
        """Add the round's plan coverage to each client's domain (``domain_coverage``, ``frozen_params``)."""
        done: set[tuple[str, int]] = set()  # (domain, mask object): clients of one width share their mask
        for plan in plans.values():
            domain = self.ctx.federation.clients[plan.client_id].domain
            if (domain, id(plan.mask)) in done:
                continue
            done.add((domain, id(plan.mask)))
            dom = self.domain_covered[domain]
            if plan.mask is None:
                dom[:] = True
            else:
                dom |= plan.mask

    def _update_best(self, mode: str, accuracy: float) -> float:
        """The best-so-far global accuracy of ``mode`` after this round's ``accuracy``."""
        prev = self.best_by_mode.get(mode, float("nan"))
        self.best_by_mode[mode] = accuracy if np.isnan(prev) else max(prev, accuracy)
        return self.best_by_mode[mode]

    def record(self, t: int, plans: Mapping[int, ClientPlan], results: list[ClientResult], records: RoundRecords,
               ev: RoundEvaluation, times: PhaseTimes, sim: SimRound) -> RoundSummary:
        """Write this round's rows of every table, flush, and summarise the round for the progress line."""
        by_mode, deployed = ev.by_mode, ev.deployed
        self.sim_elapsed_s += sim.round_s
        cost = self._round_cost(plans, results)
        cost.update(sim_round_s=sim.round_s, sim_elapsed_s=self.sim_elapsed_s, n_stragglers=len(sim.stragglers))
        columns = self._round_columns(records)
        rows, deployed_global = self._rounds_rows(t, cost, columns, by_mode, deployed, times)
        self._add("rounds", rows)
        self._add("clients", self._clients_rows(t, plans, results, records, sim))
        self._add("layers", [dict(round=t, **r) for r in records.layers])
        fed = self.ctx.federation
        self._add("allocations", [dict(round=t, **r, tv_distance=fed.clients[r["client_id"]].tv_distance)
                                  for r in records.allocations])
        self.writer.flush()
        primary = self.primary_mode if by_mode else None
        per_domain = by_mode.get(primary, {}) if primary else {}
        worst_dom = min(per_domain, key=lambda d: per_domain[d][0]) if per_domain else None
        worst = summarise(dict(per_domain))["worst_domain_accuracy"] if per_domain else float("nan")
        return RoundSummary(round=t, evaluated=bool(by_mode), global_accuracy=self.last_global,
                            best_global_accuracy=self.best, worst_domain=worst_dom, worst_domain_accuracy=worst,
                            avg_capacity=cost["avg_capacity"], bytes_up=cost["bytes_up"],
                            bytes_down=cost["bytes_down"], train_loss=cost["train_loss"], wall_s=times.total,
                            per_domain={d: a for d, (a, _) in per_domain.items()}, times=times, columns=columns,
                            progress=records.progress.format_map(_Blank(columns)) if records.progress else "",
                            deployed_accuracy=deployed_global.get("accuracy"),
                            worst_client_accuracy=deployed_global.get("worst_client_accuracy"),
                            sim_elapsed_s=self.sim_elapsed_s, n_stragglers=cost["n_stragglers"], rows=tuple(rows))

    def _add(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Rows of ``table``, which may hold only core columns and the strategy's declared ones."""
        allowed = self.allowed_columns[table]
        for r in rows:
            extra = set(r) - allowed
            if extra:
                raise KeyError(f"{table}: {self.strategy_name} wrote columns {sorted(extra)} it does not "
                               f"declare (Strategy.columns)")
        self.writer.add(table, rows)

    def _round_cost(self, plans: Mapping[int, ClientPlan], results: list[ClientResult]) -> dict[str, Any]:
        """What the round's clients trained and sent (the same on every ``rounds`` row of the round)."""
        n_total = sum(r.n_samples for r in results)
        return dict(n_clients=len(results),
                    bytes_up=sum(r.bytes_up + plans[r.client_id].side_bytes_up for r in results),
                    bytes_down=sum(p.bytes_down for p in plans.values()),
                    train_loss=float(sum(r.train_loss * r.n_samples for r in results) / max(n_total, 1)),
                    # a round of no client (privacy.sampling=poisson) trained no width
                    avg_capacity=float(np.mean([p.capacity_used for p in plans.values()])) if plans else None)

    def _round_columns(self, records: RoundRecords) -> dict[str, Any]:
        """The strategy's round columns plus those computed here from ground truth: ``ari_domain`` of the
        client groups it formed this round against the true domains."""
        columns = dict(records.rounds)
        if records.groups is not None:
            columns["ari_domain"] = agreement(records.groups, [c.domain for c in self.ctx.federation.clients])
        return columns

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

    def _rounds_rows(self, t: int, cost: dict[str, Any], columns: dict[str, Any],
                     by_mode: Mapping[str, Mapping[str, tuple[float, float]]], deployed: Mapping[int, tuple[float, float]],
                     times: PhaseTimes) -> tuple[list[dict[str, Any]], dict[str, Any]]:
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
                                      round_wall_s=times.total, train_s=times.train_s, eval_s=times.eval_s,
                                      server_s=times.server_s, backend_bytes_down=times.moved_down,
                                      backend_bytes_up=times.moved_up, eval_compiles=times.eval_compiles,
                                      sim_round_s=cost["sim_round_s"],
                                      sim_elapsed_s=cost["sim_elapsed_s"], n_stragglers=cost["n_stragglers"], **columns)
        rows = []
        primary = next(iter(by_mode), None)
        for mode, per_domain in by_mode.items():
            s = summarise(dict(per_domain))
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
            rows.extend(self._deployed_rows(dict(deployed), common, coverage, 1.0 - frozen / n_trainable))
            deployed_global = rows[-1]
        if not by_mode:
            rows.append(dict(domain=GLOBAL_DOMAIN, eval_mode=None, evaluated=False,
                             best_global_accuracy=None if np.isnan(self.best) else self.best,
                             domain_coverage=1.0 - frozen / n_trainable, **common))
        return rows, deployed_global

    def _clients_rows(self, t: int, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                      records: RoundRecords, sim: SimRound) -> list[dict[str, Any]]:
        """``clients``: one row per client that trained; ``true_domain`` and ``tv_distance`` are ground truth
        added here, the strategy's records add what the client spent and its declared columns."""
        fed = self.ctx.federation
        rows = []
        for r in results:
            plan = plans[r.client_id]
            spec = fed.clients[r.client_id]
            row = dict(round=t, client_id=r.client_id, true_domain=spec.domain, pruning_ratio=spec.pruning_ratio,
                       capacity_max=spec.capacity, capacity_used=plan.capacity_used, tv_distance=spec.tv_distance,
                       n_samples=r.n_samples, train_loss=r.train_loss, bytes_up=r.bytes_up + plan.side_bytes_up,
                       bytes_down=plan.bytes_down, wall_s=r.wall_s, worker=r.worker, gpu_id=r.gpu_id, node=r.node,
                       compile=r.compile,
                       sim_time_s=sim.client_s[r.client_id], straggler=r.client_id in sim.stragglers)
            row.update(records.clients[r.client_id])
            rows.append(row)
        return rows


class _Blank(dict):
    """format_map's mapping for a progress template: a column the round lacks formats as nothing."""

    def __missing__(self, key: str) -> str:
        return ""
