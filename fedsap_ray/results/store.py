"""Where results live: local folders or URIs, the table listings, run ids and atomic output streams.

A table folder holds one file per run (``<run_id>.parquet``), the per-round parts of runs in
progress (``<run_id>@r<round:06d>.parquet``, merged into the run's file when it ends:
:func:`fedsap_ray.results.writer.consolidate_run`) and compacted files
(``compacted-<uuid8>.parquet``, :mod:`fedsap_ray.results.compaction`); names starting with
``.`` (temporary) or ``_`` are never results. A per-run file's schema metadata
``fedsap_ray.upto_round`` says up to which round it already holds its run's parts: readers skip
those, so a merge interrupted before it deleted the parts still gives every row once. On object stores a single PUT is atomic; on
other filesystems a file appears by rename once complete.
"""
from __future__ import annotations

import contextlib
import re
import typing
import uuid
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.persist.outdir import LOCAL_TYPE, OutDir
from fedsap_ray.results.schema import CORE_TABLES, KEY_COLUMNS, TABLES, schema

# ----------------------------------------------------------------------------- run ids

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]{0,127}")
RUN_ID_RULE = ("1 to 128 characters from A-Z a-z 0-9 . _ = -, starting with a letter or digit, "
               "without '..' and not starting with 'compacted-'")


def check_run_id(run_id: Any, field: str = "run_id") -> str:
    """``run_id`` if it is safe as a file name in every table folder, else a ConfigError naming ``field``.

    A run id becomes ``OUT/<table>/<run_id>.parquet``: a path separator or ``..`` would
    write outside the table folder (``../x`` put every table on one file), and a
    ``compacted-`` prefix would be read as a compacted file.
    """
    if (not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id) or ".." in run_id
            or run_id.startswith(COMPACTED_PREFIX)):
        raise ConfigError(f"invalid {field}={run_id!r}: a run id is {RUN_ID_RULE}")
    return run_id


# ----------------------------------------------------------------------------- where the results are

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_OBJECT_STORES = frozenset({"s3", "gcs", "abfs"})  # a single PUT is atomic there; rename is a copy
FINAL_STATUSES = ("finished", "failed", "stopped", "interrupted")  # a run with these writes no more rows
COMPACTED_PREFIX = "compacted-"  # OUT/<table>/compacted-<uuid8>.parquet: rows of many final runs
_ROW_GROUP = 1 << 17


def is_uri(path: str | Path) -> bool:
    """True for a string with a scheme (``s3://``, ``file://``...); a :class:`Path` is always local."""
    return isinstance(path, str) and bool(_URI.match(path))


