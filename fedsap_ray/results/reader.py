"""Reading a results folder: every run's rows exactly once, in one pyarrow dataset scan per table, or a refusal.

Per-run and compacted files are read together (:func:`fedsap_ray.results.store.sources` says which rows of which
file); the explicit schema adds the columns an older file lacks as nulls and leaves out the columns it does not
know. What the files hold is checked on what the reading has at hand, never by reading a file twice: each file's
schema (:func:`check_file_schema`, from the footer the scan then reuses) and the rows the scan returned
(:func:`check_rows`). A file that breaks a rule is refused with :class:`~fedsap_ray.results.store.UnreadableFile`,
one line naming it and the problem (exit 2 from a command): docs/guides/running.md#what-a-results-folder-promises.
"""
from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from fedsap_ray.results.schema import DATA_TABLES, ROW_KEYS, SCHEMA_VERSION, check_table, required_columns, schema
from fedsap_ray.results.store import (Listing, UnreadableFile, dataset, filesystem, is_dir, list_table, raise_unreadable,
                                      readahead, run_ids, sources)

FIX = "restore it from a copy or remove it"  # what every refusal of a file ends with


@dataclass
class Results:
    runs: pd.DataFrame
    rounds: pd.DataFrame
    clients: pd.DataFrame
    layers: pd.DataFrame
    allocations: pd.DataFrame

    def __getitem__(self, table: str) -> pd.DataFrame:
        return getattr(self, table)


@dataclass(frozen=True)
class Source:
    """Whose rows a file may hold, by its name: a per-run file only its run's, a part only its run's of its
    round; a compacted file (``run`` None) any run's. ``held``: a per-run file's (path, round) of the parts its
    ``fedsap_ray.upto_round`` says it holds (readers skip them, so it must have rows of their rounds)."""

    path: str
    run: str | None = None
    round: int | None = None
    held: tuple[tuple[str, int], ...] = ()


def _sources(listing: Listing) -> dict[str, Source]:
    out = {i.path: Source(i.path, r, held=tuple((p.path, rnd) for rnd, p in listing.parts.get(r, [])
                                                 if rnd <= listing.upto.get(r, 0.0)))
           for r, i in listing.per_run.items()}
    out.update({i.path: Source(i.path, r, rnd) for r, ps in listing.parts.items() for rnd, i in ps})
    out.update({i.path: Source(i.path) for i in listing.compacted})
    return out


LIVE_RETRIES = 20  # re-listings of a table a writer keeps changing under a read, before its failure is reported


def read_arrow(fs: pafs.FileSystem, base: str, table: str, columns: list[str] | None = None) -> pa.Table:
    """Table ``table`` of the folder ``base`` (``columns`` only, when given), every file checked
    (:func:`check_file_schema`, :func:`check_rows`); the columns the checks need are read in any case.

    A folder a run or sweep is still writing (a notebook watching it) changes under a read: a round's part merged
    into its run's file and removed, a file replaced. A read that fails while the table's listing changed is
    therefore read again from a fresh listing (up to :data:`LIVE_RETRIES` times); a failure on an unchanged
    listing is the file's own and is reported at once."""
    for attempt in range(LIVE_RETRIES):
        listing = list_table(fs, base, table)
        try:
            return _read_listing(fs, base, table, listing, columns)
        except (OSError, pa.ArrowException, UnreadableFile):
            if _signature(list_table(fs, base, table)) == _signature(listing):
                raise
            time.sleep(0.05 * (attempt + 1))
    return _read_listing(fs, base, table, list_table(fs, base, table), columns)


def _signature(listing: Listing) -> list[tuple[str, int | None, float | None]]:
    """What a listing found, file by file: path, size and modification time (a changed one was rewritten)."""
    infos = [*listing.per_run.values(), *listing.compacted, *(i for ps in listing.parts.values() for _, i in ps)]
    return sorted((i.path, i.size, i.mtime_ns) for i in infos)


