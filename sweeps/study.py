"""Every study script's command line: options, grids of variants x seeds, what is left to run, the report.

A grid study (``sensitivity.py``, ``ablation.py``, ...) is a docstring, a dict of named
variants (config overrides) and a report function; :func:`study_main` does the rest: parse,
validate every trial's config before Ray starts (``--dry-run`` stops there), skip finished
runs (``--resume``; a folder that already holds the sweep is refused without it), run the rest
under Tune (:func:`sweeps.tuner.run_trials`) and print the study's table.

Resuming (``--resume``): finished runs are skipped; every other trial runs again and
continues from its per-round checkpoint (``fedsap_ray.persist.checkpoint``), whether the driver was
stopped by Ctrl-C, killed, or a trial crashed. Tune retries a failed trial
(``--max-failures``); a retry also resumes from the checkpoint. Trials that still fail are
listed with their error and the script exits with status 1. Before Ray starts, a resume checks
what it skips and what it continues: a finished trial whose tables hold fewer rows than its runs
row says it wrote runs again from the start (:func:`finished_gaps`, one line each); more rows than
it wrote, a run with two runs rows, or a checkpoint the trial could not continue from
(:func:`check_checkpoints`) is refused, exit 2, before anything in ``--out`` changes.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from fedsap_ray import results
from fedsap_ray.run import guard
from fedsap_ray.persist import checkpoint
from fedsap_ray.cli import OneLineParser
from fedsap_ray.config import PRESETS, ConfigError, parse_override
from fedsap_ray.persist.outdir import OutDir
from fedsap_ray.results import kept
from fedsap_ray.results.reader import read_arrow
from fedsap_ray.results.store import is_dir, list_table, run_ids
from fedsap_ray.runtime.address import check_reachable, given
from fedsap_ray.config.checks import check_ray_address
from fedsap_ray.results.destination import ResultsDestination
from fedsap_ray.run.trackers import add_tracker_args, check_libraries, tracker_specs
from sweeps.trials import flat_overrides, to_configs
from sweeps.tuner import SweepOptions, run_trials, tracked

# every script's --smoke-test adds these to the smoke preset: a few steps a round, the deployed models at
# rounds 2 and 3 (best and final still differ), so CI's five smoke sweeps stay cheap
SMOKE_BASE = ["training.rounds=3", "data.max_test_per_domain=60", "model.width_mult=0.0625",
              "resources.cpus_per_worker=0.5", "training.max_steps_per_epoch=2", "training.deployed_every=2"]


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
    add_tracker_args(p, "every trial's runs (one tracker run per run, every rounds metric per round)",
                     "default OUT/_trackers/NAME (required when --out is a URI)")
    p.add_argument("--smoke-test", action="store_true", help="tiny and fast: what CI runs")
    p.add_argument("--dry-run", action="store_true", help="validate every trial's config, print the trials and "
                                                          "exit: no Ray, nothing trained, --out not read")


def options_from(args: argparse.Namespace, smoke: Sequence[str], smoke_seeds: int = 1) -> SweepOptions:
    """The sweep's options; ``--smoke-test`` keeps the first ``smoke_seeds`` seeds (one, but for a study whose point
    is several seeds: sweeps/learning_check.py) and adds SMOKE_BASE, then the study's ``smoke`` overrides."""
    preset, seeds, extra = args.preset, list(args.seeds), list(args.overrides)
    server_cpus = args.server_cpus
    if args.smoke_test:
        preset, seeds, extra = "smoke", seeds[:smoke_seeds], [*SMOKE_BASE, *smoke, *extra]
        # a smoke trial with worker actors fits one CPU (its server bundle 0.5 + 0.5 a worker); one that trains
        # in its own process (--workers-per-trial 0) keeps the whole CPU it uses: at 0.5, two such trials
        # shared each core and the sweep took longer (main_comparison --smoke-test on 2 cores: 75.9 s against
        # 62.6 s two at a time, docs/guides/sweeps.md)
        if args.workers_per_trial:
            server_cpus = min(server_cpus, 0.5)
    check_sweep_flags(args)
    check_overrides(args.overrides, SWEEP_SETS)
    check_reachable(*given(args.address, "--address"))  # seconds; also in --dry-run (Ray is not started)
    try:
        remote = ResultsDestination(args.out).is_remote
    except ValueError as e:  # a URI pyarrow cannot open (unknown scheme, bad bucket name)
        raise ConfigError(f"invalid --out={args.out!r}: {str(e).splitlines()[0] if str(e) else 'not a usable URI'}") \
            from e
    if not remote:  # creates nothing (a dry run writes nothing)
        guard.check_out_writable(Path(args.out))
        if not args.dry_run:  # a link or a wrong kind anywhere a trial writes: refused before Ray starts
            guard.check_folder(Path(args.out), files=("optuna.db", "optuna_trials.parquet"), dirs=("_tune",))
    # Tune runs each trial in its own working directory: a relative local --out must be made absolute here
    out = str(args.out) if remote else str(Path(args.out).resolve())
    specs = tracker_specs(args.tracker, args.tracker_uri, None if remote else out)
    check_libraries(specs)
    return SweepOptions(out=out, preset=preset, seeds=seeds, address=args.address,
                        max_concurrent=args.max_concurrent, resume=args.resume,
                        workers_per_trial=args.workers_per_trial, server_cpus=server_cpus,
                        max_failures=args.max_failures, extra=extra, trackers=specs)


