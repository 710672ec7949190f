"""The Ray Tune machinery every study script shares (docs/architecture.md#design-rules: thin sweep scripts).

A *trial* is one simulation (or, for ``tune.py``'s mean-over-seeds objective, the same
config at several seeds run in lockstep). Tune hands the trainable a flat dict of dotted
config keys (``{"algorithm.g_target": 0.8, "seed": 0, ...}``) plus sweep metadata under
``_``-prefixed keys; :func:`to_configs` turns it into typed, validated
:class:`~fedsap_ray.config.ExperimentConfig` objects at that boundary.

Per trial:

- resources: ``tune.with_resources`` + a ``PlacementGroupFactory`` with one bundle for the
  server (the trainable itself: round logic, aggregation, evaluation, Parquet writer) and
  one per client worker (``resources.cpus_per_worker`` / ``gpus_per_worker``); the
  ``ClientWorker`` actors the trainable creates are captured into that placement group.
  ``--workers-per-trial 0`` trains the clients inside the trial process instead.
- data: :func:`fedsap_ray.data.node_cache.shared_splits` maps the dataset from a
  node-local cache, so trials on one node share one decoded copy (page cache).
- results: rows go to the sweep's results folder (a local path, or any pyarrow
  filesystem URI such as ``s3://bucket/sweep``: the run writes to node-local staging and
  every round is pushed, see :class:`fedsap_ray.storage.ResultsDestination`); each
  round's metrics are reported to Tune.
- ids: run ids are deterministic (``<variant>-s<seed>``, or a config hash for sampled
  trials), so each trial owns exactly one set of rows.

Resuming (``--resume``): finished runs are skipped; every other trial runs again and
continues from its per-round checkpoint (``fedsap_ray.checkpoint``), whether the driver
was stopped by Ctrl-C, killed, or a trial crashed. Tune retries a failed trial
(``FailureConfig(max_failures)``); a retry also resumes from the checkpoint. Trials that
still fail are listed with their error and the script exits with status 1.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

# Tune's own console output is replaced by LiveProgress (the old reporter honours verbose=0).
# Set before Tune is imported.
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")

import ray  # noqa: E402
from ray import tune  # noqa: E402

from fedsap_ray import checkpoint  # noqa: E402
from fedsap_ray.config import PRESETS, ConfigError, ExperimentConfig, build_config, parse_override  # noqa: E402
from fedsap_ray.data.federation import build_federation  # noqa: E402
from fedsap_ray.data.node_cache import shared_splits  # noqa: E402
from fedsap_ray.errors import RunStopped  # noqa: E402
from fedsap_ray.session import RunSession, record_failed_start  # noqa: E402
from fedsap_ray.runtime import reaper  # noqa: E402
from fedsap_ray.storage import ResultsDestination  # noqa: E402

METRIC = "best_global_accuracy"  # what the live line, Optuna and the schedulers rank trials by
SMOKE_BASE = ["training.rounds=3", "data.max_test_per_domain=60", "model.width_mult=0.0625",
              "resources.cpus_per_worker=0.5"]  # every script's --smoke-test adds these to the smoke preset


# --------------------------------------------------------------------------------------
# Tune's flat dict <-> typed configs
# --------------------------------------------------------------------------------------
def flat_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["algorithm.sgp=false", ...]`` -> ``{"algorithm.sgp": False, ...}`` (values parsed as the CLI does)."""
    out: dict[str, Any] = {}
    for text in overrides:
        path, value = parse_override(text)
        out[".".join(path)] = value
    return out


def to_configs(flat: Mapping[str, Any]) -> tuple[list[ExperimentConfig], list[str]]:
    """The trial's typed configs (one per seed in ``_seeds``, else ``seed``) and their run ids."""
    keys = {k: v for k, v in flat.items() if not k.startswith("_") and k != "seed"}
    overrides = [f"{k}={json.dumps(v)}" for k, v in sorted(keys.items())]
    overrides.append(f"study={json.dumps(flat['_study'])}")
    seeds = list(flat.get("_seeds") or [flat.get("seed", 0)])
    cfgs = [build_config(preset=flat["_preset"], overrides=overrides, seed=int(s)) for s in seeds]
    variant = flat.get("_variant") or "t" + hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:10]
    return cfgs, [f"{variant}-s{c.seed}" for c in cfgs]