def _read_listing(fs: pafs.FileSystem, base: str, table: str, listing: Listing,
                  columns: list[str] | None) -> pa.Table:
    """:func:`read_arrow` of the files of one listing."""
    whole, partial = sources(fs, listing, table)
    scan = None if columns is None else list(dict.fromkeys([*columns, *checked_columns(table)]))
    pieces: list[pa.Table] = []
    files: list[tuple[str, int]] = []  # (path, rows read from it), in the order of the rows
    names: dict[str, list[str]] = {}  # path -> its columns
    try:
        for paths, skip in [(whole, None)] * bool(whole) + [([p], s) for p, s in partial]:
            pieces.append(_scan(dataset(fs, paths, table), table, scan, skip, files, names, readahead(fs)))
    except (OSError, pa.ArrowException) as e:  # a truncated or damaged file: named, in one line
        paths = [*whole, *(p for p, _ in partial)]
        _refuse_schemas(fs, paths, table)
        raise_unreadable(fs, paths, table, e)
    if not pieces:
        empty = schema(table).empty_table()
        return empty.select(columns) if columns is not None else empty
    t = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
    check_rows(t, files, _sources(listing), names, table)
    return t.select(columns) if columns is not None else t


def _scan(d: ds.FileSystemDataset, table: str, columns: list[str] | None, skip: set[str] | None,
          files: list[tuple[str, int]], names: dict[str, list[str]], readahead: int) -> pa.Table:
    """Scan ``d`` (without the runs ``skip``), adding to ``files`` the rows each file gave, and check each file's
    schema: the footer the scan read (cached in its fragment, so a file a writer replaced meanwhile is never
    judged by another version of it than the one read)."""
    kw: dict[str, Any] = {"columns": columns, "fragment_readahead": readahead}
    if skip is not None:
        kw["filter"] = ~pc.field("run_id").isin(sorted(skip))
    scanner = d.scanner(**kw)
    batches, rows = [], Counter[str]()
    for tagged in scanner.scan_batches():  # in order: file by file, as to_table gives them
        batches.append(tagged.record_batch)
        rows[tagged.fragment.path] += tagged.record_batch.num_rows
    want = schema(table)
    seen: list[tuple[pa.Schema, list[str]]] = []  # the schemas checked already and their columns (most files share one)
    for frag in d.get_fragments():
        sch = frag.physical_schema
        known = next((cols for s, cols in seen if sch.equals(s)), None)
        if known is None:
            check_file_schema(frag.path, sch, table, want)
            known = sch.names
            seen.append((sch, known))
        names[frag.path] = known
        files.append((frag.path, rows[frag.path]))
    return pa.Table.from_batches(batches, schema=scanner.projected_schema)


def checked_columns(table: str) -> list[str]:
    """The columns :func:`check_rows` reads: the version, the row keys and (a part's) the round."""
    return list(dict.fromkeys(["schema_version", *ROW_KEYS[table], *(["round"] if table in DATA_TABLES else [])]))


def _refuse_schemas(fs: pafs.FileSystem, paths: list[str], table: str) -> None:
    """After a failed scan: a file whose schema breaks a rule is named for that (text where a number belongs
    fails the scan's cast), before :func:`raise_unreadable` looks for the file that cannot be read."""
    for p in paths:
        try:
            sch = next(iter(dataset(fs, [p], table).get_fragments())).physical_schema
        except (OSError, pa.ArrowException):
            continue
        check_file_schema(p, sch, table)


# ----------------------------------------------------------------------------- a file's schema

def castable(have: pa.DataType, want: pa.DataType) -> bool:
    """Whether a file's column of type ``have`` reads as the schema's ``want``: the same values in another width
    or encoding (an integer column a pandas round trip made float64, a 32-bit integer, a large or dictionary
    string, all nulls, another timestamp unit), which the scan casts value by value and refuses where a value
    would change (0.5 into an integer column). Text where a number belongs, or a number where text does, is
    not: the scan would parse or print it (accuracy "0.5" read as 0.5)."""
    if have == want or pa.types.is_null(have):
        return True
    if pa.types.is_dictionary(have):
        return castable(have.value_type, want)
    if pa.types.is_timestamp(have) and pa.types.is_timestamp(want):
        return have.tz == want.tz
    return (_text(have) and _text(want)) or (_number(have) and _number(want))


def _text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def check_file_schema(path: str, sch: pa.Schema, table: str, want: pa.Schema | None = None) -> None:
    """A file of ``table`` (whose schema is ``want``, when the caller has it) names each column once, in a type
    that reads as the schema's (:func:`castable`); columns outside the schema are ignored. Which columns it must
    have depends on its rows' schema version (:func:`check_rows`)."""
    twice = sorted(n for n, k in Counter(sch.names).items() if k > 1)
    if twice:
        raise UnreadableFile(f"results file {path} has the column {twice[0]} twice; {FIX}")
    want = want if want is not None else schema(table)
    for f in sch:
        i = want.get_field_index(f.name)
        if i >= 0 and not castable(f.type, want.field(i).type):
            raise UnreadableFile(f"results file {path}: column {f.name} is {f.type} where the {table} table has "
                                 f"{want.field(i).type}; {FIX}")


