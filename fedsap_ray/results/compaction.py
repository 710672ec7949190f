"""Compaction: the per-run files of final runs merged into one file per table (``fedsap-ray compact``)."""
from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from fedsap_ray.persist import checkpoint
from fedsap_ray.persist.outdir import OutDir, lock_path
from fedsap_ray.results.reader import check_folder, run_statuses
from fedsap_ray.results.schema import DATA_TABLES
from fedsap_ray.results.store import (COMPACTED_PREFIX, FINAL_STATUSES, check_tree, dataset, filesystem, is_dir, is_uri,
                                      list_table, raise_unreadable, readahead, run_ids, write_batches)
from fedsap_ray.results.writer import consolidate_run


def _checkpointed(fs: pafs.FileSystem, base: str) -> set[str]:
    infos = fs.get_file_info(pafs.FileSelector(f"{base}/checkpoints", allow_not_found=True))
    return checkpoint.run_ids_in([i.base_name for i in infos if i.type == pafs.FileType.File])


def _ending(path: str | Path, run_id: str) -> bool:
    """Whether a process holds run ``run_id``'s claim in the local folder ``path`` (False for URIs: no locks there)."""
    if is_uri(path):
        return False
    return OutDir(path).lock_holder(lock_path(path, run_id)) is not None


def _unchanged(fs: pafs.FileSystem, info: pafs.FileInfo) -> bool:
    now = fs.get_file_info(info.path)
    return now.type == pafs.FileType.File and now.mtime == info.mtime and now.size == info.size


def _differing(fs: pafs.FileSystem, table: str, leftover: dict[str, pafs.FileInfo], compacted: list[str]
               ) -> dict[str, pafs.FileInfo]:
    """The runs of ``leftover`` (per-run files older than a compacted file holding their run) whose rows there are
    not their per-run file's: readers give the per-run file's rows, so compaction keeps those (a compacted file
    copied or edited after the compaction it came from), as it does a re-run's. One filtered read of the
    compacted rows and one of the per-run files, each only on this path (an interrupted compaction)."""
    if not leftover:
        return {}
    paths = [i.path for i in leftover.values()]
    try:
        mine = dataset(fs, paths, table).to_table().to_pandas()
        theirs = dataset(fs, compacted, table).to_table(filter=pc.field("run_id").isin(sorted(leftover))).to_pandas()
    except (OSError, pa.ArrowException) as e:
        raise_unreadable(fs, [*paths, *compacted], table, e)
    a, b = (dict(tuple(df.groupby("run_id", sort=False))) for df in (mine, theirs))
    return {r: info for r, info in leftover.items()
            if r not in a or r not in b or not a[r].reset_index(drop=True).equals(b[r].reset_index(drop=True))}


