"""Reading a results folder: every run's rows exactly once, in one pyarrow dataset scan per table.

Per-run and compacted files are read together (:func:`fedsap_ray.results.store.sources` says
which rows of which file); the explicit schema adds the columns an older file lacks as nulls.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from fedsap_ray.results.schema import DATA_TABLES, check_table, schema
from fedsap_ray.results.store import dataset, filesystem, is_dir, list_table, raise_unreadable, readahead, sources


@dataclass
class Results:
    runs: pd.DataFrame
    rounds: pd.DataFrame
    clients: pd.DataFrame
    layers: pd.DataFrame
    allocations: pd.DataFrame

    def __getitem__(self, table: str) -> pd.DataFrame:
        return getattr(self, table)


def read_arrow(fs: pafs.FileSystem, base: str, table: str, columns: list[str] | None = None) -> pa.Table:
    whole, partial = sources(fs, list_table(fs, base, table))
    kw: dict[str, Any] = {"columns": columns, "fragment_readahead": readahead(fs)}
    try:
        parts = [dataset(fs, whole, table).to_table(**kw)] if whole else []
        for path, skip in partial:
            parts.append(dataset(fs, [path], table).to_table(filter=~pc.field("run_id").isin(sorted(skip)), **kw))
    except (OSError, pa.ArrowException) as e:  # a truncated or damaged file: named, in one line
        raise_unreadable(fs, [*whole, *(p for p, _ in partial)], table, e)
    if not parts:
        empty = schema(table).empty_table()
        return empty.select(columns) if columns else empty
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def read_table(path: str | Path, table: str) -> pd.DataFrame:
    """Read one table of a results folder (every run in it), with every schema column present.

    ``path`` is a local folder or a URI (``s3://bucket/sweep``, ``file:///...``). All files
    are read in one multi-threaded pyarrow dataset scan; per-run and compacted files
    together give each run's rows exactly once.
    """
    check_table(table)
    fs, base = filesystem(path)
    df = read_arrow(fs, base, table).to_pandas()
    return with_config_columns(df) if table == "runs" else df


def load(path: str | Path) -> Results:
    """Load a results folder (one run or a whole sweep; local path or URI) as pandas DataFrames; the runs
    table gains the flattened ``config.*`` columns (:func:`with_config_columns`)."""
    fs, base = filesystem(path)
    if not is_dir(fs, base):
        raise FileNotFoundError(f"no results folder at {path}")
    runs, *data = (read_arrow(fs, base, t).to_pandas() for t in ("runs", *DATA_TABLES))
    return Results(with_config_columns(runs), *data)


CONFIG_PREFIX = "config."


def with_config_columns(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` plus one ``config.<section>.<field>`` column per leaf of each run's resolved config
    (``config_json``; algorithm options as ``config.algorithm.options.<name>``, only those the run set),
    as Ray Tune's ``config/...`` columns, so a notebook filters runs by any setting without parsing JSON.
    Leaves a run lacks are NaN; lists stay Python lists. Derived on read: the files keep one schema."""
    if runs.empty or "config_json" not in runs.columns:
        return runs
    parsed = [json.loads(c) if isinstance(c, str) and c else {} for c in runs["config_json"]]
    flat = pd.json_normalize(parsed, sep=".").add_prefix(CONFIG_PREFIX)
    flat.index = runs.index
    return pd.concat([runs.drop(columns=[c for c in flat.columns if c in runs.columns]), flat], axis=1)


def run_statuses(path: str | Path) -> dict[str, str]:
    """run_id -> status of every run in a results folder (per-run and compacted files); {} if none."""
    fs, base = filesystem(path)
    t = read_arrow(fs, base, "runs", columns=["run_id", "status"])
    return dict(zip(t.column("run_id").to_pylist(), t.column("status").to_pylist()))