def trial_resources(flat: Mapping[str, Any]) -> tune.PlacementGroupFactory:
    """One bundle for the server (the trainable) and one per client worker of every run of the trial."""
    cfgs, _ = to_configs(flat)
    r = cfgs[0].resources
    worker = {"CPU": r.cpus_per_worker, **({"GPU": r.gpus_per_worker} if r.gpus_per_worker > 0 else {})}
    n = int(flat.get("_workers", 1)) * len(cfgs)
    return tune.PlacementGroupFactory([{"CPU": float(flat.get("_server_cpus", 1.0))}] + [dict(worker)] * n,
                                      strategy="PACK")


# --------------------------------------------------------------------------------------
# The trainable
# --------------------------------------------------------------------------------------
def _backend(cfg: ExperimentConfig, workers: int):
    if workers > 0:
        from fedsap_ray.runtime.ray import RayWorkerPool

        return RayWorkerPool(replace(cfg, resources=replace(cfg.resources, backend="ray", num_workers=workers)))
    from fedsap_ray.runtime.local import LocalBackend

    return LocalBackend(device=cfg.resources.device, num_workers=1, torch_threads=cfg.resources.torch_threads)


def run_trial(config: dict[str, Any]) -> None:
    """Tune trainable: run (or resume) the trial's runs in lockstep and report every round.

    With several seeds the reported metrics are means over the seeds at each round (the
    mean-over-seeds objective of ``tune.py``); ``run_id``/``round`` identify the row.
    """
    flat = {**config.get("trial", {}), **{k: v for k, v in config.items() if k != "trial"}}
    cfgs, run_ids = to_configs(flat)
    dest = ResultsDestination(flat["_out"])
    workers = int(flat.get("_workers", 1))
    sessions: list[RunSession] = []
    for cfg, run_id in zip(cfgs, run_ids):
        try:
            dest.pull(run_id)
            if _local_status(dest, run_id) == "finished":  # e.g. a retry after the run had finished
                raise RuntimeError(f"run {run_id} already finished in {dest.uri}; refusing to overwrite it")
            resume = checkpoint.path_for(dest.local, run_id).is_file()
            fed = build_federation(cfg, splits=shared_splits(cfg))
            sessions.append(RunSession(cfg, dest.local, run_id, federation=fed, backend=_backend(cfg, workers),
                                       resume=resume))
        except Exception as e:  # no session yet: record the failure so the sweep's runs table shows it
            if _local_status(dest, run_id) != "finished":
                _record_failure(dest, cfg, run_id, e)
            for other, other_id in zip(sessions, run_ids):
                other.finish("failed", f"another seed of this trial failed: {e.__class__.__name__}: {e}")
                dest.push(other_id)
            raise
    status, error = "finished", None
    try:
        starts = [s.start() for s in sessions]
        rounds = cfgs[0].training.rounds
        pg = ray.util.get_current_placement_group()
        # every client worker must sit in this trial's placement group (reported, and checked by the tests)
        in_pg = all(w["placement_group"] == (pg.id.hex() if pg else None)
                    for s in sessions if hasattr(s.backend, "worker_info") for w in s.backend.worker_info())
        for t in range(min(starts) + 1, rounds + 1):
            summaries = [s.step(t) for s, done in zip(sessions, starts) if done < t]
            for run_id in run_ids:
                dest.push(run_id)
            try:
                tune.report({"round": t, METRIC: _mean([s.server.best for s in sessions]),
                             "global_accuracy": _mean([s.server.last_global for s in sessions]),
                             "train_loss": _mean([x.train_loss for x in summaries]),
                             "avg_capacity": _mean([x.avg_capacity for x in summaries]),
                             "run_id": ",".join(run_ids), "workers_in_trial_placement_group": in_pg})
            except SystemExit:  # Tune's scheduler stopped this trial (ASHA also "stops" at max_t)
                if t < rounds:
                    raise RunStopped(f"stopped by the Tune scheduler after round {t}") from None
    except RunStopped as e:
        status, error = "stopped", str(e)
    except BaseException as e:
        status, error = ("interrupted", "interrupted") if isinstance(e, KeyboardInterrupt) else (
            "failed", f"{e.__class__.__name__}: {e}")
        raise
    finally:  # close every run (its runs row says how it ended) and its worker actors
        for s, run_id in zip(sessions, run_ids):
            s.finish(status, error)
            dest.push(run_id)