# ----------------------------------------------------------------------------- the rows read

def check_rows(t: pa.Table, files: list[tuple[str, int]], owners: dict[str, Source], names: dict[str, list[str]],
               table: str) -> None:
    """The rows ``t`` of ``table``, read from ``files`` ((path, rows), in the order of the rows), follow the rules
    a reader relies on, or :class:`UnreadableFile` names the file:

    - every row's ``schema_version`` is one this code knows (1 to :data:`SCHEMA_VERSION`; a null, which no writer
      wrote, reads as 1), and the file has every column its newest rows' version wrote
      (:func:`~fedsap_ray.results.schema.required_columns`);
    - a per-run file holds only the rows of the run it is named after, a part only its run's rows of its round
      (a file copied under another run's name would read as that run);
    - no row key (:data:`~fedsap_ray.results.schema.ROW_KEYS`) is held twice, in one file or in two.

    Vectorised over the whole table (per-file minima and maxima with numpy, one integer key per row), so the
    checks cost a small part of the reading itself.
    """
    if not files:
        return
    counts = np.array([n for _, n in files], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    lo, hi = _reduce(_ints(t.column("schema_version"), fill=1), starts, counts)
    for k, (path, n) in enumerate(files):
        _check_version(path, int(lo[k]) if n else 1, int(hi[k]) if n else 1, names.get(path, []), table)
    run_code, run_ids = _run_codes(t.column("run_id"))
    _check_owners(t, run_code, run_ids, files, starts, counts, owners)
    _check_unique(t, run_code, len(run_ids), files, starts, table)


def _check_version(path: str, lo: int, hi: int, names: list[str], table: str) -> None:
    if hi > SCHEMA_VERSION:
        raise UnreadableFile(f"results file {path} holds rows of schema_version {hi}, newer than this fedsap_ray reads "
                             f"({SCHEMA_VERSION}); read the folder with the fedsap_ray that wrote it, or a later one")
    if lo < 1:
        raise UnreadableFile(f"results file {path} holds rows of schema_version {lo}, which no fedsap_ray wrote (this "
                             f"one reads 1 to {SCHEMA_VERSION}); {FIX}")
    missing = [c for c in _required(table, hi) if c not in names]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UnreadableFile(f"results file {path} (schema_version {hi}) lacks the column(s) {', '.join(missing[:3])}{more} "
                             f"that every file of that version has; {FIX}")


@cache
def _required(table: str, version: int) -> tuple[str, ...]:
    return tuple(required_columns(table, version))


def _check_owners(t: pa.Table, run_code: np.ndarray, run_ids: list[Any], files: list[tuple[str, int]],
                  starts: np.ndarray, counts: np.ndarray, owners: dict[str, Source]) -> None:
    """A per-run file holds only its run's rows, a part only its run's rows of its round (:class:`Source`)."""
    code_of = {r: i for i, r in enumerate(run_ids)}
    rlo, rhi = _reduce(run_code, starts, counts)
    rounds = _ints(t.column("round"), fill=-1) if "round" in t.column_names else None
    ro_lo, ro_hi = _reduce(rounds, starts, counts) if rounds is not None else (rlo, rhi)
    for k, (path, n) in enumerate(files):
        own = owners.get(path)
        if own is not None and own.held and rounds is not None:
            have = set(np.unique(rounds[starts[k]:starts[k] + n]).tolist())
            part, rnd = next(((p, r) for p, r in own.held if r not in have), ("", 0))
            if part:
                raise UnreadableFile(f"results file {path} has no rows of round {rnd}, yet its fedsap_ray.upto_round "
                                     f"says it holds the part {part}, so readers skip that part; {FIX}")
        if not n or own is None or own.run is None:
            continue
        want = code_of.get(own.run, -1)
        if rlo[k] != want or rhi[k] != want:
            rows = run_code[starts[k]:starts[k] + n]
            kind = "per-run file" if own.round is None else "part"
            raise UnreadableFile(f"results file {path} holds rows of run {run_ids[int(rows[rows != want][0])]}: a {kind} "
                                 f"holds only the rows of the run it is named after ({own.run}); a copy under another "
                                 f"name? {FIX}")
        if own.round is not None and rounds is not None and not ro_lo[k] == ro_hi[k] == own.round:
            other = int(ro_lo[k] if ro_lo[k] != own.round else ro_hi[k])
            raise UnreadableFile(f"results file {path} holds rows of round {other}: a part holds only the rows of its "
                                 f"round ({own.round}); {FIX}")


def _combined(col: pa.ChunkedArray) -> pa.Array:
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def _ints(col: pa.Array | pa.ChunkedArray, fill: int) -> np.ndarray:
    """An integer column as int64, nulls as ``fill``."""
    arr = _combined(col) if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count:
        arr = pc.fill_null(arr, fill)
    return arr.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _reduce(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per file (``counts`` rows from ``starts``), the minimum and maximum of ``values``; 0 for a file without rows."""
    lo, hi = np.zeros(len(starts), np.int64), np.zeros(len(starts), np.int64)
    full = counts > 0
    if full.any():
        lo[full] = np.minimum.reduceat(values, starts[full])
        hi[full] = np.maximum.reduceat(values, starts[full])
    return lo, hi


def _run_codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list[Any]]:
    """Each row's run as a small integer, and the run id of each code. Rows come run by run (a file's rows, a run's
    parts right after its file), so a code per stretch of one run's rows is found by comparing neighbours; only
    when a run's rows are in two stretches (a hostile file) are the ids hashed (dictionary-encoded)."""
    arr = _combined(col)
    n = len(arr)
    if n and not arr.null_count:
        new = np.flatnonzero(pc.not_equal(arr.slice(1), arr.slice(0, n - 1)).to_numpy(zero_copy_only=False)) + 1
        firsts = arr.take(pa.array(np.concatenate([[0], new]))).to_pylist()
        if len(set(firsts)) == len(firsts):
            code = np.zeros(n, np.int64)
            code[new] = 1
            return np.cumsum(code, out=code), firsts
    enc = pc.dictionary_encode(arr, null_encoding="encode")
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), enc.dictionary.to_pylist()


