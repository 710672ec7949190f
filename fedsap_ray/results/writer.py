"""Writing one run's rows: :class:`RunWriter` adds each round's rows as new part files (append-only:
a round's write cost does not grow with the round number) and merges them into the run's per-run
files when the run ends (:func:`consolidate_run`); and the helpers that find, delete or clean up a
run's files (``--overwrite``, resume)."""
from __future__ import annotations

import json
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from fedsap_ray.persist.atomic import atomic_write
from fedsap_ray.persist.outdir import OutDir
from fedsap_ray.results.schema import DATA_TABLES, SCHEMA_VERSION, TABLES, to_table
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.results.store import (FINAL_STATUSES, PART_SEP, UPTO_KEY, atomic_output, check_run_id, dataset,
                                      filesystem, list_table, raise_unreadable, part_name, run_files_in, run_ids,
                                      write_batches)


def run_files(out: Path, run_id: str) -> list[Path]:
    """The run's per-run files and parts that exist under the local folder ``out`` (every table), as real
    paths, each checked by :class:`~fedsap_ray.persist.outdir.OutDir` (a link or a wrong kind is refused)."""
    d = OutDir(out)
    found = []
    for t in TABLES:
        if d.is_file(d.abs / t / f"{run_id}.parquet"):
            found.append(d.check(d.abs / t / f"{run_id}.parquet"))
        found.extend(d.glob(d.abs / t, f"{run_id}{PART_SEP}*.parquet"))
    return found


def in_compacted(out: Path, run_id: str) -> bool:
    """True when a compacted ``runs`` file in the local folder ``out`` holds the run."""
    fs, base = filesystem(Path(out))
    return any(run_id in run_ids(fs, c.path) for c in list_table(fs, base, "runs").compacted)


def remove_run(out: str | Path, run_id: str) -> int:
    """Delete every row of run ``run_id`` from the results folder ``out`` (a local folder, or a URI given as a
    string: per-run files and parts, and its rows in compacted files, which are rewritten without them) and the
    models it kept (``models/<run_id>/``: they belong to the rows); return the files changed."""
    from fedsap_ray.results.kept import FOLDER, KEPT_NAMES

    fs, base = filesystem(out)
    changed = 0
    for table in TABLES:
        listing = list_table(fs, base, table)
        if run_id in listing.per_run:
            fs.delete_file(listing.per_run[run_id].path)
            changed += 1
        for _, info in listing.parts.get(run_id, []):
            fs.delete_file(info.path)
            changed += 1
    models = f"{base}/{FOLDER}/{check_run_id(run_id)}"
    for info in fs.get_file_info([f"{models}/{name}" for name in KEPT_NAMES]):
        if info.type == pafs.FileType.File:
            fs.delete_file(info.path)
            changed += 1
    return changed + drop_compacted(out, run_id)


def drop_compacted(out: str | Path, run_id: str) -> int:
    """Remove run ``run_id``'s rows from the compacted files of ``out`` (a local folder, or a URI given as a
    string; each file rewritten atomically, or deleted when it held only that run); return the files changed."""
    fs, base = filesystem(out)
    changed = 0
    for table in TABLES:
        for c in list_table(fs, base, table).compacted:
            ids = run_ids(fs, c.path)
            if run_id not in ids:
                continue
            if ids == {run_id}:
                fs.delete_file(c.path)
            else:
                rest = dataset(fs, [c.path], table).to_batches(filter=pc.field("run_id") != run_id)
                write_batches(fs, c.path, table, rest)
            changed += 1
    return changed


def remove_temp_files(out: Path, run_id: str) -> list[Path]:
    """Delete the temporary files a killed writer of this run left (``.<run_id>.parquet.*.tmp``, and
    ``.<run_id>@r<round>.parquet.*.tmp`` of its parts).

    Only call it while holding the run's claim (no live writer of the run can own them).
    """
    d = OutDir(out)
    gone = []
    for t in TABLES:
        for pattern in (f".{run_id}.parquet.*.tmp", f".{run_id}{PART_SEP}*.parquet.*.tmp"):
            for f in d.glob(d.abs / t, pattern):
                d.unlink(f)
                gone.append(f)
    return gone


def write_atomic(table: pa.Table, path: Path, out: OutDir | None = None) -> None:
    """Write ``table`` to ``path`` whole or not at all (:func:`fedsap_ray.persist.atomic.atomic_write`), through
    ``out``'s checks when the file is in a results folder."""
    with (out.atomic_write(path) if out is not None else atomic_write(path)) as f:
        pq.write_table(table, f)


class RowsLost(ConfigError):
    """Files a run wrote are gone from its results folder while it runs (exit 2: the run stops there)."""