def _local_status(dest: ResultsDestination, run_id: str) -> str | None:
    """The status in the run's own ``runs`` file on this node (None: never started here)."""
    import pyarrow.parquet as pq

    f = Path(dest.local) / "runs" / f"{run_id}.parquet"
    return pq.read_table(f, columns=["status"]).column("status")[0].as_py() if f.is_file() else None


def _record_failure(dest: ResultsDestination, cfg: ExperimentConfig, run_id: str, e: BaseException) -> None:
    record_failed_start(cfg, dest.local, run_id, e)
    dest.push(run_id)


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return float(sum(xs) / len(xs)) if xs else float("nan")


# --------------------------------------------------------------------------------------
# The driver: live progress line, Tune run, failures
# --------------------------------------------------------------------------------------
class LiveProgress(tune.Callback):
    """One line: trials done / running / failed of the total, and the best value so far.

    Rewritten in place on a terminal; on a log (not a TTY) printed whenever the counts
    or the best value change, at most every ``every_s`` seconds otherwise.
    """

    def __init__(self, total: int, metric: str = METRIC, stream=None, every_s: float = 30.0) -> None:
        self.total, self.metric, self.every_s = total, metric, every_s
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.running: set[str] = set()
        self.done = self.failed = 0
        self.best: tuple[float, str] | None = None
        self.errored: list = []  # trials that failed after their retries
        self.retries = 0
        self._last = ("", 0.0)
        self.t0 = time.perf_counter()

    def line(self) -> str:
        best = "-" if self.best is None else f"{self.best[0]:.4f} ({self.best[1]})"
        retried = f" ({self.retries} retries)" if self.retries else ""
        return (f"trials {self.done}/{self.total} done, {len(self.running)} running, {self.failed} failed{retried}; "
                f"best {self.metric} {best}; {time.perf_counter() - self.t0:.0f} s")

    def _show(self, force: bool = False) -> None:
        text = self.line()
        key = text.rsplit(";", 1)[0]
        now = time.perf_counter()
        if not force and key == self._last[0] and now - self._last[1] < self.every_s:
            return
        self._last = (key, now)
        if self.tty:
            print("\r" + text.ljust(100), end="", file=self.stream, flush=True)
        else:
            print(text, file=self.stream, flush=True)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.running.add(trial.trial_id)
        self._show()

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        v = result.get(self.metric)
        if v is not None and not math.isnan(v) and (self.best is None or v > self.best[0]):
            self.best = (float(v), str(result.get("run_id", trial.trial_id)))
        self._show()

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.running.discard(trial.trial_id)
        self.done += 1
        self._show()

    def on_trial_recover(self, iteration, trials, trial, **info) -> None:
        self.retries += 1  # failed, and FailureConfig restarts it (it resumes from its checkpoint)
        self._show()

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.running.discard(trial.trial_id)
        self.failed += 1
        self.errored.append(trial)
        self._show()

    def on_experiment_end(self, trials, **info) -> None:
        self._show(force=True)
        if self.tty:
            print(file=self.stream)