# what every sweep sets in each trial's config itself: a --set of it would be overridden (or ignored) without a word
SWEEP_SETS = {
    "study": "each trial's runs carry the study's name; choose another --out to keep sweeps apart",
    "seed": "one trial per seed of --seeds",
    "resources.backend": "a trial trains with client worker actors, or in its own process with --workers-per-trial 0",
    "resources.num_workers": "use --workers-per-trial",
    "resources.address": "use --address",
}


def check_overrides(overrides: Sequence[str], fixed: Mapping[str, str]) -> None:
    """Refuse a ``--set`` of a key the sweep sets itself (``fixed``: key -> what to use instead) or of a
    ``_``-prefixed key (the sweep's own bookkeeping, never a config field); one line each."""
    for text in overrides:
        path, _ = parse_override(text)
        key = ".".join(path)
        if key.startswith("_"):
            raise ConfigError(f"invalid --set {text!r}: {key} is not a config field (docs/reference/config.md)")
        if key in fixed:
            raise ConfigError(f"invalid --set {text!r}: the sweep sets {key} itself ({fixed[key]})")


def variant_sets(variants: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """key -> why ``--set`` may not change it: the chosen variants set it (the grid's differences)."""
    by_key: dict[str, list[str]] = {}
    for name, overrides in variants.items():
        for key in flat_overrides(overrides):
            by_key.setdefault(key, []).append(name)
    return {k: f"per variant: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}; pick variants with --variants"
            for k, v in by_key.items()}


def check_sweep_flags(args: argparse.Namespace) -> None:
    """The flags every study shares, checked before any config is built or Ray starts; each refusal
    one line naming the flag, the value and what is allowed."""
    if args.workers_per_trial < 0:
        raise ConfigError(f"invalid --workers-per-trial={args.workers_per_trial}: must be an integer >= 0")
    seeds = list(args.seeds)
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError(f"invalid --seeds={list(args.seeds)}: each seed at most once (seed {twice[0]} is given twice; "
                          "its trials would share one run id)")
    if args.max_concurrent is not None and args.max_concurrent < 1:
        raise ConfigError(f"invalid --max-concurrent={args.max_concurrent}: must be an integer >= 1 (leave it out: "
                          "as many trials as the resources fit)")
    if not (math.isfinite(args.server_cpus) and args.server_cpus > 0):
        raise ConfigError(f"invalid --server-cpus={args.server_cpus}: must be a positive finite number")
    if args.max_failures < 0:
        raise ConfigError(f"invalid --max-failures={args.max_failures}: must be an integer >= 0 (retries of a "
                          "failed trial)")
    if str(args.out).strip() == "":
        raise ConfigError(f"invalid --out={args.out!r}: must name a folder or a URI")
    check_ray_address("--address", args.address)


def grid_trials(variants: Mapping[str, Sequence[str]], opts: SweepOptions, study: str) -> list[dict[str, Any]]:
    """One flat trial per (variant, seed); every config is validated here, before Ray starts."""
    trials = []
    for seed in opts.seeds:
        for variant, overrides in variants.items():
            flat = {**flat_overrides([*overrides, *opts.extra]), "seed": seed, "_variant": variant,
                    "_study": study, "_preset": opts.preset, "_out": opts.out,
                    "_workers": opts.workers_per_trial, "_server_cpus": opts.server_cpus, **tracked(opts)}
            to_configs(flat)  # raises ConfigError naming the field
            trials.append(flat)
    return trials


def check_resume(trials: Sequence[Mapping[str, Any]], opts: SweepOptions) -> None:
    """``--resume``: the folder must exist, and every run in it with the id of a planned trial must be that
    trial's: the same study and the same config (``config_hash``); else the sweep would skip (or continue)
    another study's or another config's run as if it were its own. One line naming the run and what differs.
    A run with two rows in the runs table is refused too (:func:`read_runs`)."""
    refuse_missing_out(opts)
    planned = {i: c for t in trials for c, i in zip(*to_configs(t))}
    t = read_runs(opts, ["run_id", "study", "config_hash"])
    for run_id, study, digest in zip(*(t.column(c).to_pylist() for c in ("run_id", "study", "config_hash"))):
        cfg = planned.get(run_id)
        if cfg is None:
            continue
        if study != cfg.study:
            raise ConfigError(f"invalid --resume: run {run_id} in {opts.out} belongs to study {study!r}, not "
                              f"{cfg.study!r}; resume it with that study's script or choose another --out")
        if digest != cfg.config_hash():
            raise ConfigError(f"invalid --resume: run {run_id} in {opts.out} was run with another config (config_hash "
                              f"{digest}, this sweep's {cfg.config_hash()}); give the --preset, --set and --smoke-test "
                              "it was started with, or choose another --out")


def read_arrow_or_refuse(opts: SweepOptions, table: str, columns: list[str]) -> pa.Table:
    """``columns`` of every run's rows of ``table`` in ``--out`` (each run once: :mod:`fedsap_ray.results`); a
    file that cannot be read is one line naming it (exit 2), before Ray starts."""
    fs, base = results.filesystem(opts.out)
    try:
        return read_arrow(fs, base, table, columns=columns)
    except (OSError, pa.ArrowException) as e:  # a truncated or damaged file
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
        raise ConfigError(f"invalid --resume: the {table} table in {opts.out} cannot be read ({first[:300]}); "
                          "restore the file or remove it") from None


def read_runs(opts: SweepOptions, columns: list[str]) -> pa.Table:
    """``columns`` of the runs table in ``--out``, one row per run: a run id with two rows (a copied runs file)
    is refused, naming the run and the files that hold it, so the sweep never skips, continues or reports a
    run twice."""
    t = read_arrow_or_refuse(opts, "runs", sorted({"run_id", *columns}))
    counts = [v for v in pc.value_counts(t.column("run_id")).to_pylist() if v["counts"] > 1]
    if counts:
        run_id, n = min((v["values"], v["counts"]) for v in counts)
        fs, base = results.filesystem(opts.out)
        listing = list_table(fs, base, "runs")
        holders = [i.path for i in [*listing.per_run.values(), *listing.compacted] if run_id in run_ids(fs, i.path)]
        shown = ", ".join(f"runs/{p.rsplit('/', 1)[-1]}" for p in holders) or "one file"
        raise ConfigError(f"invalid --out={opts.out!r}: run {run_id} has {n} rows in its runs table ({shown}); a run "
                          "has one: a runs file was copied or duplicated, so remove the copy")
    return t.select(columns)


def finished_gaps(opts: SweepOptions, only: Collection[str] | None = None) -> dict[str, str]:
    """run id -> what its tables lack, for every finished run in ``--out`` (of ``only`` when given) whose tables
    hold fewer rows than it wrote: the per-table counts its ``runs`` row records (``rows_written``), or, for a
    run written before that column, every round 1..``rounds_done`` in its rounds table. A run whose tables hold
    more rows than it wrote (a copied or duplicated file), or whose ``rows_written`` is not a count per table, is
    refused (one line naming the run). Reads the run id (and the rounds table's round) column of each table once.

    Why: a finished run is skipped by ``--resume``; without this check one whose rounds file was deleted would be
    skipped as done, and its rows would be missing from every report."""
    runs = read_runs(opts, ["run_id", "status", "rounds_done", "rows_written"]).to_pylist()
    done = {r["run_id"]: r for r in runs if r["status"] == "finished" and (only is None or r["run_id"] in only)}
    if not done:
        return {}
    ids = pa.array(sorted(done))
    legacy = pa.array(sorted(i for i, r in done.items() if r["rows_written"] is None), pa.string())
    held: dict[str, dict[str, int]] = {}  # table -> run id -> rows
    rounds: dict[str, set[int]] = {}  # run id (written before rows_written) -> the rounds its rounds table holds
    for table in results.DATA_TABLES:
        t = read_arrow_or_refuse(opts, table, ["run_id", "round"] if table == "rounds" else ["run_id"])
        t = t.filter(pc.is_in(t.column("run_id"), value_set=ids))
        held[table] = {v["values"]: v["counts"] for v in pc.value_counts(t.column("run_id")).to_pylist()}
        if table == "rounds" and len(legacy):
            pairs = t.filter(pc.is_in(t.column("run_id"), value_set=legacy)).group_by(["run_id", "round"]).aggregate([])
            for run_id, rnd in zip(pairs.column("run_id").to_pylist(), pairs.column("round").to_pylist()):
                rounds.setdefault(run_id, set()).add(rnd)
    gaps = {}
    for run_id, row in done.items():
        what = _gap(opts, run_id, row, {tb: held[tb].get(run_id, 0) for tb in held}, rounds.get(run_id, set()))
        if what:
            gaps[run_id] = what
    return gaps


def _gap(opts: SweepOptions, run_id: str, row: Mapping[str, Any], held: Mapping[str, int], rounds: set[int]) -> str:
    """What finished run ``run_id``'s tables lack ('' when nothing); refuses more rows than it wrote."""
    where = f"invalid --resume: run {run_id} in {opts.out} finished, but"
    if row["rows_written"] is None:  # written before runs.rows_written: every run writes rounds rows every round
        lost = sorted(set(range(1, int(row["rounds_done"] or 0) + 1)) - rounds)
        return f"its rounds table lacks rounds {guard.spans(lost)} of the {row['rounds_done']} it ran" if lost else ""
    try:
        wrote = json.loads(row["rows_written"])
        if not isinstance(wrote, dict) or not all(t in results.DATA_TABLES and type(n) is int and n >= 0
                                                  for t, n in wrote.items()):
            raise ValueError("not a count of rows per table")
    except ValueError:
        raise ConfigError(f"{where} its runs row holds rows_written={row['rows_written']!r:.60}, not a count of rows "
                          "per table; restore its runs file") from None
    for table in results.DATA_TABLES:
        n, got = wrote.get(table, 0), held.get(table, 0)
        if got > n:
            raise ConfigError(f"{where} its {table} table holds {got} rows, {got - n} more than it wrote: a file was "
                              "copied or rows duplicated; remove the copy")
        if got < n:
            return f"its {table} table holds {got} of the {n} rows it wrote"
    return ""


def rerun_incomplete(dest: ResultsDestination, gaps: Mapping[str, str], study: str) -> None:
    """Remove every row of each run in ``gaps`` (a finished run whose tables lack rows) so its trial runs again
    from its first round, saying so in one line each; a trial is deterministic, so the rows come back the same."""
    for run_id, what in sorted(gaps.items()):
        print(f"{study}: trial run {run_id} finished earlier, but {what}: its rows are removed and it runs again "
              "from the start (same config and seed: the same numbers)", file=sys.stderr)
        results.remove_run(dest.uri if dest.is_remote else dest.local, run_id)


def check_checkpoints(dest: ResultsDestination, trials: Sequence[Mapping[str, Any]]) -> None:
    """Before Ray starts: each run of ``trials`` that has a checkpoint (the trial will continue from it) has one
    it can continue from (:func:`fedsap_ray.run.guard.check_trial_checkpoint`: format, content digest, round, engine,
    and the run's tables against it); else one line naming the trial's run and the file, exit 2. A remote run's
    files are brought to this node's staging folder first (:meth:`ResultsDestination.pull`)."""
    for t in trials:
        for cfg, run_id in zip(*to_configs(t)):
            if dest.is_remote:
                assert dest.fs is not None  # set whenever is_remote
                found = dest.fs.get_file_info(f"{dest.base}/checkpoints/{run_id}{checkpoint.SUFFIX}").type \
                    == pafs.FileType.File
                if found:
                    dest.pull(run_id)
            else:
                found = OutDir(dest.local).is_file(checkpoint.path_for(dest.local, run_id))
            if found:
                guard.check_trial_checkpoint(Path(dest.local), run_id, cfg, f"--resume (trial run {run_id})",
                                             "; restore the file, or delete it to run the trial again from its "
                                             "first round")


def refuse_missing_out(opts: SweepOptions) -> None:
    """``--resume`` of a folder that does not exist (a typo in --out) would start a new sweep without a word."""
    fs, base = results.filesystem(opts.out)
    if not is_dir(fs, base):
        raise ConfigError(f"invalid --resume: --out {opts.out} does not exist, so there is nothing to continue; "
                          "check --out, or leave --resume out to start the sweep there")


def pending(trials: list[dict[str, Any]], opts: SweepOptions) -> list[dict[str, Any]]:
    """The trials still to run; refuses to mix a new sweep into a folder that has one unless ``--resume``."""
    statuses = ResultsDestination(opts.out).statuses()
    ids = [to_configs(t)[1][0] for t in trials]
    known = [i for i in ids if i in statuses]
    if known and not opts.resume:
        raise ConfigError(f"invalid --out={opts.out!r}: it already holds {len(known)} of this sweep's runs "
                          f"(e.g. {known[0]}); pass --resume to continue it or choose another --out")
    return [t for t, i in zip(trials, ids) if statuses.get(i) != "finished"]


def drop_stale_checkpoints(dest: ResultsDestination, finished: Sequence[str]) -> list[str]:
    """Remove the checkpoints of the ``finished`` runs where there still are some; return their run ids.

    A run closes by writing its ``finished`` row, then removing its checkpoint: a driver killed
    between the two leaves both. The run is done (it is skipped), so its checkpoint goes.
    """
    gone = []
    for run_id in finished:
        if dest.is_remote:
            assert dest.fs is not None  # set whenever is_remote
            paths = [f"{dest.base}/checkpoints/{run_id}{suffix}" for suffix in (checkpoint.SUFFIX, checkpoint.LEGACY_SUFFIX)]
            found = [i.path for i in dest.fs.get_file_info(paths) if i.type == pafs.FileType.File]
            for path in found:
                dest.fs.delete_file(path)
            if found:
                gone.append(run_id)
        elif OutDir(dest.local).is_file(checkpoint.path_for(dest.local, run_id)) \
                or OutDir(dest.local).is_file(checkpoint.legacy_path_for(dest.local, run_id)):
            checkpoint.remove(dest.local, run_id)
            gone.append(run_id)
    return gone


def refuse_legacy_checkpoints(dest: ResultsDestination, run_ids: Sequence[str]) -> None:
    """A run to continue whose checkpoint is an older version's pickle is refused before Ray starts
    (reading it could run code: :mod:`fedsap_ray.persist.checkpoint`), naming the file and what to do."""
    for run_id in run_ids:
        if dest.is_remote:
            assert dest.fs is not None  # set whenever is_remote
            path = f"{dest.base}/checkpoints/{run_id}{checkpoint.LEGACY_SUFFIX}"
            found = dest.fs.get_file_info(path).type == pafs.FileType.File
            shown = f"{dest.uri.rstrip('/')}/checkpoints/{run_id}{checkpoint.LEGACY_SUFFIX}"
        else:
            found = OutDir(dest.local).is_file(checkpoint.legacy_path_for(dest.local, run_id))
            shown = str(checkpoint.legacy_path_for(dest.local, run_id))
        if found:
            raise ConfigError(f"invalid --resume: {checkpoint.legacy_refusal(shown)}")


def study_parser(*, doc: str, variants: Mapping[str, Sequence[str]], study: str,
                 default_preset: str) -> argparse.ArgumentParser:
    """The command line of a grid study (also read by ``fedsap_ray.dev.docgen`` for the reference pages)."""
    p = OneLineParser(description=doc.splitlines()[0], epilog=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, study=study, default_preset=default_preset)
    p.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants),
                   help="a subset of the grid (default: every variant)")
    return p