def filesystem(path: str | Path) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local folder or a URI ``FileSystem.from_uri`` accepts.

    A local folder (a path or ``file://``) gets :meth:`fedsap_ray.persist.outdir.OutDir.filesystem`: every call
    refuses a link inside the folder, a path outside it and an entry of the wrong kind."""
    if not is_uri(path):
        return OutDir(path).filesystem(), Path(path).absolute().as_posix()
    try:
        fs, inner = pafs.FileSystem.from_uri(str(path))
    except (ValueError, NotImplementedError, OSError) as e:
        raise ValueError(f"invalid results location {str(path)!r}: {e}; use a local path or a URI that "
                         "pyarrow.fs.FileSystem.from_uri accepts (file://, s3://, gs://, hdfs://, abfs://)") from e
    inner = inner.rstrip("/") or inner
    if fs.type_name == "local":  # file://: the same checked door as a plain path (fedsap_ray.persist.outdir)
        return OutDir(inner, field=str(path)).filesystem(), inner
    return fs, inner


def is_dir(fs: pafs.FileSystem, base: str) -> bool:
    return fs.get_file_info(base).type == pafs.FileType.Directory


PART_SEP = "@r"  # OUT/<table>/<run_id>@r000123.parquet: '@' is outside the run id alphabet
UPTO_KEY = b"fedsap_ray.upto_round"  # a per-run file's metadata: it holds every part up to this round


def part_name(run_id: str, rnd: int) -> str:
    """The file name of round ``rnd``'s part of run ``run_id`` (zero-padded: parts sort by round)."""
    return f"{run_id}{PART_SEP}{int(rnd):06d}.parquet"


def parse_part(stem: str) -> tuple[str, int] | None:
    """(run_id, round) of a part file's stem, or None when the stem is a run id."""
    if PART_SEP not in stem:
        return None
    run_id, _, rnd = stem.rpartition(PART_SEP)
    return (run_id, int(rnd)) if rnd.isdigit() else None


def upto_round(meta: dict[bytes, bytes] | None) -> float:
    """The round up to which a per-run file holds its run's parts (its metadata); a file without
    the key (written before parts existed, or by :func:`compact`) holds all of them."""
    v = (meta or {}).get(UPTO_KEY)
    return float(int(v)) if v is not None else float("inf")


@dataclass
class Listing:
    per_run: dict[str, pafs.FileInfo]  # run_id (file stem) -> its file
    compacted: list[pafs.FileInfo]
    # run_id -> [(round, part)] sorted by round, of runs in progress (or ended and not merged yet)
    parts: dict[str, list[tuple[int, pafs.FileInfo]]] = field(default_factory=dict)
    upto: dict[str, float] = field(default_factory=dict)  # run_id -> upto_round of its per-run file

    def live_parts(self) -> dict[str, list[tuple[int, pafs.FileInfo]]]:
        """Each run's parts its per-run file does not hold yet (round above the file's ``upto_round``)."""
        out = {}
        for r, ps in self.parts.items():
            live = [(rnd, i) for rnd, i in ps if rnd > self.upto.get(r, 0.0)]
            if live:
                out[r] = live
        return out


def foreign_reason(names: list[str], table: str, columns: Mapping[str, set[str]] | None = None) -> str | None:
    """Why a file with columns ``names`` is not a file of ``table`` (None: it is one); ``columns``: each table's
    column names (:data:`~fedsap_ray.results.schema.TABLES`), when the caller has them.

    A file of another table placed in the folder has every key column of that table, which explains
    more of the file's columns (a layers file among the clients has the clients' keys too, but only
    the layers table has all its columns), or it lacks a key column of this table, which explains
    fewer than half of its columns (a runs file among the rounds, a Parquet file of anything else).
    Reading it would give rows that are null in almost every column. A file of this table that lost a
    column is not foreign: the readers refuse it by name. Nor is one with a column outside the schema
    (a newer writer's, a strategy's this process has not registered, one added by hand): the readers
    ignore such a column.
    """
    have = set(names)
    known = columns if columns is not None else {t: {c.name for c in TABLES[t]} for t in TABLES}

    def fit(t: str) -> tuple[float, float]:  # (share of the file's columns the table has, of the table's core it has)
        core = {c.name for c in CORE_TABLES[t]}
        return len(have & known[t]) / max(len(have), 1), len(have & core) / len(core)

    rivals = [t for t in KEY_COLUMNS if t != table and set(KEY_COLUMNS[t]) <= have and fit(t) > fit(table)]
    if rivals:
        other = max(rivals, key=fit)
        return f"is a file of the {other} table (its key columns {', '.join(KEY_COLUMNS[other])}, and more of its columns)"
    missing = [k for k in KEY_COLUMNS[table] if k not in have]
    if missing and fit(table)[0] < 0.5:
        return f"lacks the key column(s) {', '.join(missing)}, and most of its columns are not the table's"
    return None


def _foreign(fs: pafs.FileSystem, info: pafs.FileInfo, table: str, columns: Mapping[str, set[str]]
             ) -> tuple[str | None, float]:
    """(why the file is not one of ``table``, or None; the round up to which it holds its run's parts)."""
    try:
        with fs.open_input_file(info.path) as f:
            sch = pq.read_schema(f)
    except (OSError, pa.ArrowException):
        return None, float("inf")  # unreadable: let the reader report it, naming the file
    return foreign_reason(sch.names, table, columns), upto_round(sch.metadata)


def list_table(fs: pafs.FileSystem, base: str, table: str) -> Listing:
    """The table's Parquet files; names starting with "." (temporary) or "_" are not results.

    A Parquet file of another table placed in the folder is skipped with a warning (see
    :func:`foreign_reason`), never read as rows of this table nor compacted or deleted.
    """
    infos = fs.get_file_info(pafs.FileSelector(f"{base}/{table}", allow_not_found=True))
    per_run: dict[str, pafs.FileInfo] = {}
    compacted: list[pafs.FileInfo] = []
    parts: dict[str, list[tuple[int, pafs.FileInfo]]] = {}
    upto: dict[str, float] = {}
    columns: dict[str, set[str]] = {}  # each table's column names, once a file is opened
    for info in sorted(infos, key=lambda i: i.path):
        name = info.base_name
        if info.type != pafs.FileType.File or name.startswith((".", "_")) or not name.endswith(".parquet"):
            continue
        stem = name[: -len(".parquet")]
        part = None if name.startswith(COMPACTED_PREFIX) else parse_part(stem)
        if part is not None:  # written by this package under its own name: not opened for a schema check
            parts.setdefault(part[0], []).append((part[1], info))
            continue
        columns = columns or {t: {c.name for c in TABLES[t]} for t in TABLES}
        reason, file_upto = _foreign(fs, info, table, columns)
        if reason is not None:
            warnings.warn(f"skipped {info.path}: not a file of the {table} table: it {reason}", stacklevel=3)
            continue
        if name.startswith(COMPACTED_PREFIX):
            compacted.append(info)
        else:
            per_run[stem] = info
            upto[stem] = file_upto
    for ps in parts.values():
        ps.sort(key=lambda p: p[0])
    return Listing(per_run, compacted, parts, upto)


def run_files_in(fs: pafs.FileSystem, base: str, table: str, run_id: str
                 ) -> tuple[pafs.FileInfo | None, float, list[tuple[int, pafs.FileInfo]]]:
    """(per-run file or None, the round up to which it holds parts, [(round, part)] sorted) of one run;
    reads one schema, not the whole folder's (a run ending in a sweep of thousands)."""
    infos = fs.get_file_info(pafs.FileSelector(f"{base}/{table}", allow_not_found=True))
    whole, parts = None, []
    for info in infos:
        name = info.base_name
        if info.type != pafs.FileType.File or not name.endswith(".parquet"):
            continue
        stem = name[: -len(".parquet")]
        if stem == run_id:
            whole = info
        elif (pr := parse_part(stem)) is not None and pr[0] == run_id:
            parts.append((pr[1], info))
    upto = 0.0
    if whole is not None:
        with fs.open_input_file(whole.path) as f:
            upto = upto_round(pq.read_schema(f).metadata)
    return whole, upto, sorted(parts, key=lambda p: p[0])


def run_ids(fs: pafs.FileSystem, path: str) -> set[str]:
    """The run ids a (compacted) file holds rows of; :class:`UnreadableFile` when it has no readable ``run_id``."""
    try:
        with fs.open_input_file(path) as f:
            t = pq.ParquetFile(f).read(columns=["run_id"])
    except (OSError, pa.ArrowException) as e:
        raise UnreadableFile(f"results file {path} cannot be read ({_first_line(e)}); restore it from a copy or "
                             "remove it (its runs' rows in it are lost)") from e
    if "run_id" not in t.column_names:
        raise UnreadableFile(f"results file {path} lacks the column run_id: its rows belong to no run; restore it "
                             "from a copy or remove it")
    return set(pc.unique(t.column("run_id")).to_pylist())


def dataset(fs: pafs.FileSystem, paths: list[str], table: str) -> ds.FileSystemDataset:
    """One dataset over many files; the explicit schema adds columns an older file lacks as nulls."""
    return ds.FileSystemDataset.from_paths(paths, schema=schema(table), format=ds.ParquetFileFormat(),
                                           filesystem=fs)


def sources(fs: pafs.FileSystem, listing: Listing, table: str) -> tuple[list[str], list[tuple[str, set[str]]]]:
    """Files to read whole, and compacted files to read without some runs, so each run is read once.

    A run's per-run file and parts win over compacted rows of the same run (after an interrupted
    :func:`compact` both hold the same rows; after a re-run under the same id the per-run
    file is the newer). Parts the run's per-run file already holds (its ``upto_round``) are skipped;
    the others are read right after it, by round, so a run's rows come in the order they were written.

    A run in two compacted files and in no per-run file is never what :func:`compact` leaves, even
    interrupted (it drops a run's older compacted rows before it deletes the per-run file that wins
    over both meanwhile): it comes from a copied compacted file or two folders merged into one. Rows
    equal in both (a copy) are one run, read once from the first file (by name); different rows are
    two runs under one id, and picking either would be a guess: :class:`UnreadableFile` names both files.
    """
    live = listing.live_parts()
    # (sort key, round, path): files by path as ever, a run's live parts right after its own file
    keyed: list[tuple[str, int, str]] = [(i.path, 0, i.path) for i in listing.per_run.values()]
    for r, ps in live.items():
        home = ps[0][1].path.rsplit("/", 1)[0] + f"/{r}.parquet"
        keyed.extend((home, rnd, i.path) for rnd, i in ps)
    partial: list[tuple[str, set[str]]] = []
    own = set(listing.per_run) | set(live)
    first: dict[str, str] = {}  # run id -> the compacted file its rows are read from
    for c in listing.compacted:
        ids = run_ids(fs, c.path)
        for r in sorted(ids & first.keys()):
            _check_copies(fs, table, r, first[r], c.path)
        skip = ids & (own | first.keys())
        if not skip:
            keyed.append((c.path, 0, c.path))
        elif skip != ids:
            partial.append((c.path, skip))
        first.update({r: c.path for r in ids - own - first.keys()})
    return [p for _, _, p in sorted(keyed)], partial


def _check_copies(fs: pafs.FileSystem, table: str, run_id: str, a: str, b: str) -> None:
    """Run ``run_id``'s rows in the compacted files ``a`` and ``b`` are the same rows (a copied file), or
    :class:`UnreadableFile` naming both (:func:`sources`)."""
    def rows(path: str) -> Any:
        try:
            return dataset(fs, [path], table).to_table(filter=pc.field("run_id") == run_id).to_pandas()
        except (OSError, pa.ArrowException) as e:
            raise_unreadable(fs, [path], table, e)

    if not rows(a).equals(rows(b)):
        raise UnreadableFile(f"results files {a} and {b} both hold run {run_id}, with different rows (two runs under "
                             "one id: folders merged?); remove that run's rows from the one that is not it")


class UnreadableFile(ConfigError):
    """A results file that cannot be read (truncated, damaged): one line naming it (exit 2 from a command)."""


def raise_unreadable(fs: pafs.FileSystem, paths: list[str], table: str, error: BaseException) -> typing.NoReturn:
    """After a read of ``paths`` failed with ``error``: raise :class:`UnreadableFile` naming the first file that
    cannot be read on its own, and the column when one column of it is what fails (a value the schema's type
    cannot hold exactly, e.g. 0.5 in an integer column); only on the failure path: a scan of many files does not
    say which broke it. When each reads (the error was a write's, e.g. a full disk), ``error`` itself."""
    for p in paths:
        try:
            dataset(fs, [p], table).to_table()
        except (OSError, pa.ArrowException) as e:
            raise UnreadableFile(f"results file {p} cannot be read ({_failing_column(fs, p, table) or _first_line(e)}); "
                                 "restore it from a copy or remove it (its run's rows in it are lost)") from error
    raise error


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
    return text[:120] + ("..." if len(text) > 120 else "")


def _failing_column(fs: pafs.FileSystem, path: str, table: str) -> str | None:
    """``column NAME: why`` for the first column of the file at ``path`` that cannot be read alone, or None."""
    try:
        names = next(iter(dataset(fs, [path], table).get_fragments())).physical_schema.names
    except (OSError, pa.ArrowException, StopIteration):
        return None
    for name in (n for n in schema(table).names if n in names):
        try:
            dataset(fs, [path], table).to_table(columns=[name])
        except (OSError, pa.ArrowException) as e:
            return f"column {name}: {_first_line(e)}"
    return None


def check_tree(fs: pafs.FileSystem, base: str, shown: str, folders: tuple[str, ...]) -> None:
    """Before a command changes a results folder: each of ``folders`` (tables, ``checkpoints``) is a folder or
    absent, and every entry in it is one the filesystem will touch (for a local folder, the door refuses a
    link or a special file: :mod:`fedsap_ray.persist.outdir`). One line naming the entry otherwise."""
    for sub in folders:
        info = fs.get_file_info(f"{base}/{sub}")
        if info.type == pafs.FileType.NotFound:
            continue
        if info.type != pafs.FileType.Directory:
            raise ConfigError(f"results folder {shown}: {sub} is a file where a folder is expected; move it away")
        fs.get_file_info(pafs.FileSelector(f"{base}/{sub}"))


def readahead(fs: pafs.FileSystem) -> int:
    """Files read at once: pyarrow's default locally; many on remote stores, where latency dominates."""
    return 4 if fs.type_name in ("local", LOCAL_TYPE) else 64


@contextmanager
def atomic_output(fs: pafs.FileSystem, path: str) -> Iterator[pa.NativeFile]:
    """A stream whose bytes appear at ``path`` only once complete.

    Object stores: written to memory, then one upload (a single PUT is atomic). Other
    filesystems: a temporary file named ``.<name>.<uuid>.tmp`` (readers skip it) moved into
    place.
    """
    parent, name = path.rsplit("/", 1)
    if fs.type_name in _OBJECT_STORES:
        buf = pa.BufferOutputStream()
        yield buf
        data = buf.getvalue()
        with fs.open_output_stream(path, compression=None) as out:
            out.write(data)
        return
    fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with fs.open_output_stream(tmp, compression=None) as out:
            yield out
        fs.move(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.delete_file(tmp)
        raise


def write_batches(fs: pafs.FileSystem, path: str, table: str, batches: Iterator[pa.RecordBatch]) -> int:
    """Stream batches into one Parquet file (row groups of ~128k rows); return the row count."""
    sch, rows = schema(table), 0
    with atomic_output(fs, path) as sink, pq.ParquetWriter(sink, sch) as w:
        buf: list[pa.RecordBatch] = []
        n = 0
        for b in batches:
            buf.append(b)
            n += b.num_rows
            if n >= _ROW_GROUP:
                w.write_table(pa.Table.from_batches(buf).cast(sch))
                rows, buf, n = rows + n, [], 0
        if buf:
            w.write_table(pa.Table.from_batches(buf).cast(sch))
            rows += n
    return rows