def connect(address: str | None) -> None:
    """Join ``--address`` / ``RAY_ADDRESS``, or start a local Ray bound to 127.0.0.1 without the dashboard."""
    for name in ("ray.tune", "ray.air", "ray.train"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # workers of a local Ray inherit this environment: let them import `sweeps` from a source checkout
        repo = str(Path(__file__).resolve().parents[1])
        os.environ["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        # Ray's agents outlive a kill -9 of this driver by about a minute (fedsap_ray.runtime.reaper)
        reaper.start()


@dataclass
class SweepOptions:
    """What every script's command line sets (see :func:`add_common_args`)."""

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


def run_trials(trials: list[dict[str, Any]], opts: SweepOptions, study: str, *, search_alg=None,
               scheduler=None, num_samples: int = 1, param_space: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Run ``trials`` (flat dicts) — or ``num_samples`` draws from ``param_space`` with ``search_alg`` —
    under Tune; return ``(trial, error)`` for every trial that still failed after its retries."""
    connect(opts.address)
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
            trial_name_creator=_trial_name, trial_dirname_creator=_trial_name),
        run_config=tune.RunConfig(
            name=study, storage_path=storage, verbose=0, callbacks=[progress],
            failure_config=tune.FailureConfig(max_failures=opts.max_failures)),
    )
    tuner.fit()
    failures = []
    for trial in progress.errored:
        error = trial.get_pickled_error() or trial.get_error()
        cause = getattr(error, "cause", None) or error
        failures.append((_trial_name_from_config(trial.config),
                         f"{cause.__class__.__name__}: {cause}".strip().splitlines()[-1][:500]))
    return failures


def _trial_name_from_config(config: Mapping[str, Any]) -> str:
    flat = {**config.get("trial", {}), **{k: v for k, v in config.items() if k != "trial"}}
    try:
        return ",".join(to_configs(flat)[1])
    except Exception:  # an invalid sampled config: show its keys
        return json.dumps({k: v for k, v in flat.items() if not k.startswith("_")}, default=str)[:200]


def _trial_name(trial) -> str:
    return f"{_trial_name_from_config(trial.config)}_{trial.trial_id}"[:120]


# --------------------------------------------------------------------------------------
# Grid studies: named variants x seeds
# --------------------------------------------------------------------------------------
def add_common_args(p: argparse.ArgumentParser, *, study: str, default_preset: str) -> None:
    p.add_argument("--out", default=f"runs/{study}", help="results folder: a path or a URI (s3://..., gs://...)")
    p.add_argument("--preset", default=default_preset, choices=sorted(PRESETS),
                   help=f"base config of every trial (default: {default_preset})")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one trial per variant and seed")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: what the resources fit)")
    p.add_argument("--resume", action="store_true", help="continue a sweep in --out: finished trials are skipped, "
                                                         "interrupted ones continue from their last round")
    p.add_argument("--workers-per-trial", type=int, default=1,
                   help="client worker actors per run (0: clients train inside the trial process)")
    p.add_argument("--server-cpus", type=float, default=1.0, help="CPUs of each trial's server bundle")
    p.add_argument("--max-failures", type=int, default=2, help="retries of a failed trial (it resumes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every trial, e.g. training.rounds=50")
    p.add_argument("--smoke-test", action="store_true", help="tiny and fast: what CI runs")
    p.add_argument("--dry-run", action="store_true", help="validate every trial's config, print the trials and "
                                                          "exit: no Ray, nothing trained, --out not read")


def options_from(args: argparse.Namespace, smoke: Sequence[str]) -> SweepOptions:
    preset, seeds, extra = args.preset, list(args.seeds), list(args.overrides)
    server_cpus = args.server_cpus
    if args.smoke_test:
        preset, seeds, extra = "smoke", seeds[:1], [*SMOKE_BASE, *smoke, *extra]
        server_cpus = min(server_cpus, 0.5)
    if args.workers_per_trial < 0:
        raise ConfigError(f"invalid --workers-per-trial={args.workers_per_trial}: must be >= 0")
    # Tune runs each trial in its own working directory: a relative local --out must be made absolute here
    out = str(args.out) if ResultsDestination(args.out).is_remote else str(Path(args.out).resolve())
    return SweepOptions(out=out, preset=preset, seeds=seeds, address=args.address,
                        max_concurrent=args.max_concurrent, resume=args.resume,
                        workers_per_trial=args.workers_per_trial, server_cpus=server_cpus,
                        max_failures=args.max_failures, extra=extra)


def grid_trials(variants: Mapping[str, Sequence[str]], opts: SweepOptions, study: str) -> list[dict[str, Any]]:
    """One flat trial per (variant, seed); every config is validated here, before Ray starts."""
    trials = []
    for seed in opts.seeds:
        for variant, overrides in variants.items():
            flat = {**flat_overrides([*overrides, *opts.extra]), "seed": seed, "_variant": variant,
                    "_study": study, "_preset": opts.preset, "_out": opts.out,
                    "_workers": opts.workers_per_trial, "_server_cpus": opts.server_cpus}
            to_configs(flat)  # raises ConfigError naming the field
            trials.append(flat)
    return trials


def pending(trials: list[dict[str, Any]], opts: SweepOptions) -> list[dict[str, Any]]:
    """The trials still to run; refuses to mix a new sweep into a folder that has one unless ``--resume``."""
    statuses = ResultsDestination(opts.out).statuses()
    ids = [to_configs(t)[1][0] for t in trials]
    known = [i for i in ids if i in statuses]
    if known and not opts.resume:
        raise ConfigError(f"invalid --out={opts.out!r}: it already holds {len(known)} of this sweep's runs "
                          f"(e.g. {known[0]}); pass --resume to continue it or choose another --out")
    return [t for t, i in zip(trials, ids) if statuses.get(i) != "finished"]


def study_parser(*, doc: str, variants: Mapping[str, Sequence[str]], study: str,
                 default_preset: str) -> argparse.ArgumentParser:
    """The command line of a grid study (also read by ``fedsap_ray.docgen`` for the reference pages)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0], epilog=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, study=study, default_preset=default_preset)
    p.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants),
                   help="a subset of the grid (default: every variant)")
    return p