def _codes(col: pa.ChunkedArray) -> tuple[np.ndarray, int]:
    """A key column as small non-negative integers (equal values, equal codes; a null one more value) and how
    many values they span."""
    if _text(col.type):
        enc = pc.dictionary_encode(col, null_encoding="encode")  # the chunks share one dictionary
        indices = pa.chunked_array([c.indices for c in enc.chunks], type=enc.type.index_type)
        return indices.to_numpy().astype(np.int64), max(len(enc.chunk(0).dictionary) if enc.num_chunks else 0, 1)
    arr = _combined(col)
    mm = pc.min_max(arr).as_py()
    if mm["min"] is None:
        return np.zeros(len(arr), np.int64), 1
    null = int(mm["min"]) - 1
    return _ints(arr, fill=null) - null, int(mm["max"]) - null + 1


def _check_unique(t: pa.Table, run_code: np.ndarray, n_runs: int, files: list[tuple[str, int]], starts: np.ndarray,
                  table: str) -> None:
    """No :data:`ROW_KEYS` value twice: one int64 per row (the key columns' codes), strictly increasing in the usual
    case (rows as a run writes them), else hashed (pandas); a key too wide for 64 bits is hashed column-wise."""
    keys = ROW_KEYS[table]
    codes = [(run_code, max(n_runs, 1))] + [_codes(t.column(k)) for k in keys if k != "run_id"]
    span = 1
    for _, n in codes:
        span *= n
    if span < 2**63:
        key = codes[0][0].copy()
        for c, n in codes[1:]:
            key *= n
            key += c
        if bool((key[1:] > key[:-1]).all()):
            return
        dup = pd.Series(key).duplicated(keep=False).to_numpy()
    else:
        dup = pd.DataFrame({i: c for i, (c, _) in enumerate(codes)}).duplicated(keep=False).to_numpy()
    if not dup.any():
        return
    at = np.flatnonzero(dup)
    row = int(at[0])
    same = at[np.all([c[at] == c[row] for c, _ in codes], axis=0)]
    where = sorted({files[int(i)][0] for i in np.searchsorted(starts, same, side="right") - 1})
    shown = ", ".join(f"{k}={t.column(k)[row].as_py()!r}" for k in keys)
    if len(where) == 1:
        raise UnreadableFile(f"results file {where[0]} holds the {table} row ({shown}) {len(same)} times; {FIX}")
    raise UnreadableFile(f"results files {where[0]} and {where[1]} both hold the {table} row ({shown}); remove "
                         "the one that should not hold it (a copy?)")


# ----------------------------------------------------------------------------- tables and folders

