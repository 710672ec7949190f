"""Writing one run's rows: :class:`RunWriter` rewrites its files atomically after every round,
and the helpers that find, delete or clean up a run's files (``--overwrite``, resume)."""
from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fedsap_ray.atomic import atomic_write
from fedsap_ray.results.schema import DATA_TABLES, SCHEMA_VERSION, TABLES, to_table
from fedsap_ray.results.store import check_run_id, dataset, filesystem, list_table, run_ids, write_batches


def run_files(out: Path, run_id: str) -> list[Path]:
    """The run's per-run files that exist under the local folder ``out`` (every table)."""
    return [f for t in TABLES if (f := Path(out) / t / f"{run_id}.parquet").is_file()]


def in_compacted(out: Path, run_id: str) -> bool:
    """True when a compacted ``runs`` file in the local folder ``out`` holds the run."""
    fs, base = filesystem(Path(out))
    return any(run_id in run_ids(fs, c.path) for c in list_table(fs, base, "runs").compacted)


def remove_run(out: Path, run_id: str) -> int:
    """Delete every row of run ``run_id`` from the local folder ``out`` (per-run files, and its
    rows in compacted files, which are rewritten without them); return the files changed.

    Used by ``--overwrite``: a new run under an old id must not inherit a table the new
    run does not write (e.g. the old run's ``layers``).
    """
    fs, base = filesystem(Path(out))
    changed = 0
    for table in TABLES:
        listing = list_table(fs, base, table)
        if run_id in listing.per_run:
            fs.delete_file(listing.per_run[run_id].path)
            changed += 1
        for c in listing.compacted:
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
    """Delete the temporary files a killed writer of this run left (``.<run_id>.parquet.*.tmp``).

    Only call it while holding the run's claim (no live writer of the run can own them).
    """
    gone = []
    for t in TABLES:
        for f in (Path(out) / t).glob(f".{glob.escape(run_id)}.parquet.*.tmp"):
            f.unlink(missing_ok=True)
            gone.append(f)
    return gone


def write_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` whole or not at all (:func:`fedsap_ray.atomic.atomic_write`)."""
    with atomic_write(path) as f:
        pq.write_table(table, f)


class RunWriter:
    """Accumulates one run's rows and rewrites its files atomically on every flush."""

    def __init__(self, out: Path, run_id: str) -> None:
        self.out = Path(out)
        self.run_id = check_run_id(run_id)
        self.rows: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}

    def tables_written(self) -> list[str]:
        """The per-round tables this run has rows in (and so files for, after a flush)."""
        return [t for t in DATA_TABLES if self.rows[t]]

    def set_run(self, row: dict[str, Any]) -> None:
        self.rows["runs"] = [{"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **row}]
        self._write("runs")

    def add(self, table: str, rows: list[dict[str, Any]]) -> None:
        self.rows[table].extend({"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **r} for r in rows)

    def restore(self, upto_round: int) -> dict[str, Any] | None:
        """Reload this run's rows from disk (rounds <= ``upto_round``) to resume it; return its old runs row."""
        for table in DATA_TABLES:
            f = self.out / table / f"{self.run_id}.parquet"
            rows = pq.read_table(f).to_pylist() if f.is_file() else []
            self.rows[table] = [r for r in rows if r["round"] <= upto_round]
        f = self.out / "runs" / f"{self.run_id}.parquet"
        old = pq.read_table(f).to_pylist() if f.is_file() else []
        return old[0] if old else None

    def flush(self) -> None:
        for t in (*DATA_TABLES, "runs"):
            self._write(t)

    def _write(self, table: str) -> None:
        if self.rows[table] or table == "runs":
            write_atomic(to_table(table, self.rows[table]), self.out / table / f"{self.run_id}.parquet")

