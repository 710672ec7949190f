"""Where a sweep's results go: a local folder, or any pyarrow filesystem URI (``s3://``...).

A run always writes its per-run Parquet files and checkpoint to a local folder
(:class:`~fedsap_ray.results.RunWriter` and :mod:`fedsap_ray.persist.checkpoint` stay plain
local-file code: each round adds its part files). For a remote ``--out`` that local folder is a
node-local staging directory, and :meth:`ResultsDestination.push` copies the run's files
to the destination after each round, so trials on every node of a cluster land in one
place; :meth:`ResultsDestination.pull` brings a run's files to whichever node resumes it.
Readers (:func:`fedsap_ray.results.load`) read the destination URI directly.

``file://`` URIs take the remote path too (with the local filesystem behind it), so that
path is testable without an object store. No Ray here (docs/architecture.md#layout).
"""
from __future__ import annotations

import glob
import hashlib
import shutil
from pathlib import Path

import pyarrow.fs as pafs

from fedsap_ray import results
from fedsap_ray.persist import checkpoint
from fedsap_ray.results import kept
from fedsap_ray.persist.atomic import atomic_write

_COPY_CHUNK = 1 << 20


class ResultsDestination:
    """A sweep's results location (``uri``) and the local folder a run on this node writes to (``local``)."""

    def __init__(self, out: str | Path, staging_root: Path | None = None) -> None:
        self.uri: str = str(out)
        self.is_remote: bool = results.is_uri(out)
        self._pushed: dict[str, tuple[int, int]] = {}  # rel path -> (mtime_ns, size) last pushed
        if not self.is_remote:
            self.fs: pafs.FileSystem | None = None
            self.base: str | None = None
            self.local: Path = Path(out)
            return
        self.fs, self.base = results.filesystem(self.uri)  # ValueError naming the URI if pyarrow rejects it
        if staging_root is None:
            from fedsap_ray.data.status import cache_home  # lazy: the data package imports torch

            staging_root = cache_home() / "staging"
        key = hashlib.sha256(self.uri.rstrip("/").encode()).hexdigest()[:16]
        self.local = Path(staging_root) / key

    def __repr__(self) -> str:
        return f"ResultsDestination(uri={self.uri!r}, local={str(self.local)!r}, is_remote={self.is_remote})"

    @staticmethod
    def _files(run_id: str) -> list[str]:
        """The run's files relative to an output folder: one per table, the checkpoint and the kept models."""
        results.check_run_id(run_id)  # a ConfigError (ValueError) naming it: no path separators, no '..'
        return ([f"{t}/{run_id}.parquet" for t in results.TABLES] + [f"checkpoints/{run_id}{checkpoint.SUFFIX}"]
                + [f"{kept.FOLDER}/{run_id}/{name}" for name in kept.KEPT_NAMES])

    def _local_parts(self, run_id: str) -> list[str]:
        """The run's part files (rounds not merged yet) in ``local``, relative to it."""
        return [f"{t}/{f.name}" for t in results.DATA_TABLES
                for f in sorted((self.local / t).glob(f"{glob.escape(run_id)}{results.PART_SEP}*.parquet"))]

    def _remote_parts(self, run_id: str) -> list[str]:
        """The run's part files at the destination, relative to it."""
        assert self.fs is not None and self.base is not None  # only called when is_remote
        rels: list[str] = []
        for t in results.DATA_TABLES:
            _, _, parts = results.run_files_in(self.fs, self.base, t, run_id)
            rels.extend(f"{t}/{info.base_name}" for _, info in parts)
        return rels

    def pull(self, run_id: str) -> None:
        """Make ``local`` hold exactly the destination's files of this run (before resuming it here).

        A local file the destination lacks (left by an older attempt on this node) is
        removed, so a resume never mixes two attempts. No-op for local paths.
        """
        rels = self._files(run_id)
        if not self.is_remote:
            return
        assert self.fs is not None  # set whenever is_remote
        remote_parts = self._remote_parts(run_id)
        for rel in self._local_parts(run_id):
            if rel not in remote_parts:
                (self.local / rel).unlink(missing_ok=True)
        rels += remote_parts
        infos = self.fs.get_file_info([f"{self.base}/{rel}" for rel in rels])
        for rel, info in zip(rels, infos):
            dst = self.local / rel
            if info.type != pafs.FileType.File:
                dst.unlink(missing_ok=True)
                continue
            with self.fs.open_input_stream(info.path, compression=None) as src, atomic_write(dst) as f:
                while chunk := src.read(_COPY_CHUNK):
                    f.write(chunk)
            st = dst.stat()
            self._pushed[rel] = (st.st_mtime_ns, st.st_size)  # identical to the destination's copy

    def push(self, run_id: str) -> None:
        """Copy the run's files from ``local`` to the destination; no-op for local paths.

        Each file appears whole or not at all (:func:`fedsap_ray.results.atomic_output`);
        files unchanged since the last push are skipped. A checkpoint gone locally (the run
        finished) is deleted at the destination, so it is not resumed there.
        """
        rels = self._files(run_id)
        if not self.is_remote:
            return
        assert self.fs is not None  # set whenever is_remote
        rels += self._local_parts(run_id)
        for rel in rels:
            src = self.local / rel
            dst = f"{self.base}/{rel}"
            try:
                st = src.stat()
            except FileNotFoundError:
                if rel.startswith("checkpoints/"):
                    if self.fs.get_file_info(dst).type == pafs.FileType.File:
                        self.fs.delete_file(dst)
                    self._pushed.pop(rel, None)
                continue
            stamp = (st.st_mtime_ns, st.st_size)
            if self._pushed.get(rel) == stamp:
                continue
            with open(src, "rb") as f, results.atomic_output(self.fs, dst) as out:
                shutil.copyfileobj(f, out, _COPY_CHUNK)
            self._pushed[rel] = stamp
        # parts merged locally (the run ended): gone at the destination too, after the per-run files above
        prefix = f"{run_id}{results.PART_SEP}"
        for rel in [r for r in self._pushed if r.split("/", 1)[-1].startswith(prefix) and r not in rels]:
            dst = f"{self.base}/{rel}"
            if self.fs.get_file_info(dst).type == pafs.FileType.File:
                self.fs.delete_file(dst)
            self._pushed.pop(rel, None)

    def statuses(self) -> dict[str, str]:
        """run_id -> ``runs`` status at the destination (per-run and compacted files)."""
        return results.run_statuses(self.uri if self.is_remote else self.local)