def compact(path: str | Path) -> dict[str, int]:
    """Merge the per-run files of final runs into one ``compacted-<uuid8>.parquet`` per table.

    Thousands of tiny per-run files make every listing and scan slow (worst on object
    stores); one file per table loads in one read. A run is compacted when its ``runs``
    status is final (:data:`FINAL_STATUSES`) and it has no checkpoint left (an interrupted
    or failed run that still has one can be resumed, and resuming reads its per-run files).
    Running runs are never touched. A final run whose per-round parts were not merged (killed while
    ending) has them merged into its per-run files first (:func:`consolidate_run`).

    Safe to interrupt at any moment: the compacted file is written atomically before any
    per-run file is deleted, and readers let a run's per-run file win over compacted rows,
    so every row is read exactly once; running ``compact`` again finishes the job (per-run
    files older than the compacted file that holds their run, with the same rows, are deleted;
    newer ones, from a re-run under the same id, and ones whose rows differ from the compacted
    ones, replace the run's compacted rows: readers give the per-run file's rows, so compaction
    keeps them). A per-run file that changed while compacting is kept. Every table is checked
    as :func:`~fedsap_ray.results.load` checks it before anything changes (a refusal names the
    file, :class:`~fedsap_ray.results.store.UnreadableFile`). Returns counts: ``runs_compacted``, ``files_written``,
    ``files_rewritten`` (older compacted files that lost a re-run run), ``files_removed``
    and ``runs_kept`` (runs with per-run files left because they are running or resumable).
    """
    fs, base = filesystem(path)
    if not is_dir(fs, base):
        raise FileNotFoundError(f"no results folder at {path}")
    check_tree(fs, base, str(path), (*DATA_TABLES, "runs", "checkpoints"))  # refused before anything changes
    statuses = run_statuses(path)
    # every file's rows checked as results.load checks them (a copy under another run's name, a row twice, a newer
    # schema, a column missing or of another type), before anything changes: compacted, a hostile file's rows
    # would lose the name that tells them apart
    check_folder(fs, base)
    resumable = _checkpointed(fs, base)
    # a finished run keeps no checkpoint: one left means the run was stopped between writing its final
    # status and removing it (while merging its parts); it can never be resumed, so it goes here (unless
    # the run's process is still ending right now: its lock is held)
    for r in sorted(r for r in resumable if statuses.get(r) == "finished" and not _ending(path, r)):
        fs.delete_file(f"{base}/checkpoints/{r}{checkpoint.SUFFIX}")
        resumable.discard(r)
    final = {r for r, s in statuses.items() if s in FINAL_STATUSES and r not in resumable}
    done: set[str] = set()
    kept: set[str] = set()
    written = rewritten = removed = 0
    with_parts: set[str] = set().union(*(list_table(fs, base, t).parts for t in DATA_TABLES))
    for r in sorted(with_parts & final):
        consolidate_run(fs, base, r)
    kept |= with_parts - final
    # Phase 1 writes every table's new compacted file and deletes nothing: a file that cannot be read stops
    # compaction here, the new files are removed, and the folder is as it was (one line naming the file).
    planned: list[tuple[str, dict, dict, dict]] = []  # (table, todo, fresh, ids of the older compacted files)
    new_files: list[str] = []
    try:
        for table in (*DATA_TABLES, "runs"):
            listing = list_table(fs, base, table)
            kept |= {r for r in listing.per_run if r not in final}
            todo = {r: i for r, i in listing.per_run.items() if r in final}
            if not todo:
                continue
            ids = {c.path: run_ids(fs, c.path) for c in listing.compacted}
            fresh, leftover = {}, {}
            for r, info in todo.items():
                covering = [c for c in listing.compacted if r in ids[c.path]]
                # a leftover of an interrupted compaction is older than the file holding its rows
                if not covering or any(info.mtime >= c.mtime for c in covering):
                    fresh[r] = info
                else:
                    leftover[r] = info
            fresh.update(_differing(fs, table, leftover, [c.path for c in listing.compacted
                                                          if ids[c.path] & leftover.keys()]))
            if fresh:
                new = f"{base}/{table}/{COMPACTED_PREFIX}{uuid.uuid4().hex[:8]}.parquet"
                paths = sorted(i.path for i in fresh.values())
                try:
                    write_batches(fs, new, table, dataset(fs, paths, table).to_batches(fragment_readahead=readahead(fs)))
                except (OSError, pa.ArrowException) as e:  # a damaged file: named
                    raise_unreadable(fs, paths, table, e)
                new_files.append(new)
                written += 1
            planned.append((table, todo, fresh, ids))
    except BaseException:
        for f in new_files:
            fs.delete_file(f)
        raise
    # Phase 2 (runs last: until then a status is still found per run): superseded rows and per-run files go
    for table, todo, fresh, ids in planned:
        for older, held in ids.items():  # drop superseded rows of re-run runs from older compacted files
            drop = held & fresh.keys()
            if not drop:
                continue
            rest = dataset(fs, [older], table).to_batches(filter=~pc.field("run_id").isin(sorted(drop)))
            if drop == held:
                fs.delete_file(older)
            else:
                write_batches(fs, older, table, rest)
            rewritten += 1
        for r, info in todo.items():
            if _unchanged(fs, info):
                fs.delete_file(info.path)
                removed += 1
                done.add(r)
            else:
                kept.add(r)
    return {"runs_compacted": len(done - kept), "files_written": written, "files_rewritten": rewritten,
            "files_removed": removed, "runs_kept": len(kept)}