def print_plan(trials: list[dict[str, Any]], opts: SweepOptions, study: str) -> None:
    """``--dry-run``: one line per trial (run id and its config overrides), every config already validated."""
    print(f"{study}: {len(trials)} trials, preset {opts.preset}, seeds {opts.seeds}; results would go to {opts.out}")
    print(f"{study}: {kept.plan_line([c for t in trials for c in to_configs(t)[0]])}")
    for t in trials:
        overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(t.items()) if not k.startswith("_") and k != "seed")
        print(f"  {to_configs(t)[1][0]}: {overrides}")


def study_main(argv: Sequence[str] | None, *, doc: str, variants: Mapping[str, Sequence[str]], study: str,
               default_preset: str, smoke: Sequence[str], report: Callable[[str], str], smoke_seeds: int = 1) -> int:
    """The command line of every grid study: parse, run what is missing under Tune, print the table."""
    args = study_parser(doc=doc, variants=variants, study=study, default_preset=default_preset).parse_args(argv)
    try:
        opts = options_from(args, smoke, smoke_seeds)
        chosen = args.variants
        check_overrides(args.overrides, variant_sets({v: variants[v] for v in chosen}))
        trials = grid_trials({v: variants[v] for v in chosen}, opts, study)
        if args.dry_run:
            print_plan(trials, opts, study)
            return 0
        if opts.resume:
            check_resume(trials, opts)
        todo = pending(trials, opts)
        dest = ResultsDestination(opts.out)
        refuse_legacy_checkpoints(dest, [to_configs(t)[1][0] for t in todo])
        check_checkpoints(dest, todo)
        done = [t for t in trials if all(t is not u for u in todo)]
        gaps = finished_gaps(opts, {i for t in done for i in to_configs(t)[1]}) if opts.resume and done else {}
        # every refusal above: nothing in --out has changed yet
        drop_stale_checkpoints(dest, [i for t in done for i in to_configs(t)[1]])
        rerun = [t for t in done if any(i in gaps for i in to_configs(t)[1])]
        rerun_incomplete(dest, {i: gaps.get(i, "another run of its trial lacks rows") for t in rerun
                                for i in to_configs(t)[1]}, study)
        todo = [t for t in trials if any(t is u for u in [*todo, *rerun])]
    except ConfigError as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        return 2
    print(f"{study}: {len(trials)} trials ({len(chosen)} variants x {len(opts.seeds)} seeds), "
          f"{len(trials) - len(todo)} finished earlier, {len(todo)} to run; results in {opts.out}", file=sys.stderr)
    if todo:
        print(f"{study}: the runs to run {kept.plan_line([c for t in todo for c in to_configs(t)[0]])}", file=sys.stderr)
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
