"""The Ray Tune trainable: a trial's runs through the one driver loop (:func:`fedsap_ray.run.driver.drive`).

A trial is one simulation, or (``tune.py``'s mean-over-seeds objective) the same config at
several seeds run in lockstep. The trainable opens one :class:`~fedsap_ray.run.session.RunSession`
per seed and drives them with two callbacks:

- :class:`PushResults`: after every round (once its checkpoint is written) and after the runs
  are closed, each run's files go to the sweep's destination (a local path, or any pyarrow
  filesystem URI: the run writes to node-local staging, :class:`fedsap_ray.results.destination.ResultsDestination`);
- :class:`TuneReport`: each round's metrics (means over the seeds) go to Tune, read from each
  session's :class:`~fedsap_ray.run.session.SessionMetrics`; a scheduler that stops the trial
  (Tune raises ``SystemExit`` in ``tune.report``) ends the runs with status ``stopped``. A sweep with
  ``--tracker`` (the trial's ``_trackers``) also reports every run's rounds metrics of the round, for the
  driver's :class:`sweeps.tuner.TrackerLogger`.

Data: :func:`fedsap_ray.data.node_cache.shared_splits` maps the dataset from a node-local
cache, so trials on one node share one decoded copy. A trial resumes each run from its
per-round checkpoint when there is one (a killed driver, a Tune retry); a run that already
finished is never overwritten.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray import tune

from fedsap_ray.run import guard
from fedsap_ray.persist import checkpoint
from fedsap_ray.persist.outdir import OutDir
from fedsap_ray.data.federation import build_federation
from fedsap_ray.data.node_cache import shared_splits
from fedsap_ray.run.driver import DriverCallback, drive
from fedsap_ray.common.errors import RunStopped
from fedsap_ray.runtime import make_backend
from fedsap_ray.config.schema import ExperimentConfig
from fedsap_ray.engine.server import RoundSummary
from fedsap_ray.run.session import RunOutcome, RunSession, SessionMetrics, record_failed_start
from fedsap_ray.results.destination import ResultsDestination
from fedsap_ray.run.trackers import round_metrics
from sweeps.trials import METRIC, flatten, to_configs

TRACKED = "_trackers"  # a trial's flat-config key: the sweep logs to trackers (sweeps.tuner.tracked)
# the report's key for every run's rounds metrics of the round, as JSON text {run_id: {name: value}}: one string,
# so Tune's own loggers under _tune/ keep their few scalars (TensorBoard's logger skips text)
ROUNDS_METRICS = "rounds_metrics"


def run_trial(config: dict[str, Any]) -> None:
    """Tune trainable: run (or resume) the trial's runs in lockstep and report every round.

    With several seeds the reported metrics are means over the seeds at each round (the
    mean-over-seeds objective of ``tune.py``); ``run_id``/``round`` identify the row.
    """
    flat = flatten(config)
    cfgs, run_ids = to_configs(flat)
    dest = ResultsDestination(flat["_out"])
    sessions = open_sessions(cfgs, run_ids, dest, workers=int(flat.get("_workers", 1)))
    rounds = cfgs[0].training.rounds
    drive(sessions, rounds, [PushResults(dest, run_ids), TuneReport(run_ids, rounds, tracked=bool(flat.get(TRACKED)))])


def open_sessions(cfgs: Sequence[ExperimentConfig], run_ids: Sequence[str], dest: ResultsDestination,
                  workers: int) -> list[RunSession]:
    """One session per run, resumed from its checkpoint when it has one. If a run cannot be
    opened (e.g. its data cannot be loaded) it gets a ``failed`` runs row with the error, the
    runs opened before it are closed ``failed``, and the error is raised (Tune retries the trial)."""
    sessions: list[RunSession] = []
    for cfg, run_id in zip(cfgs, run_ids):
        try:
            dest.pull(run_id)
            guard.check_layout(dest.local, run_id)  # a link or a wrong kind among the run's entries: refused
            here = OutDir(dest.local)
            if local_status(dest, run_id) == "finished":  # e.g. a retry after the run had finished
                raise RuntimeError(f"run {run_id} already finished in {dest.uri}; refusing to overwrite it")
            resume = here.is_file(checkpoint.path_for(dest.local, run_id))
            if not resume and here.is_file(checkpoint.legacy_path_for(dest.local, run_id)):  # never unpickled
                raise RuntimeError(checkpoint.legacy_refusal(checkpoint.legacy_path_for(dest.local, run_id)))
            fed = build_federation(cfg, splits=shared_splits(cfg))
            sessions.append(RunSession(cfg, dest.local, run_id, federation=fed, backend=_backend(cfg, workers),
                                       resume=resume))
        except Exception as e:  # no session yet: record the failure so the sweep's runs table shows it
            if local_status(dest, run_id) != "finished":
                record_failed_start(cfg, dest.local, run_id, e)
                dest.push(run_id)
            for other, other_id in zip(sessions, run_ids):
                other.finish("failed", f"another seed of this trial failed: {e.__class__.__name__}: {e}")
                dest.push(other_id)
            raise
    return sessions


def _backend(cfg: ExperimentConfig, workers: int):
    """``workers`` ClientWorker actors (in the trial's placement group), or 0: clients train in this process."""
    r = replace(cfg.resources, backend="ray", num_workers=workers) if workers > 0 else \
        replace(cfg.resources, backend="local", num_workers=1)
    return make_backend(replace(cfg, resources=r))


class PushResults(DriverCallback):
    """Copies each run's files (tables and checkpoint) to the destination once they are durable."""

    def __init__(self, dest: ResultsDestination, run_ids: Sequence[str]) -> None:
        self.dest, self.run_ids = dest, list(run_ids)

    def on_round(self, t: int, summaries: Sequence[RoundSummary], metrics: Sequence[SessionMetrics]) -> None:
        for run_id in self.run_ids:
            self.dest.push(run_id)

    def on_finish(self, outcomes: Sequence[RunOutcome | None]) -> None:
        for run_id in self.run_ids:
            self.dest.push(run_id)


class TuneReport(DriverCallback):
    """Reports every round to Tune (means over the trial's runs) and turns a scheduler's stop into
    :class:`~fedsap_ray.common.errors.RunStopped`. ASHA also "stops" a trial at ``max_t``: after the last
    round that is no stop, the runs finish."""

    def __init__(self, run_ids: Sequence[str], rounds: int, tracked: bool = False) -> None:
        self.ids, self.run_ids, self.rounds = list(run_ids), ",".join(run_ids), rounds
        self.tracked = tracked  # also report every run's rounds metrics (ROUNDS_METRICS)
        self.started = [0] * len(self.ids)  # each run's rounds done when it started: drive steps it after those
        self.in_pg = True

    def on_start(self, metrics: Sequence[SessionMetrics]) -> None:
        self.started = [m.round for m in metrics]
        pg = ray.util.get_current_placement_group()
        here = pg.id.hex() if pg is not None else None
        # every client worker must sit in this trial's placement group (reported, and checked by the tests)
        self.in_pg = all(w.placement_group == here for m in metrics for w in m.workers)
        if metrics and all(m.round >= self.rounds for m in metrics):
            # resumed after a kill that came between the last round's checkpoint and the close:
            # nothing is left to train, but Tune (and Optuna) still get the trial's result
            self._report(self.rounds, [], metrics)

    def on_round(self, t: int, summaries: Sequence[RoundSummary], metrics: Sequence[SessionMetrics]) -> None:
        self._report(t, summaries, metrics)

    def _report(self, t: int, summaries: Sequence[RoundSummary], metrics: Sequence[SessionMetrics]) -> None:
        report = {"round": t, METRIC: mean([m.best_global_accuracy for m in metrics]),
                  "global_accuracy": mean([m.global_accuracy for m in metrics]),
                  "train_loss": mean([s.train_loss for s in summaries]),
                  "avg_capacity": mean([s.avg_capacity for s in summaries]),
                  "run_id": self.run_ids, "workers_in_trial_placement_group": self.in_pg}
        if self.tracked and summaries:
            ran = [run_id for run_id, done in zip(self.ids, self.started) if done < t]  # as drive steps them
            report[ROUNDS_METRICS] = json.dumps({run_id: round_metrics(s.rows) for run_id, s in zip(ran, summaries)})
        try:
            tune.report(report)
        except SystemExit:  # Tune's scheduler stopped this trial
            if t < self.rounds:
                raise RunStopped(f"stopped by the Tune scheduler after round {t}") from None


def local_status(dest: ResultsDestination, run_id: str) -> str | None:
    """The status in the run's own ``runs`` file on this node (None: never started here)."""
    import pyarrow.parquet as pq

    here = OutDir(dest.local)
    f = Path(dest.local) / "runs" / f"{run_id}.parquet"
    if not here.is_file(f):
        return None
    with here.open_read(f) as fh:
        return pq.read_table(fh, columns=["status"]).column("status")[0].as_py()


def mean(xs: Sequence[float | None]) -> float:
    """The mean of the numbers that are not None/NaN (NaN if none is)."""
    ok = [x for x in xs if x is not None and not math.isnan(x)]
    return float(sum(ok) / len(ok)) if ok else float("nan")

