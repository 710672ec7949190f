"""Optuna search over FedSAP's hyperparameters under Ray Tune, with early stopping.

    python sweeps/tune.py --out runs/tune --num-samples 40                  # laptop preset, one seed per trial
    python sweeps/tune.py --out runs/tune --num-samples 40 --seeds 0 1 2    # objective: mean over three seeds
    python sweeps/tune.py --out runs/tune --num-samples 60 --resume         # 20 more trials in the same study
    python sweeps/tune.py --smoke-test                                      # 3 tiny trials
    optuna trials --storage sqlite:///runs/tune/optuna.db --study-name fedsap-tune   # inspect with Optuna

Search: Ray Tune's ``OptunaSearch`` (TPE, seeded by ``--sampler-seed``) over the
channel-role hyperparameters of papers/000's sensitivity study (g_target, tau_var,
beta_EMA), the budget temperature and the DGA similarity threshold tau_sim (ranges in
``SPACE``). Scheduler: ASHA on ``round`` stops weak trials early (``--grace-period``).
Objective: best-so-far global accuracy, averaged over ``--seeds`` when several are given
(the seeds of a trial run in lockstep, so ASHA compares means at equal rounds).

The Optuna study lives in durable storage (default ``sqlite:///<out>/optuna.db``, or any
Optuna storage URL by ``--storage``) under ``--study-name``: ``--resume`` continues it
(completed trials keep informing the sampler; trials left RUNNING by a killed driver are
marked FAIL) until it holds ``--num-samples`` completed trials. Every trial's runs are
written to the results folder like any sweep (run id ``t<hash of the config>-s<seed>``),
and the study's trial table to ``<out>/optuna_trials.parquet``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `sweeps` from a source checkout

import optuna  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.fs as pafs  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from ray import tune  # noqa: E402
from ray.tune.schedulers import ASHAScheduler  # noqa: E402
from ray.tune.search.optuna import OptunaSearch  # noqa: E402

from fedsap_ray.cli import OneLineParser  # noqa: E402
from fedsap_ray import results  # noqa: E402
from fedsap_ray.config import ConfigError  # noqa: E402
from fedsap_ray.persist.outdir import FILE, OutDir  # noqa: E402
from fedsap_ray.results.destination import ResultsDestination  # noqa: E402
from sweeps.study import (add_common_args, check_overrides, finished_gaps, options_from, read_runs,  # noqa: E402
                          refuse_missing_out, report_failures)
from sweeps.trials import METRIC, flat_overrides, to_configs  # noqa: E402
from sweeps.tuner import run_trials, tracked  # noqa: E402

STUDY = "tune"
# FedSAP's hyperparameters and their search ranges (papers/000 Table 7 brackets the first three)
SPACE = {
    "algorithm.g_target": tune.uniform(0.5, 0.95),
    "algorithm.tau_var": tune.loguniform(0.02, 0.5),
    "algorithm.beta_ema": tune.uniform(0.0, 0.9),
    "algorithm.temperature": tune.loguniform(0.25, 4.0),
    "algorithm.tau_sim": tune.uniform(0.2, 0.8),
}


def parser() -> argparse.ArgumentParser:
    """The command line (also read by ``fedsap_ray.dev.docgen`` for the reference pages)."""
    p = OneLineParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, study=STUDY, default_preset="laptop")
    p.set_defaults(seeds=[0])
    p.add_argument("--algorithm", default="fedsap", choices=["fedsap", "fedsap_fixed"],
                   help="FedSAP's main setting or its fixed-mask reference setting")
    p.add_argument("--num-samples", type=int, default=None,
                   help="completed trials the study should hold (default 40; --smoke-test 3)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default sqlite:///<out>/optuna.db)")
    p.add_argument("--study-name", default="fedsap-tune", help="the Optuna study's name in --storage")
    p.add_argument("--sampler-seed", type=int, default=0, help="seed of the TPE sampler")
    p.add_argument("--grace-period", type=int, default=None, help="ASHA: rounds before a trial can be stopped "
                                                                  "(default a quarter of the rounds)")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def check_space(args: argparse.Namespace, opts) -> list[dict]:
    """Validate the trial config at both ends of every search range (``--dry-run``); return those configs."""
    base = base_space(args, opts)
    corners = []
    for key, domain in SPACE.items():
        for value in (domain.lower, domain.upper):
            flat = {**base, key: value}
            to_configs(flat)  # raises ConfigError naming the field
            corners.append({key: value})
    return corners


def storage_url(args: argparse.Namespace, dest: ResultsDestination, *, create: bool = True) -> str:
    """``--storage``, else ``sqlite:///<out>/optuna.db`` (``create``: the folder is made); checked by
    :func:`check_storage` either way."""
    if args.storage:
        check_storage(args.storage)
        return args.storage
    if dest.is_remote:
        raise ConfigError(f"invalid --storage: required when --out is a URI ({dest.uri}); e.g. "
                          "postgresql://user@host/db or sqlite:////shared/optuna.db")
    if create:
        OutDir(dest.local).mkdir(dest.local)
    url = f"sqlite:///{OutDir(dest.local).check(Path(dest.local) / 'optuna.db', FILE)}"  # never through a link
    if create:
        check_storage(url)
    return url


SQLITE_HEADER = b"SQLite format 3\x00"
STORAGE_ALLOWED = "use sqlite:////ABSOLUTE/PATH/optuna.db or a database URL whose driver is installed " \
                  "(postgresql://user@host/db)"


def check_storage(url: str) -> None:
    """An Optuna storage URL the study can live in, checked without connecting or creating anything: SQLAlchemy
    parses it and has its driver; an SQLite one names a file (not ``:memory:``: nothing to ``--resume``) that
    is an SQLite database or can be created, writable. A refusal is one line naming ``--storage``."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    def refuse(why: str) -> None:
        raise ConfigError(f"invalid --storage={url!r}: {why}")

    try:
        parsed = make_url(url)
        dialect = parsed.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as e:
        refuse(f"not a database URL SQLAlchemy can open ({(str(e).splitlines() or [''])[0]}); {STORAGE_ALLOWED}")
    try:
        dialect.import_dbapi()
    except ImportError as e:
        refuse(f"its database driver is not installed ({e}); install it or {STORAGE_ALLOWED}")
    if parsed.get_backend_name() != "sqlite":
        return
    db = parsed.database
    if not db or db == ":memory:" or db.startswith("file:"):
        refuse(f"an in-memory SQLite database keeps no study (nothing to --resume); {STORAGE_ALLOWED}")
    f = Path(db)
    if f.is_dir():
        refuse(f"{f} is a folder; name the database file in it, e.g. sqlite:///{f.resolve() / 'optuna.db'}")
    if f.exists():
        try:
            with f.open("rb") as fh:
                head = fh.read(len(SQLITE_HEADER))
        except OSError as e:
            refuse(f"{f} cannot be read ({e.strerror}); {STORAGE_ALLOWED}")
        if head and head != SQLITE_HEADER:
            refuse(f"{f} is not an SQLite database; name a new file or an Optuna database")
        if not os.access(f, os.W_OK):
            refuse(f"{f} is not writable")
    else:
        parent = f.absolute().parent
        if not parent.is_dir():
            refuse(f"the folder {parent} does not exist; create it or name a file in an existing folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            refuse(f"the folder {parent} is not writable")


# what tune.py sets in each trial itself (besides what every sweep sets, sweeps.study.SWEEP_SETS)
TUNE_SETS = {"algorithm.name": "use --algorithm",
             **{k: f"Optuna searches it over [{d.lower}, {d.upper}] (SPACE in sweeps/tune.py)"
                for k, d in SPACE.items()}}


def open_study(url: str, name: str, resume: bool) -> tuple[optuna.storages.BaseStorage, int]:
    """The study's storage and how many trials it has completed; stale RUNNING trials become FAIL."""
    try:
        storage = optuna.storages.get_storage(url)
    except Exception as e:  # e.g. a server that does not answer or refuses the login (sqlalchemy's errors)
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
        raise ConfigError(f"invalid --storage={url!r}: cannot open it ({first[:300]})") from None
    exists = name in optuna.study.get_all_study_names(storage=storage)
    if exists and not resume:
        raise ConfigError(f"invalid --study-name={name!r}: the study already exists in {url}; "
                          "pass --resume to continue it or choose another --study-name / --out")
    if resume and not exists:
        raise ConfigError(f"invalid --resume: no study {name!r} in {url}, so there is nothing to continue; "
                          "check --study-name and --storage, or leave --resume out to start it")
    if not exists:
        return storage, 0
    study = optuna.load_study(study_name=name, storage=storage)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)  # left by a killed driver
    done = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    return storage, done