class RunWriter:
    """One run's writer: every flush adds the round's rows as new part files (append-only).

    A round's write touches only that round's parts and the one-row ``runs`` file, so its cost
    does not grow with the round number; a final status (:meth:`set_run` with one of
    :data:`FINAL_STATUSES`) merges the parts into ``<run_id>.parquet`` (:func:`consolidate_run`).
    Rows are not kept in memory beyond the round being written.

    Before each round's write it checks that every file it wrote (and has not merged away since) is still
    there (:meth:`check_kept`: one ``lstat`` each, nothing read), so a run whose folder was deleted or
    emptied under it stops with :class:`RowsLost` instead of recreating the folder and ending ``finished``
    with only its later rounds. After that it writes nothing more into the folder but, when its own
    ``runs`` file is still there, the final status.
    """

    def __init__(self, out: Path, run_id: str) -> None:
        self.out = Path(out)
        self.dir = OutDir(out)
        self.run_id = check_run_id(run_id)
        self.run_row: dict[str, Any] | None = None
        self.pending: dict[str, list[dict[str, Any]]] = {t: [] for t in DATA_TABLES}
        self.tables: set[str] = set()  # per-round tables the run has rows in
        self._last: dict[str, tuple[int, list[dict[str, Any]]]] = {}  # table -> (round, rows) of its newest part
        # table -> {round: rows written}: what a checkpoint records, so a resume can tell a lost part
        self.counts: dict[str, dict[int, int]] = {}
        self._kept: set[Path] = set()  # real paths of the files this run wrote and still holds (check_kept)
        self.lost: str | None = None  # why the run stopped writing (RowsLost), once check_kept found a file gone

    def tables_written(self) -> list[str]:
        """The per-round tables this run has rows in (and so files for, after a flush)."""
        return [t for t in DATA_TABLES if t in self.tables or self.pending[t]]

    def rows_written(self) -> dict[str, int]:
        """Rows this run has written so far, per per-round table (what ``runs.rows_written`` records)."""
        return {t: sum(c.values()) for t, c in sorted(self.counts.items()) if c}

    def set_run(self, row: dict[str, Any]) -> None:
        """Write the run's ``runs`` row; a final status also merges its parts (:meth:`consolidate`). After
        :class:`RowsLost` only a final status is written, and only into the run's own ``runs`` file."""
        self.run_row = {"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **row}
        final = row.get("status") in FINAL_STATUSES
        if self.lost is not None:
            runs_file = self.out / "runs" / f"{self.run_id}.parquet"
            if final and _is_file(self.dir.check(runs_file)):
                self._write_runs()
            return
        runs_file = self.dir.check(self.out / "runs" / f"{self.run_id}.parquet")
        self.check_kept([runs_file] if runs_file in self._kept else [])  # the round's flush checked the others
        self._write_runs()
        if final:
            self.consolidate()

    def add(self, table: str, rows: list[dict[str, Any]]) -> None:
        self.pending[table].extend({"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **r} for r in rows)

    def restore(self, upto_round: int) -> dict[str, Any] | None:
        """Prepare to resume after round ``upto_round``: drop the run's rows of later rounds (parts and
        per-run rows written after the checkpoint), merge the rest into its per-run files, and return
        its old runs row."""
        fs, base = filesystem(self.out)
        self.tables = set(consolidate_run(fs, base, self.run_id, upto_round=upto_round))
        self.counts = row_counts(self.out, self.run_id)
        for t in self.tables:  # the rows before the checkpoint: this run's from now on
            self._keep(self.out / t / f"{self.run_id}.parquet")
        return self.previous_row()

    def previous_row(self) -> dict[str, Any] | None:
        """The run's ``runs`` row as the folder holds it (None: no per-run file); reads only."""
        f = self.out / "runs" / f"{self.run_id}.parquet"
        if not self.dir.is_file(f):
            return None
        with self.dir.open_read(f) as fh:
            old = pq.read_table(fh).to_pylist()
        return old[0] if old else None

    def flush(self) -> None:
        self.check_kept()
        for t in DATA_TABLES:
            rows, self.pending[t] = self.pending[t], []
            by_round: dict[int, list[dict[str, Any]]] = {}
            for r in rows:
                by_round.setdefault(int(r["round"]), []).append(r)
            for rnd, rs in sorted(by_round.items()):
                last = self._last.get(t)
                if last is not None and last[0] == rnd:  # a second flush of the same round: its part grows
                    rs = last[1] + rs
                path = self.out / t / part_name(self.run_id, rnd)
                write_atomic(to_table(t, rs), path, self.dir)
                self._keep(path)
                self._last[t] = (rnd, rs)
                self.counts.setdefault(t, {})[rnd] = len(rs)
                self.tables.add(t)
        if self.run_row is not None:
            self._write_runs()

    def check_kept(self, paths: list[Path] | None = None) -> None:
        """Raise :class:`RowsLost` when a file this run wrote (of ``paths``, default all) is gone (its folder was
        deleted or emptied under the run): one ``lstat`` per file, nothing read (2,000 files: 4.4 ms on this
        project's 2-core machine). Why: writing on would recreate the folder and end the run ``finished``
        without the rows that went with it."""
        if self.lost is not None:
            raise RowsLost(self.lost)
        kept = self._kept if paths is None else paths
        if all(_is_file(p) for p in kept):
            return
        gone = min(p for p in kept if not _is_file(p))
        if not os.path.isdir(self.dir.root):
            what = f"its results folder {self.out} was deleted while it ran"
        else:
            what = f"{self.out / gone.relative_to(self.dir.root)}, which it wrote, is gone"
        self.lost = (f"run {self.run_id}: {what}; the run stops rather than finish without those rows: "
                     f"start it again (--run-id {self.run_id} --overwrite)")
        raise RowsLost(self.lost)

    def _keep(self, path: Path) -> None:
        """Note ``path`` (just written by this run, or its rows taken over on a resume) for :meth:`check_kept`."""
        self._kept.add(self.dir.check(path))

    def consolidate(self) -> list[str]:
        """Merge the run's parts into its per-run files; return the tables it has. Best effort: when it
        fails (e.g. the full disk that ended the run) the parts stay, complete and loadable, and a
        resume or ``fedsap-ray compact`` merges them later."""
        self._last.clear()
        fs, base = filesystem(self.out)
        try:
            have = consolidate_run(fs, base, self.run_id)
        except (OSError, ConfigError) as e:  # ConfigError: a damaged file or a refused entry (fedsap_ray.persist.outdir)
            warnings.warn(f"run {self.run_id}: its per-round parts were not merged ({e}); they stay loadable "
                          "and a resume or `fedsap-ray compact` merges them", stacklevel=2)
            return self.tables_written()
        self._kept = {p for p in self._kept if PART_SEP not in p.name}  # merged away
        for t in have:
            self._keep(self.out / t / f"{self.run_id}.parquet")
        return have

    def _write_runs(self) -> None:
        row = self.run_row and {**self.run_row, "rows_written": json.dumps(self.rows_written(), sort_keys=True)}
        path = self.out / "runs" / f"{self.run_id}.parquet"
        write_atomic(to_table("runs", [row] if row else []), path, self.dir)
        self._keep(path)


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def consolidate_run(fs: pafs.FileSystem, base: str, run_id: str, upto_round: int | None = None) -> list[str]:
    """Merge run ``run_id``'s part files into its per-run file, table by table; return the per-round
    tables that hold rows of the run afterwards.

    ``upto_round`` (a resume from that round's checkpoint): rows of later rounds are dropped, from
    parts and from the per-run file. Safe to interrupt: the parts beyond ``upto_round`` go first,
    then the per-run file is written atomically with metadata ``fedsap_ray.upto_round`` (readers
    skip the parts it holds), then the parts are deleted.
    """
    have = []
    for table in DATA_TABLES:
        whole, upto, parts = run_files_in(fs, base, table, run_id)
        if upto_round is not None:
            for rnd, info in parts:
                if rnd > upto_round:
                    fs.delete_file(info.path)
            parts = [(r, i) for r, i in parts if r <= upto_round]
        live = [(r, i) for r, i in parts if r > upto]
        if upto_round is None and not parts:
            if whole is not None:
                have.append(table)
            continue
        paths = ([whole.path] if whole is not None else []) + [i.path for _, i in live]
        target = f"{base}/{table}/{run_id}.parquet"
        new_upto = upto_round if upto_round is not None else max(
            [0 if upto == float("inf") else int(upto)] + [r for r, _ in live])
        if paths:
            try:
                data = dataset(fs, paths, table).to_table()
            except (OSError, pa.ArrowException) as e:  # a damaged part or per-run file: named; nothing deleted yet
                raise_unreadable(fs, paths, table, e)
            if upto_round is not None:
                data = data.filter(pc.field("round") <= upto_round)
            if data.num_rows:
                with atomic_output(fs, target) as sink:
                    pq.write_table(data.replace_schema_metadata({UPTO_KEY: str(new_upto).encode()}), sink)
                have.append(table)
            elif whole is not None:
                fs.delete_file(whole.path)
        for _, info in parts:
            fs.delete_file(info.path)
    return have


def row_counts(out: Path, run_id: str, tables: tuple[str, ...] = DATA_TABLES) -> dict[str, dict[int, int]]:
    """table -> {round: rows} of run ``run_id`` in the local folder ``out`` (its per-run file and parts, each
    row once: the parts its per-run file holds are skipped as readers skip them)."""
    fs, base = filesystem(Path(out))
    counts: dict[str, dict[int, int]] = {}
    for table in tables:
        whole, upto, parts = run_files_in(fs, base, table, run_id)
        paths = ([whole.path] if whole is not None else []) + [i.path for r, i in parts if r > upto]
        if not paths:
            continue
        rounds = dataset(fs, paths, table).to_table(columns=["round"]).column("round")
        vc = pc.value_counts(rounds)
        counts[table] = {int(v["values"]): int(v["counts"]) for v in vc.to_pylist()}
    return counts
