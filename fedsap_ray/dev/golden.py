"""Golden numbers: prove that a change (a refactor) changed no recorded number.

``record DIR`` runs a fixed set of tiny cases (every registered algorithm, 3 rounds of the
``smoke`` preset) and stores every results table they write, as Parquet, with a manifest;
``check DIR`` runs the same cases with the code on ``PYTHONPATH`` and compares every table
exactly against what ``DIR`` holds::

    PYTHONPATH=../base python ../new/fedsap_ray/dev/golden.py record /tmp/golden   # the old checkout
    PYTHONPATH=. python -m fedsap_ray.dev.golden check /tmp/golden                  # the new one

The cases (``--list`` prints them):

- ``NAME``: algorithm ``NAME`` on the local backend (deployed evaluation every round), plus three
  option cases (``fedsap-probe``: ``algorithm.dga_source=probe``, the default since issue 24, and
  ``fedsap-train``: ``dga_source=train``; ``fedprox-mu``: ``mu=0.1``);
- ``NAME@masked``: the same with ``training.submodel=masked`` (the default is ``sliced``);
- ``NAME@ray``: the same on the Ray backend (one local Ray, started once for all Ray cases); only
  for :data:`RAY_DEFAULT` unless ``--full`` (a Ray case costs several local ones);
- ``NAME@resume``: run ``NAME`` interrupted after round 2 (a ``KeyboardInterrupt`` raised from
  ``run_experiment``'s ``progress`` hook, as Ctrl-C would) and resumed to round 3
  (``resume=True``); it has no tables of its own: they must equal case ``NAME``'s.

Compared: every column of the ``runs``, ``rounds``, ``clients``, ``layers`` and ``allocations``
tables except those in :data:`DROP` (ids, times, where a client ran, provenance), listed by
name; rows sorted by their key columns. Exit codes: 0 identical, 1 some table differs, 2 bad
input (unknown case, no baseline in DIR, ...).

This file uses only stable public APIs (``config.build_config``, ``experiment.run_experiment``,
``results.load``, ``algorithms.names``) and absolute imports, so that it can be run as a file
against an older checkout: it measures whatever ``fedsap_ray`` is on ``PYTHONPATH``.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # run as a file: its own folder (the package's) must not shadow top-level modules
    del sys.path[0]

import argparse  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

FORMAT = 1
MANIFEST = "manifest.json"
# the tiny federation: preset smoke with these overrides, 3 rounds, deployed evaluation every round
BASE = ["data.max_test_per_domain=40", "model.width_mult=0.125", "training.local_epochs=2", "training.batch_size=16",
        "training.max_steps_per_epoch=3", "training.rounds=3", "training.grad_clip=5.0", "training.deployed_every=1"]
EXTRA = {"fedsap-probe": ["algorithm.name=fedsap", "algorithm.dga_source=probe"],
         "fedsap-train": ["algorithm.name=fedsap", "algorithm.dga_source=train"],  # the paper's DGA input
         "fedprox-mu": ["algorithm.name=fedprox", "algorithm.mu=0.1"]}
VARIANTS = ("local", "masked", "ray", "resume")
BACKENDS = ("local", "ray")
TABLES = ("runs", "rounds", "clients", "layers", "allocations")
# Not compared, by name (never by pattern, so no number is dropped by accident), grouped by why (the
# development guide's list is generated from these groups: python -m fedsap_ray.dev.docgen). The torch version and
# CPU kernels name the machine: check says so when a baseline's kernels are not this machine's, as every trained
# number may then differ in its last bits. (results.WALL_CLOCK names the same times; spelled out here, as this
# file must run against checkouts that predate it)
DROP_GROUPS: dict[str, tuple[str, ...]] = {
    "the run id": ("run_id",),
    "wall-clock times": ("started_at", "finished_at", "wall_s", "round_wall_s", "train_s", "eval_s", "server_s"),
    "where a client ran and what the backend moved": ("worker", "gpu_id", "node", "backend_bytes_down",
                                                      "backend_bytes_up"),
    # which process compiled a shape first depends on the backend (resources.compile; eager runs: off / null)
    "what the compiled-forward caches did": ("compile", "eval_compiles"),
    # the config as JSON text (its every leaf is also a config.* column), versions, the CPU kernels
    "provenance that differs between checkouts or machines":
        ("config_json", "package_version", "schema_version", "torch_version", "cpu_kernels"),
}
DROP = frozenset(c for cols in DROP_GROUPS.values() for c in cols)
# the Ray cases run without --full: the plain strategy and those with state kept between rounds on the
# server (FedSAP's groups and masks, SCAFFOLD's control variates) or per client (MOON's previous model);
# each Ray case costs 4-5 local ones (actor start-up), so all of them run only with --full
RAY_DEFAULT = ("fedavg", "fedsap", "scaffold", "moon")
SORT_KEYS = ("round", "eval_mode", "domain", "client_id", "layer")
SHOW = 3  # differing values shown per column


class BadInput(Exception):
    """Exit 2: what is wrong with the command line or the baseline folder."""


class _Cut(KeyboardInterrupt):
    """Raised from the progress hook to interrupt a resume case (caught only here)."""


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    variant: str  # local | masked | ray | resume

    @property
    def backend(self) -> str:
        return "ray" if self.variant == "ray" else "local"

    @property
    def full_only(self) -> bool:
        """Run only with ``--full`` (or when named in ``--only``)."""
        return self.variant == "ray" and self.name.split("@")[0] not in RAY_DEFAULT

    @property
    def reference(self) -> str:
        """The case whose recorded tables this one is compared with."""
        return self.name.split("@")[0] if self.variant == "resume" else self.name

    def config_overrides(self) -> list[str]:
        extra = {"masked": ["training.submodel=masked"], "ray": ["resources.backend=ray"]}.get(self.variant, [])
        return [*BASE, *self.overrides, *extra]


def all_cases() -> dict[str, Case]:
    """Every case, in run order: the plain ones first (a resume case compares with its plain case)."""
    from fedsap_ray import algorithms

    plain: dict[str, tuple[str, ...]] = {a: (f"algorithm.name={a}",) for a in algorithms.names()}
    plain.update({k: tuple(v) for k, v in EXTRA.items()})
    out: dict[str, Case] = {}
    for variant in VARIANTS:
        for name, ov in plain.items():
            if variant != "local" and name in EXTRA:
                continue  # the option cases run once, plain
            full = name if variant == "local" else f"{name}@{variant}"
            out[full] = Case(full, ov, variant)
    return out


def select(cases: dict[str, Case], only: Sequence[str] | None, backends: Sequence[str],
           full: bool = True) -> list[Case]:
    """The cases named in ``only`` (default: all, less the ``--full`` ones unless ``full``) of ``backends``."""
    if only:
        unknown = [n for n in only if n not in cases]
        if unknown:
            raise BadInput(f"unknown case(s): {', '.join(unknown)} (--list prints the {len(cases)} case names)")
        chosen = [cases[n] for n in cases if n in set(only)]
    else:
        chosen = [c for c in cases.values() if full or not c.full_only]
    return [c for c in chosen if c.backend in backends]


# ---------------------------------------------------------------- running a case

def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    """The compared part of a table, in a form Parquet stores and reads back unchanged."""
    keep = [c for c in df.columns if c not in DROP]
    df = df[keep].copy()
    for c in df.columns:
        if df[c].dtype == object:  # config.* leaves that are lists: one canonical text
            df[c] = [json.dumps(v.tolist() if isinstance(v, np.ndarray) else list(v))
                     if isinstance(v, (list, tuple, np.ndarray)) else v for v in df[c]]
    keys = [k for k in SORT_KEYS if k in df.columns]
    if keys:
        df = df.sort_values(keys, kind="mergesort")
    return _roundtrip(df.reset_index(drop=True))


def _roundtrip(df: pd.DataFrame) -> pd.DataFrame:
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    buf.seek(0)
    return pd.read_parquet(buf)


def run_case(case: Case, root: Path) -> dict[str, pd.DataFrame]:
    """Run ``case`` in a fresh folder under ``root``; its non-empty tables, normalised."""
    from fedsap_ray import results
    from fedsap_ray.config import build_config
    from fedsap_ray.experiment import run_experiment

    cfg = build_config(preset="smoke", overrides=case.config_overrides())
    out = root / case.name.replace("@", "_")
    if case.variant == "resume":
        def cut_after_round_2(summary: Any) -> None:
            if summary.round == 2:
                raise _Cut

        try:
            run_experiment(cfg, out, run_id="g", progress=cut_after_round_2)
        except _Cut:
            pass
        else:
            raise RuntimeError(f"{case.name}: the run was not interrupted after round 2")
        row = results.load(str(out)).runs.iloc[0]
        if row["status"] != "interrupted" or int(row["rounds_done"]) != 2:
            raise RuntimeError(f"{case.name}: after the interruption status={row['status']}, "
                               f"rounds_done={row['rounds_done']} (expected interrupted, 2)")
        run_experiment(cfg, out, run_id="g", resume=True)
    else:
        run_experiment(cfg, out, run_id="g")
    res = results.load(str(out))
    tabs = {}
    for t in TABLES:
        df = getattr(res, t, None)
        if df is not None and len(df):
            tabs[t] = _normalise(df)
    return tabs


@contextmanager
def ray_running(needed: bool) -> Iterator[None]:
    """One local Ray for every Ray case: ``run_experiment`` joins a Ray already initialised."""
    if not needed:
        yield
        return
    from fedsap_ray.runtime import ray as runtime_ray  # Ray is reached only through the runtime package

    if hasattr(runtime_ray, "local_ray"):
        with runtime_ray.local_ray(log_to_driver=False):
            yield
    else:  # a checkout older than local_ray (recording a baseline): connect, and the process's exit stops Ray
        runtime_ray.connect(log_to_driver=False)
        yield


# ---------------------------------------------------------------- comparing

def _row_label(df: pd.DataFrame, i: int) -> str:
    keys = [k for k in SORT_KEYS if k in df.columns]
    return ",".join(f"{k}={df[k].iloc[i]}" for k in keys) if keys else f"row {i}"


def _show(v: Any) -> str:
    return repr(v.item() if isinstance(v, np.generic) else v)


def _differs(a: pd.Series, b: pd.Series) -> np.ndarray:
    """Elementwise 'not the same value' (NaN/None equal to NaN/None)."""
    na, nb = a.isna().to_numpy(), b.isna().to_numpy()
    av, bv = a.to_numpy(dtype=object), b.to_numpy(dtype=object)
    eq = np.array([x == y for x, y in zip(av, bv)], dtype=bool) if len(av) else np.zeros(0, bool)
    return ~((na & nb) | (~na & ~nb & eq))


def compare_table(ref: pd.DataFrame, new: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(problems, notes): problems make the table differ; notes (columns only the new run has) do not."""
    problems: list[str] = []
    notes: list[str] = []
    ref = ref.drop(columns=[c for c in ref.columns if c in DROP])  # a baseline recorded when DROP held fewer
    gone = [c for c in ref.columns if c not in new.columns]
    added = [c for c in new.columns if c not in ref.columns]
    if gone:
        problems.append(f"columns missing from the new run: {gone}")
    if added:
        notes.append(f"new columns (not compared): {added}")
    common = [c for c in ref.columns if c in new.columns]
    if len(ref) != len(new):
        problems.append(f"{len(ref)} rows recorded, {len(new)} now")
        return problems, notes
    for c in common:
        if ref[c].dtype != new[c].dtype:
            problems.append(f"column {c}: dtype {ref[c].dtype} recorded, {new[c].dtype} now")
            continue
        bad = np.flatnonzero(_differs(ref[c], new[c]))
        if len(bad):
            shown = "; ".join(f"[{_row_label(ref, i)}] {_show(ref[c].iloc[i])} -> {_show(new[c].iloc[i])}"
                              for i in bad[:SHOW])
            more = f" (+{len(bad) - SHOW} more)" if len(bad) > SHOW else ""
            problems.append(f"column {c}: {len(bad)} of {len(ref)} rows differ (recorded -> now): {shown}{more}")
    if not problems:  # the final word: pandas' exact comparison of the compared columns
        try:
            pd.testing.assert_frame_equal(ref[common], new[common], check_exact=True)
        except AssertionError as e:
            problems.append(" ".join(str(e).split()))
    return problems, notes


