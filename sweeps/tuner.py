"""Running a sweep's trials under Ray Tune on the driver, and what failed.

Per trial: ``tune.with_resources`` with the trial's placement group (:func:`sweeps.trials.trial_resources`),
the trainable :func:`sweeps.trainable.run_trial`, retries by ``FailureConfig(max_failures)`` (a
retry resumes from the run's checkpoint), the live progress line (:class:`sweeps.live.LiveProgress`) and,
with ``--tracker``, :class:`TrackerLogger`. Tune's own files go to ``<out>/_tune``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.logger import LoggerCallback

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.runtime.ray import connect
from fedsap_ray.results.destination import ResultsDestination
from fedsap_ray.run.trackers import TrackedRun, TrackerSpec, kept_files, run_info
from sweeps.live import LiveProgress
from sweeps.trainable import ROUNDS_METRICS, TRACKED, run_trial
from sweeps.trials import METRIC, flatten, to_configs, trial_name, trial_resources

REPO = str(Path(__file__).resolve().parents[1])  # workers of a local Ray import `sweeps` from this checkout


@dataclass
class SweepOptions:
    """What every script's command line sets (see :func:`sweeps.study.add_common_args`)."""

    out: str
    preset: str
    seeds: list[int]
    address: str | None = None
    max_concurrent: int | None = None
    resume: bool = False
    workers_per_trial: int = 1
    server_cpus: float = 1.0
    max_failures: int = 2
    extra: list[str] = field(default_factory=list)
    trackers: tuple[TrackerSpec, ...] = ()  # --tracker / --tracker-uri (fedsap_ray.run.trackers.tracker_specs)


def tracked(opts: SweepOptions) -> dict[str, bool]:
    """What a trial's flat config gains when the sweep logs to trackers: its trainable then reports each
    round's metrics too (:class:`sweeps.trainable.TuneReport`); nothing otherwise, so Tune's files stay small."""
    return {TRACKED: True} if opts.trackers else {}


def connect_driver(address: str | None) -> None:
    """Ray for a sweep driver: :func:`fedsap_ray.runtime.ray.connect` without the dashboard or worker
    logs on the console, Tune's loggers quiet, workers able to import ``sweeps``."""
    for name in ("ray.tune", "ray.air", "ray.train"):
        logging.getLogger(name).setLevel(logging.WARNING)
    connect(address, dashboard=False, log_to_driver=False, import_paths=[REPO], field="--address")


def run_trials(trials: list[dict[str, Any]], opts: SweepOptions, study: str, *, search_alg=None,
               scheduler=None, num_samples: int = 1, param_space: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Run ``trials`` (flat dicts) — or ``num_samples`` draws from ``param_space`` with ``search_alg`` —
    under Tune; return ``(trial, error)`` for every trial that still failed after its retries.

    A Ray this call started is shut down before it returns: left to the interpreter's exit, Ray's
    teardown after a Tune run took about 40 s on 2 cores (a 19-trial smoke sweep: 88 s against 47 s)."""
    started = not ray.is_initialized()
    connect_driver(opts.address)
    try:
        return _fit(trials, opts, study, search_alg=search_alg, scheduler=scheduler, num_samples=num_samples,
                    param_space=param_space)
    finally:
        if started:
            ray.shutdown()


def _fit(trials: list[dict[str, Any]], opts: SweepOptions, study: str, *, search_alg, scheduler, num_samples: int,
         param_space: dict[str, Any] | None) -> list[tuple[str, str]]:
    dest = ResultsDestination(opts.out)
    on_cluster = bool(opts.address or os.environ.get("RAY_ADDRESS")) or sum(n.get("Alive", False) for n in ray.nodes()) > 1
    if on_cluster and not dest.is_remote:
        print(f"note: --out {opts.out} is a local path: trials on other nodes of the cluster write to that path on "
              "their own disk; use a shared filesystem path or a URI (--out s3://bucket/sweep) so every result "
              "lands in one place", file=sys.stderr)
    storage = dest.uri.rstrip("/") + "/_tune" if dest.is_remote else str(Path(dest.local) / "_tune")  # absolute
    if param_space is None:
        param_space = {"trial": tune.grid_search(trials)}
        total = len(trials)
        sample = trials[0]
    else:
        total = num_samples
        sample = {k: v for k, v in param_space.items() if not isinstance(v, tune.search.sample.Domain)}
    trainable = tune.with_resources(run_trial, trial_resources(sample))
    progress = LiveProgress(total)
    callbacks: list[tune.Callback] = [progress]
    if opts.trackers:
        callbacks.append(TrackerLogger(opts.trackers, None if dest.is_remote else dest.local))
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            num_samples=num_samples, search_alg=search_alg, scheduler=scheduler,
            max_concurrent_trials=opts.max_concurrent, reuse_actors=True,
            metric=None if search_alg is not None or scheduler is not None else METRIC,
            mode=None if search_alg is not None or scheduler is not None else "max",
            trial_name_creator=_trial_dirname, trial_dirname_creator=_trial_dirname),
        run_config=tune.RunConfig(
            name=study, storage_path=storage, verbose=0, callbacks=callbacks,
            failure_config=tune.FailureConfig(max_failures=opts.max_failures)),
    )
    tuner.fit()
    return [(trial_name(trial.config), error_line(trial.get_error())) for trial in progress.errored]


def error_line(text: object) -> str:
    """The last line of a trial's error text (``Trial.get_error``: Tune's ``error.txt``), as
    ``Type: message`` without the module path. Never ``Trial.get_pickled_error``: it unpickles the
    trial's ``error.pkl`` from the results destination, which could run code left there."""
    lines = [line.strip() for line in str(text or "").splitlines() if line.strip()]
    last = lines[-1] if lines else "the trial failed (no error text)"
    return re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=\w+: )", "", last)[:500]