def refuse_incomplete(opts) -> None:
    """``--resume``: every finished run of this study in ``--out`` holds the rows it wrote, and no run has two
    runs rows (:func:`sweeps.study.finished_gaps`). A grid study runs such a trial again; here its Optuna trial is
    complete and keeps its value, and the sampler would not propose it again, so the sweep refuses, naming the run
    (exit 2) before Ray starts."""
    t = read_runs(opts, ["run_id", "study"])
    mine = {r for r, s in zip(t.column("run_id").to_pylist(), t.column("study").to_pylist()) if s == STUDY}
    gaps = finished_gaps(opts, mine)
    if gaps:
        run_id, what = min(gaps.items())
        raise ConfigError(f"invalid --resume: run {run_id} in {opts.out} finished, but {what}; its Optuna trial is "
                          "complete, so the sweep does not run it again: restore the file, or remove the run's files "
                          "from every table of the folder")


def trials_table(study: optuna.Study) -> str:
    df = study.trials_dataframe(attrs=("number", "value", "state", "params"))
    if df.empty:
        return "(no trials)"
    df = df.sort_values("value", ascending=False, na_position="last")
    return df.to_string(index=False, float_format=lambda v: f"{v:.4f}")


def write_trials(study: optuna.Study, dest: ResultsDestination) -> None:
    df = study.trials_dataframe(attrs=("number", "value", "state", "params", "datetime_start", "datetime_complete"))
    df["state"] = df["state"].astype(str)
    table = pa.Table.from_pandas(df, preserve_index=False)
    if dest.is_remote:
        fs, root = pafs.FileSystem.from_uri(dest.uri)
        pq.write_table(table, f"{root.rstrip('/')}/optuna_trials.parquet", filesystem=fs)
    else:
        results.write_atomic(table, Path(dest.local) / "optuna_trials.parquet", OutDir(dest.local))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        for flag, value in (("--num-samples", args.num_samples), ("--grace-period", args.grace_period)):
            if value is not None and value < 1:
                raise ConfigError(f"invalid {flag}={value}: must be an integer >= 1")
        if not 0 <= args.sampler_seed <= 2**32 - 1:
            raise ConfigError(f"invalid --sampler-seed={args.sampler_seed}: must be an integer in [0, 4294967295]")
        opts = options_from(args, smoke=[])
        check_overrides(args.overrides, TUNE_SETS)
        target = args.num_samples if args.num_samples is not None else (3 if args.smoke_test else 40)
        rounds_cfg = to_configs(base_space(args, opts))[0][0]
        dest = ResultsDestination(opts.out)
        if args.dry_run:
            storage_url(args, dest, create=False)  # --storage checked; nothing created
            check_space(args, opts)
            print(f"tune: up to {target} completed trials of {args.algorithm} (preset {opts.preset}, seeds "
                  f"{opts.seeds}, {rounds_cfg.training.rounds} rounds) over "
                  + ", ".join(f"{k} [{d.lower}, {d.upper}]" for k, d in SPACE.items())
                  + f"; study {args.study_name!r}, results would go to {opts.out}")
            return 0
        check_space(args, opts)
        if opts.resume:
            refuse_missing_out(opts)
            refuse_incomplete(opts)
        url = storage_url(args, dest)
        storage, done = open_study(url, args.study_name, opts.resume)
    except ConfigError as e:
        print(f"tune.py: error: {e}", file=sys.stderr)
        return 2
    rounds = rounds_cfg.training.rounds
    todo = max(0, target - done)
    print(f"tune: study {args.study_name!r} in {url}: {done} trials completed, {todo} to run "
          f"(objective {METRIC}, mean over seeds {opts.seeds}); results in {opts.out}", file=sys.stderr)
    failures = []
    if todo:
        searcher = OptunaSearch(metric=METRIC, mode="max", study_name=args.study_name, storage=storage,
                                sampler=optuna.samplers.TPESampler(seed=args.sampler_seed + done))
        scheduler = ASHAScheduler(time_attr="round", metric=METRIC, mode="max", max_t=rounds,
                                  grace_period=args.grace_period or max(1, rounds // 4), reduction_factor=3)
        failures = run_trials([], opts, STUDY, search_alg=searcher, scheduler=scheduler, num_samples=todo,
                              param_space={**SPACE, **base_space(args, opts)})
    study = optuna.load_study(study_name=args.study_name, storage=storage)
    write_trials(study, dest)
    print(f"Optuna study {args.study_name!r} ({len(study.trials)} trials; best first)")
    print(trials_table(study))
    return report_failures(failures)


def base_space(args: argparse.Namespace, opts) -> dict:
    """The constant part of every trial's flat config."""
    return {**flat_overrides([f"algorithm.name={args.algorithm}", *opts.extra]), "_seeds": list(opts.seeds),
            "_study": STUDY, "_preset": opts.preset, "_out": opts.out, "_workers": opts.workers_per_trial,
            "_server_cpus": opts.server_cpus, **tracked(opts)}


if __name__ == "__main__":
    raise SystemExit(main())