def print_plan(trials: list[dict[str, Any]], opts: SweepOptions, study: str) -> None:
    """``--dry-run``: one line per trial (run id and its config overrides), every config already validated."""
    print(f"{study}: {len(trials)} trials, preset {opts.preset}, seeds {opts.seeds}; results would go to {opts.out}")
    for t in trials:
        overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(t.items()) if not k.startswith("_") and k != "seed")
        print(f"  {to_configs(t)[1][0]}: {overrides}")


def study_main(argv: Sequence[str] | None, *, doc: str, variants: Mapping[str, Sequence[str]], study: str,
               default_preset: str, smoke: Sequence[str], report: Callable[[str], str]) -> int:
    """The command line of every grid study: parse, run what is missing under Tune, print the table."""
    args = study_parser(doc=doc, variants=variants, study=study, default_preset=default_preset).parse_args(argv)
    try:
        opts = options_from(args, smoke)
        chosen = args.variants
        trials = grid_trials({v: variants[v] for v in chosen}, opts, study)
        if args.dry_run:
            print_plan(trials, opts, study)
            return 0
        todo = pending(trials, opts)
    except ConfigError as e:
        print(f"{Path(sys.argv[0]).name}: {e}", file=sys.stderr)
        return 2
    print(f"{study}: {len(trials)} trials ({len(chosen)} variants x {len(opts.seeds)} seeds), "
          f"{len(trials) - len(todo)} finished earlier, {len(todo)} to run; results in {opts.out}", file=sys.stderr)
    failures = run_trials(todo, opts, study) if todo else []
    print(report(ResultsDestination(opts.out).uri))
    return report_failures(failures)


def report_failures(failures: list[tuple[str, str]]) -> int:
    if not failures:
        return 0
    print(f"\n{len(failures)} trial(s) failed after their retries (status 'failed' and the error in their runs rows; "
          "fix the cause, then rerun with --resume):",
          file=sys.stderr)
    for name, err in failures:
        print(f"  {name}: {err}", file=sys.stderr)
    return 1
