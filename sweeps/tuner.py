"""Running a sweep's trials under Ray Tune on the driver, and what failed.

Per trial: ``tune.with_resources`` with the trial's placement group (:func:`sweeps.trials.trial_resources`),
the trainable :func:`sweeps.trainable.run_trial`, retries by ``FailureConfig(max_failures)`` (a
retry resumes from the run's checkpoint), the live progress line (:class:`sweeps.live.LiveProgress`).
Tune's own files go to ``<out>/_tune``.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import tune

from fedsap_ray.runtime.ray import connect
from fedsap_ray.storage import ResultsDestination
from sweeps.live import LiveProgress
from sweeps.trainable import run_trial
from sweeps.trials import METRIC, trial_name, trial_resources

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
            name=study, storage_path=storage, verbose=0, callbacks=[progress],
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
