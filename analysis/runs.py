"""Loading a results folder for analysis, and the one per-run table every study builds on.

A study script writes run ids ``<variant>-s<seed>`` (sweeps/trials.py); :func:`load_sweep` adds that
``variant`` name (the study's own name for the run: its identity, not a description), the run's
:func:`analysis.labels.label` and every algorithm option *resolved* against the strategy's defaults
(``opt_<name>`` columns), all from the flattened ``config.*`` columns, so tables select runs by what
they ran, not by their names. :func:`per_run` is one row per run with those and every per-run figure
of :mod:`analysis.metrics`.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from collections.abc import Sequence

import pandas as pd

from analysis import labels, metrics
from fedsap_ray import results

TABLES = ("runs", "rounds", "clients", "layers", "allocations")
RUN_COLUMNS = ("variant", "seed", "algorithm", "study", "dataset")  # what join_runs adds by default
IDENTITY = ("run_id", "variant", "label", "seed", "study", "dataset", "algorithm", "status", "rounds_done")
_SEED_SUFFIX = re.compile(r"-s\d+$")


class MissingData(ValueError):
    """The folder lacks what a table or figure needs (e.g. no allocations rows); notebooks skip it."""


def _variant(run_id: Any) -> str:
    """``full-s2`` -> ``full``: the study script's name for the run."""
    return _SEED_SUFFIX.sub("", str(run_id))