def _trial_dirname(trial) -> str:
    return f"{trial_name(trial.config)}_{trial.trial_id}"[:120]


class TrackerLogger(LoggerCallback):
    """``--tracker`` for a sweep: on the driver, one tracker run per run of every trial (a trial of several seeds
    has one per seed, tagged with the trial's name), fed by :class:`fedsap_ray.run.trackers.TrackedRun` exactly as
    ``fedsap-ray run --tracker`` feeds its run.

    Why not Tune's own TBXLoggerCallback / MLflowLoggerCallback / WandbLoggerCallback: they log at Tune's
    ``training_iteration``, which starts again at 1 when a trial is retried or resumed from our checkpoints (ours
    log at step = the round), their parameters are Tune's flat trial dict with the sweep's bookkeeping (``_out``,
    ``_workers``, ...) instead of each run's resolved config and seed, they set no study/variant/seed tags, they
    log every reported number under one run per trial (a trial of several seeds reports means), and they store
    the trial's Tune folder instead of the kept models. Each trial reports its rounds' metrics
    (:data:`sweeps.trainable.ROUNDS_METRICS`: per run, :func:`fedsap_ray.run.trackers.round_metrics` of the rows
    it wrote), and this logs them at step = the round."""

    def __init__(self, specs: tuple[TrackerSpec, ...], local_out: str | None) -> None:
        self.specs, self.local_out = specs, local_out
        self.runs: dict[str, TrackedRun] = {}  # run id -> its trackers' runs
        self.of_trial: dict[str, list[str]] = {}  # Tune trial id -> its run ids with open tracker runs

    def log_trial_result(self, iteration: int, trial, result: dict) -> None:
        payload = result.get(ROUNDS_METRICS)
        if not payload:
            return
        rnd = int(result["round"])
        for run_id, metrics in json.loads(payload).items():
            run = self.runs.get(run_id) or self._open(trial, run_id, rnd)
            run.log(rnd, metrics)

    def _open(self, trial, run_id: str, first_round: int) -> TrackedRun:
        flat = flatten(trial.config)
        cfgs, run_ids = to_configs(flat)
        cfg = cfgs[run_ids.index(run_id)]
        info = run_info(cfg, run_id, first_round, variant=flat.get("_variant"), trial=trial_name(trial.config))
        run = self.runs[run_id] = TrackedRun(self.specs, info)
        self.of_trial.setdefault(trial.trial_id, []).append(run_id)
        return run

    def log_trial_end(self, trial, failed: bool = False) -> None:
        for run_id in self.of_trial.pop(trial.trial_id, []):
            self._close(run_id, "failed" if failed else "finished")

    def on_experiment_end(self, trials, **info) -> None:
        for run_id in list(self.runs):  # a driver stopped before its trials ended
            self._close(run_id, "interrupted")

    def _close(self, run_id: str, status: str) -> None:
        run = self.runs.pop(run_id)
        files: list[Path] = []
        if self.local_out is not None and status != "interrupted":
            try:
                files = kept_files(self.local_out, run_id)
            except (ConfigError, OSError) as e:
                run.warn(f"trackers get no model files of run {run_id}: {e}")
        run.finish(status, files)