def compare_case(name: str, ref: dict[str, pd.DataFrame], new: dict[str, pd.DataFrame],
                 emit: Callable[[str], None]) -> int:
    """Report ``name``'s tables; the number of tables that differ."""
    bad = 0
    problems: list[str]
    notes: list[str]
    for t in TABLES:
        if t not in ref and t not in new:
            continue
        if t not in new:
            problems, notes = [f"table recorded ({len(ref[t])} rows) but not written now"], []
        elif t not in ref:
            problems, notes = [f"table written now ({len(new[t])} rows) but not recorded"], []
        else:
            problems, notes = compare_table(ref[t], new[t])
        bad += bool(problems)
        emit(f"{'DIFF' if problems else 'OK  '}  {name}.{t}" + "".join(f"\n        {p}" for p in problems + notes))
    return bad


# ---------------------------------------------------------------- the store

def _files(store: Path, name: str) -> dict[str, Path]:
    return {t: store / f"{name}.{t}.parquet" for t in TABLES}


def read_manifest(store: Path) -> dict[str, Any]:
    f = store / MANIFEST
    if not f.is_file():
        raise BadInput(f"no baseline in {store}: {MANIFEST} is missing (record one with: record {store})")
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
    except ValueError as e:
        raise BadInput(f"unreadable {f}: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("cases"), dict):
        raise BadInput(f"{f} is not a golden-numbers manifest of format {FORMAT}")
    return m


def read_recorded(store: Path, name: str, manifest: dict[str, Any]) -> dict[str, pd.DataFrame]:
    tabs = {}
    for t in manifest["cases"][name]["tables"]:
        f = _files(store, name)[t]
        if not f.is_file():
            raise BadInput(f"baseline {store} lists {name}.{t} but {f.name} is missing")
        tabs[t] = pd.read_parquet(f)
    return tabs


def _provenance() -> dict[str, Any]:
    import fedsap_ray

    where = Path(fedsap_ray.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "package_path": str(where), "package_version": getattr(fedsap_ray, "__version__", None),
            "torch": _version("torch"), "cpu_kernels": _cpu_kernels(), "pandas": pd.__version__,
            "python": sys.version.split()[0]}


def _cpu_kernels() -> str | None:
    """The CPU kernels torch picks in this process (``runs.cpu_kernels``); None with a package that predates
    them: two machines whose kernels differ round differently."""
    for where in ("fedsap_ray.run.session", "fedsap_ray.session"):  # this layout, then the one before issue 54
        try:
            return importlib.import_module(where).cpu_kernels()
        except (ImportError, AttributeError):
            continue
    return None


def _version(mod: str) -> str | None:
    try:
        return str(__import__(mod).__version__)
    except Exception:  # noqa: BLE001 - a version is informative only
        return None


# ---------------------------------------------------------------- commands

def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _emit(msg: str) -> None:
    print(msg, flush=True)


def record(store: Path, cases: Sequence[Case], emit: Callable[[str], None] = _emit) -> int:
    """Run ``cases`` and store their tables in ``store`` (kept: cases recorded before and not rerun).
    A resume case stores nothing: it is compared with its plain case (which must be recorded)."""
    store.mkdir(parents=True, exist_ok=True)
    old: dict[str, Any] = {}
    if (store / MANIFEST).is_file():
        old = read_manifest(store)["cases"]
    plain = {c.name for c in cases if c.variant != "resume"}
    missing = sorted({c.reference for c in cases if c.variant == "resume"} - plain - set(old))
    if missing:
        raise BadInput(f"resume cases compare with their plain case, neither recorded nor selected: {missing}")
    manifest = {"format": FORMAT, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                **_provenance(), "base_overrides": BASE, "dropped_columns": sorted(DROP), "cases": dict(old)}
    bad, failed = 0, []
    fresh: dict[str, dict[str, pd.DataFrame]] = {}
    with tempfile.TemporaryDirectory(prefix="golden-") as root, ray_running(any(c.backend == "ray" for c in cases)):
        for i, case in enumerate(cases, 1):
            t0 = time.perf_counter()
            try:
                tabs = run_case(case, Path(root))
            except Exception as e:  # noqa: BLE001 - reported; the other cases still run
                emit(f"FAIL  {case.name}: {e.__class__.__name__}: {e}")
                failed.append(case.name)
                _progress(f"[{i}/{len(cases)}] {case.name}: {time.perf_counter() - t0:.1f} s, FAILED")
                continue
            if case.variant == "resume":
                ref = fresh.get(case.reference) or read_recorded(store, case.reference, manifest)
                n = compare_case(case.name, ref, tabs, emit)
                bad += n
                verdict = f"{'differs from' if n else 'equals'} {case.reference}"
            else:
                for f in _files(store, case.name).values():
                    f.unlink(missing_ok=True)
                for t, df in tabs.items():
                    df.to_parquet(_files(store, case.name)[t], index=False)
                fresh[case.name] = tabs
                manifest["cases"][case.name] = {
                    "overrides": case.config_overrides(), "backend": case.backend, "variant": case.variant,
                    "tables": {t: {"rows": len(df), "columns": list(df.columns)} for t, df in tabs.items()}}
                verdict = "recorded " + ", ".join(f"{t} {len(df)}" for t, df in tabs.items())
                _write_manifest(store, manifest)  # after every case: an interrupted record keeps what it has
            _progress(f"[{i}/{len(cases)}] {case.name}: {time.perf_counter() - t0:.1f} s, {verdict}")
    _write_manifest(store, manifest)
    emit(f"recorded {sum(c.variant != 'resume' and c.name not in failed for c in cases)} cases in {store}"
         + (f"; {bad} RESUMED TABLES DIFFER from the uninterrupted runs" if bad else "")
         + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if bad or failed else 0


def _write_manifest(store: Path, manifest: dict[str, Any]) -> None:
    tmp = store / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    tmp.replace(store / MANIFEST)


def check(store: Path, cases: Sequence[Case] | None, backends: Sequence[str] = BACKENDS, full: bool = False,
          emit: Callable[[str], None] = _emit) -> int:
    """Run ``cases`` (default: every case ``store`` recorded, with their resume cases, less the
    ``--full`` ones unless ``full``) and compare."""
    manifest = read_manifest(store)
    recorded = manifest["cases"]
    if cases is None:
        cases = [c for c in select(all_cases(), None, backends, full) if c.reference in recorded]
        if not cases:
            raise BadInput(f"{store} records no case of backend(s) {','.join(backends)}")
    missing = sorted({c.reference for c in cases} - set(recorded))
    if missing:
        raise BadInput(f"{store} has no baseline for: {', '.join(missing)} "
                       f"(it records {len(recorded)} cases; record them, or leave them out of --only)")
    then, now = manifest.get("cpu_kernels"), _cpu_kernels()
    if then and now and then != now:
        emit(f"NOTE  the baseline was recorded with CPU kernels {then}, this process has {now}: trained numbers "
             "can differ in their last bits for that reason alone (docs/architecture.md#determinism)")
    bad_tables, bad_cases = 0, []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="golden-") as root, ray_running(any(c.backend == "ray" for c in cases)):
        for i, case in enumerate(cases, 1):
            t0 = time.perf_counter()
            try:
                tabs = run_case(case, Path(root))
            except Exception as e:  # noqa: BLE001 - a case that no longer runs differs; the others still run
                emit(f"FAIL  {case.name}: {e.__class__.__name__}: {e}")
                bad_tables += 1
                bad_cases.append(case.name)
                _progress(f"[{i}/{len(cases)}] {case.name}: {time.perf_counter() - t0:.1f} s, FAILED")
                continue
            n = compare_case(case.name, read_recorded(store, case.reference, manifest), tabs, emit)
            bad_tables += n
            if n:
                bad_cases.append(case.name)
            _progress(f"[{i}/{len(cases)}] {case.name}: {time.perf_counter() - t0:.1f} s, "
                      f"{'DIFFERS' if n else 'identical'}")
    took = f"{len(cases)} cases, {time.perf_counter() - t_all:.0f} s"
    if bad_tables:
        emit(f"DIFFERENT: {bad_tables} tables in {len(bad_cases)} of {len(cases)} cases differ "
             f"({', '.join(bad_cases)}); {took}")
        return 1
    emit(f"IDENTICAL: every table of {len(cases)} cases equals the baseline "
         f"(commit {manifest.get('commit') or '?'}); {took}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedsap_ray.dev.golden", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=("record", "check"), help="record a baseline, or check against one")
    p.add_argument("dir", nargs="?", type=Path, help="the baseline folder")
    p.add_argument("--only", help="comma-separated case names (default: all; check: those DIR records)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="local,ray (default both)")
    p.add_argument("--full", action="store_true",
                   help=f"also the Ray cases of every algorithm (default: only {', '.join(RAY_DEFAULT)} on Ray)")
    p.add_argument("--list", action="store_true", help="print the case names (those run without --full first) and exit")
    a = p.parse_args(argv)
    try:
        backends = [b.strip() for b in a.backends.split(",") if b.strip()]
        wrong = [b for b in backends if b not in BACKENDS]
        if wrong or not backends:
            raise BadInput(f"invalid --backends={a.backends!r}: allowed values are {','.join(BACKENDS)}")
        known = all_cases()
        if a.list:
            for c in sorted(select(known, None, backends), key=lambda c: c.full_only):
                print(f"{c.name}\t{c.backend}{' (--full)' if c.full_only else ''}\t{' '.join(c.overrides)}")
            return 0
        if a.mode is None or a.dir is None:
            raise BadInput("give a mode and a folder: record DIR | check DIR (or --list)")
        only = [n.strip() for n in a.only.split(",") if n.strip()] if a.only is not None else None
        if only is not None and not only:
            raise BadInput("--only names no case")
        chosen = select(known, only, backends, a.full)
        if only and not chosen:
            raise BadInput(f"--only {a.only} selects no case of backend(s) {','.join(backends)}")
        import torch

        torch.set_num_threads(1)
        if a.mode == "record":
            return record(a.dir, chosen)
        return check(a.dir, chosen if only else None, backends, a.full)
    except BadInput as e:
        print(f"golden: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