def annotate_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with its ``config.*`` columns (added when missing), ``variant`` (run id without
    ``-s<seed>``), ``label`` (:func:`analysis.labels.label`) and one ``opt_<name>`` column per resolved
    algorithm option (NaN where a run's algorithm has no such option)."""
    runs = results.with_config_columns(runs) if not any(str(c).startswith(results.CONFIG_PREFIX)
                                                         for c in runs.columns) else runs.copy()
    runs = runs.copy()
    runs["variant"] = [_variant(r) for r in runs["run_id"]] if "run_id" in runs.columns else []
    runs["label"] = labels.labels(runs)
    resolved = pd.DataFrame([labels.options_of(r) for _, r in runs.iterrows()], index=runs.index, dtype=object)
    for name in resolved.columns:
        runs[labels.OPT + name] = resolved[name]
    return runs


def replace_tables(res: Any, **tables: pd.DataFrame) -> Any:
    """A copy of a loaded results object with the given tables replaced (the others shared)."""
    if dataclasses.is_dataclass(res) and not isinstance(res, type):
        return dataclasses.replace(res, **tables)
    return SimpleNamespace(**{**vars(res), **tables})


def locate(path: str | os.PathLike) -> str | os.PathLike:
    """``path`` as given if it exists (or is a URI); a relative path that does not exist here but does
    under the repository root (where the study scripts write ``runs/<study>``) is taken from there,
    so a notebook opened in analysis/notebooks/ finds ``runs/<study>``."""
    text = os.fspath(path)
    if "://" in text or os.path.isabs(text) or os.path.exists(text):
        return path
    root = Path(__file__).resolve().parents[1] / text
    return str(root) if root.exists() else path


def table(res: Any, name: str) -> pd.DataFrame:
    """Table ``name`` of a Results-like object; a missing one is an empty frame with the schema's columns."""
    if name not in TABLES:
        raise ValueError(f"table={name!r}: allowed values are {', '.join(TABLES)}")
    df = getattr(res, name, None)
    if df is None or (df.empty and len(df.columns) == 0):
        return results.schema(name).empty_table().to_pandas()
    return df


def _allocations(folder: Path) -> pd.DataFrame | None:
    """The ``allocations`` table for a loader that does not expose it (read and checked as
    :func:`fedsap_ray.results.read_table` reads it); None when the folder has no such table."""
    from fedsap_ray.persist.outdir import OutDir

    if not OutDir(folder).is_dir(Path(folder) / "allocations"):  # no link followed (fedsap_ray.persist.outdir)
        return None
    return results.read_table(folder, "allocations")


def load_sweep(path: str | os.PathLike | Any, study: str | None = None) -> Any:
    """A results folder (``fedsap_ray.results.load``) with annotated runs (:func:`annotate_runs`) and every
    table present (a missing one empty).

    ``path`` may also be an already loaded Results-like object (one holding a run twice, e.g. two loads put
    together, is :class:`DuplicateRuns`). ``study`` keeps only the runs whose ``runs.study`` is that name (for
    folders holding several studies). A folder that ``fedsap_ray.results.load`` refuses (a file copied under
    another run's name, a row twice, a damaged ``config_json``, ...) raises its one-line
    ``fedsap_ray.results.store.UnreadableFile``."""
    if hasattr(path, "runs"):
        res = path
        check_unique_runs(table(res, "runs"))
    else:
        res = results.load(os.fspath(path))
        if getattr(res, "allocations", None) is None:
            res = replace_tables(res, allocations=_allocations(Path(path)))
    if "label" not in res.runs.columns:
        res = replace_tables(res, runs=annotate_runs(table(res, "runs")))
    return _study(res, study)


class DuplicateRuns(ValueError):
    """A loaded results object whose runs table holds a run more than once (a folder's load never does: two
    loads concatenated); every per-run figure would count it twice. The message is one line."""


def check_unique_runs(runs: pd.DataFrame) -> None:
    """:class:`DuplicateRuns` unless every run id of ``runs`` is there once."""
    if "run_id" not in runs.columns or runs["run_id"].is_unique:
        return
    counts = runs["run_id"].value_counts()
    twice = counts[counts > 1]
    raise DuplicateRuns(f"the runs table holds run {twice.index[0]} {int(twice.iloc[0])} times"
                        f"{f' (and {len(twice) - 1} more runs more than once)' if len(twice) > 1 else ''}: put results "
                        "objects together only when their run ids differ")


class Unreadable(ValueError):
    """A path given to an analysis command is no results folder it can read; the message is one line."""


def open_folder(path: str | os.PathLike) -> Any:
    """:func:`_open_folder`, with a folder entry fedsap_ray refuses to touch (a link, the wrong kind:
    :mod:`fedsap_ray.persist.outdir`) as one more :class:`Unreadable`."""
    from fedsap_ray.common.errors import ConfigError

    try:
        return _open_folder(path)
    except ConfigError as e:
        raise Unreadable(str(e)) from None


def _open_folder(path: str | os.PathLike) -> Any:
    """:func:`load_sweep` of a results folder (a local path or a URI such as ``file:///...``, ``s3://...``) for a
    command line, or :class:`Unreadable` with one line saying what is wrong: an empty path, a URI pyarrow cannot
    open, a missing folder, an empty one, one without a ``runs`` table (not a results folder), a Parquet file
    that cannot be read (truncated, damaged) or one the readers refuse (``fedsap_ray.results.UnreadableFile``,
    a ConfigError: :func:`open_folder` turns it into this one line)."""
    import warnings

    import pyarrow as pa
    import pyarrow.fs as pafs

    from fedsap_ray.results.store import is_dir, list_table

    text = os.fspath(path)
    if text.strip() == "":
        raise Unreadable("the results folder is an empty path; give the --out folder of a sweep or of fedsap-ray run")
    try:
        fs, base = results.filesystem(text)
    except ValueError as e:
        raise Unreadable(str(e).splitlines()[0]) from None
    if not is_dir(fs, base):
        what = "no such folder" if fs.get_file_info(base).type == pafs.FileType.NotFound else "is a file, not a folder"
        raise Unreadable(f"{text}: {what}; give the --out folder of a sweep or of fedsap-ray run")
    with warnings.catch_warnings():  # a foreign file in runs/ is skipped (a warning): it is no runs table either
        warnings.simplefilter("ignore")
        listing = list_table(fs, base, "runs")
    if not (listing.per_run or listing.compacted or listing.parts):
        empty = not fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        raise Unreadable(f"{text}: " + ("the folder is empty" if empty else "not a results folder (no runs table, "
                                        "runs/*.parquet)") + "; give the --out folder of a sweep or of fedsap-ray run")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_sweep(text)
    except (OSError, pa.ArrowException) as e:
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
        raise Unreadable(f"{text}: a Parquet file cannot be read ({first}); restore it from a copy or remove it "
                         "(its run's rows are lost)") from None


def open_or_exit(path: str | os.PathLike, prog: str) -> Any:
    """:func:`open_folder` for a command line ``prog``: a refusal is one line on stderr and exit status 2."""
    import sys

    try:
        return open_folder(path)
    except Unreadable as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def only_runs(res: Any, run_ids: Any) -> Any:
    """A copy of a loaded results object holding only the rows of ``run_ids``, in every table."""
    keep = set(run_ids)
    return replace_tables(res, **{t: (df := table(res, t))[df["run_id"].isin(keep)] for t in TABLES})


def _study(res: Any, study: str | None) -> Any:
    if study is None:
        return res
    return only_runs(res, res.runs.loc[res.runs["study"] == study, "run_id"])


def join_runs(df: pd.DataFrame, runs: pd.DataFrame, cols: Sequence[str] = RUN_COLUMNS) -> pd.DataFrame:
    """``df`` (rounds, clients, layers or allocations rows) with the runs' ``cols`` joined on run_id."""
    cols = [c for c in cols if c in runs.columns and c not in df.columns]
    return df.merge(runs[["run_id", *cols]], on="run_id", how="left")


def joined(res: Any, name: str, cols: Sequence[str] = RUN_COLUMNS) -> pd.DataFrame:
    """Table ``name`` of a sweep with the runs' ``cols`` (variant, seed, ...) joined on."""
    res = load_sweep(res)
    return join_runs(table(res, name), res.runs, cols)


def per_run(res: Any, *, domains: bool = False) -> pd.DataFrame:
    """The per-run table: one row per run (every status) with its identity (:data:`IDENTITY`: run id,
    variant, label, seed, study, dataset, algorithm, status, rounds done), its ``config.*`` and
    ``opt_*`` columns, and every per-run figure (NaN where the run did not record it):

    - ``best_global_accuracy`` / ``final_global_accuracy`` (:func:`analysis.metrics.global_accuracy`);
    - ``deployed``, ``deployed_final``, ``worst_client`` (the deployed models) and ``train_gmacs``,
      ``max_train_gmacs`` (training compute per client-round);
    - ``n_groups``, ``ari_domain``, ``ari_capacity`` (FedSAP's DGA, mean over DGA rounds);
    - ``rounds``, ``avg_p``, ``final_frozen_params``, ``widest_p_late`` (:func:`analysis.metrics.width_stats`);
    - with ``domains``, one column per test domain: its best-so-far accuracy (papers/000 Table 1).
    """
    res = load_sweep(res)
    runs = res.runs
    rounds, clients = table(res, "rounds"), table(res, "clients")
    ident = [c for c in IDENTITY if c in runs.columns]
    config = [c for c in runs.columns if c not in ident and (str(c).startswith((results.CONFIG_PREFIX, labels.OPT))
                                                             or c == "config_json")]
    out = runs[[*ident, *config]].set_index("run_id")
    figures = [metrics.global_accuracy(rounds), metrics.deployed_accuracy(rounds), metrics.train_compute(clients),
               metrics.grouping_stats(rounds), metrics.width_stats(rounds, clients)]
    if domains:
        figures.append(metrics.domain_best(rounds).drop(columns="global", errors="ignore"))
    for f in figures:
        out = out.join(f.drop(columns=[c for c in f.columns if c in out.columns]), how="left")
    return out.reset_index()