def read_table(path: str | Path, table: str) -> pd.DataFrame:
    """Read one table of a results folder (every run in it), with every schema column present.

    ``path`` is a local folder or a URI (``s3://bucket/sweep``, ``file:///...``). All files
    are read in one multi-threaded pyarrow dataset scan; per-run and compacted files
    together give each run's rows exactly once, or a file is refused (:func:`read_arrow`).
    """
    check_table(table)
    fs, base = filesystem(path)
    df = read_arrow(fs, base, table).to_pandas()
    return with_config_columns(df, lambda r: runs_file_of(fs, base, r)) if table == "runs" else df


def load(path: str | Path) -> Results:
    """Load a results folder (one run or a whole sweep; local path or URI) as pandas DataFrames; the runs
    table gains the flattened ``config.*`` columns (:func:`with_config_columns`). Every run's rows come
    once, or :class:`~fedsap_ray.results.store.UnreadableFile` names the file that breaks a rule
    (:func:`read_arrow`)."""
    fs, base = filesystem(path)
    if not is_dir(fs, base):
        raise FileNotFoundError(f"no results folder at {path}")
    runs, *data = (read_arrow(fs, base, t).to_pandas() for t in ("runs", *DATA_TABLES))
    return Results(with_config_columns(runs, lambda r: runs_file_of(fs, base, r)), *data)


def check_folder(fs: pafs.FileSystem, base: str, tables: tuple[str, ...] = DATA_TABLES) -> None:
    """Every check :func:`read_arrow` makes on ``tables``, reading only the columns the checks need
    (what ``fedsap-ray compact`` does before it changes anything)."""
    for table in tables:
        read_arrow(fs, base, table, columns=[])


CONFIG_PREFIX = "config."


def with_config_columns(runs: pd.DataFrame, where: Callable[[str], str] | None = None) -> pd.DataFrame:
    """``runs`` plus one ``config.<section>.<field>`` column per leaf of each run's resolved config
    (``config_json``; algorithm options as ``config.algorithm.options.<name>``, only those the run set),
    as Ray Tune's ``config/...`` columns, so a notebook filters runs by any setting without parsing JSON.
    Leaves a run lacks are NaN; lists stay Python lists. Derived on read: the files keep one schema.

    A ``config_json`` that is not a JSON object is :class:`~fedsap_ray.results.store.UnreadableFile` naming
    the run (and its file: ``where(run_id)``); a null or empty one gives the run no ``config.*`` values."""
    if runs.empty or "config_json" not in runs.columns:
        return runs
    ids = runs["run_id"] if "run_id" in runs.columns else pd.Series([None] * len(runs), index=runs.index)
    parsed = [_config(text, run_id, where) for text, run_id in zip(runs["config_json"], ids)]
    flat = pd.json_normalize(parsed, sep=".").add_prefix(CONFIG_PREFIX)
    flat.index = runs.index
    return pd.concat([runs.drop(columns=[c for c in flat.columns if c in runs.columns]), flat], axis=1)


def _config(text: Any, run_id: Any, where: Callable[[str], str] | None) -> dict[str, Any]:
    if not isinstance(text, str) or not text:
        return {}
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as e:
        problem = f"is not JSON ({str(e).splitlines()[0][:80] if str(e) else 'nested too deep'})"
    else:
        if isinstance(cfg, dict):
            return cfg
        problem = f"is a JSON {_JSON_KINDS.get(type(cfg), type(cfg).__name__)}, not an object"
    if where is None or run_id is None:
        raise UnreadableFile(f"run {run_id}'s config_json {problem}")
    raise UnreadableFile(f"results file {where(run_id)}: run {run_id}'s config_json {problem}; {FIX}")


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def runs_file_of(fs: pafs.FileSystem, base: str, run_id: str) -> str:
    """The file of the runs table a run's row is read from (for a refusal: lists the folder again)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        listing = list_table(fs, base, "runs")
    if run_id in listing.per_run:
        return listing.per_run[run_id].path
    for _, info in listing.parts.get(run_id, []):
        return info.path
    return next((c.path for c in listing.compacted if run_id in run_ids(fs, c.path)), f"{base}/runs")


def run_statuses(path: str | Path) -> dict[str, str]:
    """run_id -> status of every run in a results folder (per-run and compacted files); {} if none.
    The runs table's files are checked as :func:`load` checks them."""
    fs, base = filesystem(path)
    t = read_arrow(fs, base, "runs", columns=["run_id", "status"])
    return dict(zip(t.column("run_id").to_pylist(), t.column("status").to_pylist()))
