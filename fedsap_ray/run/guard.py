"""What a run checks before it writes anything: its output folder, who owns its run id, the
device, and (for a resume) that everything the run had written is still there.

Each refusal is a :class:`~fedsap_ray.config.ConfigError` (one line naming the option or
field, exit code 2 from the CLI), raised before the first byte of results is written, so
bad input never costs an existing run. No Ray and no torch at import time.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pyarrow.parquet as pq

from fedsap_ray import results
from fedsap_ray.persist import checkpoint, statecheck
from fedsap_ray.persist.outdir import DIR, FILE, OutDir, check_name_lengths, lock_path
from fedsap_ray.results import aside, kept
from fedsap_ray.results.store import check_tree
from fedsap_ray.common.errors import CheckpointUnreadable, ConfigError, DatasetUnavailable
from fedsap_ray.config.checks import clip
from fedsap_ray.config.schema import ExperimentConfig


def check_out(out: Path) -> bool:
    """Make sure ``out`` is a folder this process can create files in; return whether it was created.

    Probes by creating (and removing) an empty file, which also works as root, where
    permission bits do not refuse anything.
    """
    out = Path(out)
    check_name_lengths(out.absolute(), f"--out={clip(str(out), 120)!r}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"invalid --out={str(out)!r}: it is a file, not a folder")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"invalid --out={str(out)!r}: cannot create the folder ({e.strerror or e})") from e
    probe = out / f".write-probe-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
        probe.unlink()
    except OSError as e:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise ConfigError(f"invalid --out={str(out)!r}: the folder is not writable ({e.strerror or e})") from e
    return created


def check_out_writable(out: Path, field: str = "--out") -> None:
    """Without creating anything: ``out`` is a folder, or can be made one, by this process.

    For the sweep drivers, which must refuse before Ray starts (and write nothing on ``--dry-run``):
    the nearest existing folder on the way to ``out`` must be writable and searchable
    (``os.access``, which also reports a read-only filesystem for root).
    """
    out = Path(out)
    check_name_lengths(out.absolute(), f"{field}={clip(str(out), 120)!r}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"invalid {field}={str(out)!r}: it is a file, not a folder")
    probe = out.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"invalid {field}={str(out)!r}: {probe} is a file, so the folder cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "the folder" if probe == out.absolute() else f"{probe}, where it would be created,"
        raise ConfigError(f"invalid {field}={str(out)!r}: {what} is not writable by this process")


def check_device(cfg: ExperimentConfig) -> None:
    """``resources.device=cuda`` on the local backend needs a GPU this process can use."""
    if cfg.resources.device != "cuda" or cfg.resources.backend != "local":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("invalid resources.device='cuda': no CUDA GPU is available to this process "
                          "(torch.cuda.is_available() is False); use auto or cpu")


class RunClaim:
    """Exclusive ownership of (``out``, ``run_id``) while a run writes it.

    An ``flock`` on ``OUT/.<run_id>.lock``: the kernel drops it when the process ends,
    however it ends (a ``kill -9`` leaves no stale claim), and a second process that asks
    for the same run id while the first runs is refused at once. Under the claim,
    leftovers of the run's earlier writers (temporary files) are safe to delete.
    """

    def __init__(self, out: Path, run_id: str, *, field: str = "--run-id") -> None:
        self.out, self.run_id, self.field = Path(out), run_id, field
        self.dir = OutDir(out)
        self.path = lock_path(self.out, run_id)
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = self.dir.open_lock(self.path)  # never through a link: it is truncated below
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise ConfigError(f"invalid {self.field}={self.run_id!r}: another process (pid {holder}) is "
                                      f"running this run in {self.out} right now") from None
                raise
            try:  # the holder before us may have unlinked the file: then lock the new one
                same = os.fstat(fd).st_ino == os.lstat(self.dir.check(self.path)).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
                self._fd = fd
                return
            os.close(fd)

    def holder(self) -> str | None:
        """The pid of the process running this run right now, or None when none is (asks the kernel,
        without creating the lock file and without keeping any lock)."""
        return self.dir.lock_holder(self.path)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.dir.unlink(self.path)  # while still locked: a waiter re-checks the inode (see acquire)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunClaim:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def existing_run(out: Path, run_id: str) -> str | None:
    """What ``out`` holds of run ``run_id`` (e.g. ``"status finished"``, ``"rows in a compacted file"``),
    or None when it holds nothing of it."""
    out = Path(out)
    d = OutDir(out)
    f = out / "runs" / f"{run_id}.parquet"
    if d.is_file(f):
        try:
            with d.open_read(f) as fh:
                return f"status {pq.read_table(fh, columns=['status']).column('status')[0].as_py()}"
        except Exception:  # unreadable: still the run's file
            return "an unreadable runs file"
    if results.run_files(out, run_id) or d.is_file(checkpoint.path_for(out, run_id)) \
            or d.is_file(checkpoint.legacy_path_for(out, run_id)) or kept.kept_models(out, run_id):
        return "some of its files"
    if d.is_dir(out / "runs") and results.in_compacted(out, run_id):
        return "rows in a compacted file"
    return None


def refuse_existing(out: Path, run_id: str, *, overwrite: bool) -> str | None:
    """Refuse a new run under an id ``out`` already holds, unless ``overwrite``; return what it holds."""
    held = existing_run(out, run_id)
    if held is not None and not overwrite:
        raise ConfigError(f"invalid --run-id={run_id!r}: {out} already holds a run with this id ({held}); "
                          "choose another --run-id, continue it with --resume, or pass --overwrite to replace it")
    return held


def check_resumable(out: Path, run_id: str) -> dict[str, Any]:
    """Everything a resume of ``run_id`` needs, readable and consistent, checked before anything is
    deleted: its ``runs`` row (not finished), its checkpoint, the checkpoint's round against the runs row,
    and every table the run had written by the checkpoint's round, round by round (the rows of each
    round the checkpoint counted, in every table). Returns the checkpoint.

    Without this a resume would start from the checkpoint and silently rewrite a missing table from the
    resumed round on, losing the rounds before it. The checkpoint's content against the model and the
    strategy is checked once they are built (:mod:`fedsap_ray.persist.statecheck`, by the session).
    """
    out = Path(out)
    field = f"--resume={run_id!r}"
    row = check_checkpoint_present(out, run_id, running=False)  # under our claim: nobody else runs it
    ck = load_checkpoint(out, run_id, field)
    done = int(ck["state"].round)
    where = f"invalid {field}: checkpoint {checkpoint.path_for(out, run_id)}"
    planned, recorded = row.get("rounds"), row.get("rounds_done")
    if done < 1 or (planned is not None and done > planned):
        raise ConfigError(f"{where} holds round {done}; a checkpoint is written after rounds 1-{planned}{AFRESH}")
    if recorded is not None and done not in (recorded, recorded + 1):  # +1: killed between the two writes
        raise ConfigError(f"{where} holds round {done}, but the runs table says {recorded} rounds were done{AFRESH}")
    check_tables(out, run_id, ck, field)
    return ck


AFRESH = "; restore the file, or start the run afresh (--run-id ID --overwrite)"


def load_checkpoint(out: Path, run_id: str, field: str, hint: str = "") -> dict[str, Any]:
    """The run's checkpoint (:func:`fedsap_ray.persist.checkpoint.load`: its format and content digest checked), or a
    ConfigError naming ``field`` and the file (``hint``: what to do, appended)."""
    try:
        return checkpoint.load(out, run_id)
    except CheckpointUnreadable as e:
        raise ConfigError(f"invalid {field}: {e}{hint}") from e


def check_trial_checkpoint(out: Path, run_id: str, cfg: ExperimentConfig, field: str, afresh: str) -> dict[str, Any]:
    """What a sweep checks of a trial's checkpoint in ``out`` before Ray starts the trial (which then continues
    from it), each refusal one line naming ``field`` and the file and ending with ``afresh``: its format and
    content digest; its round within the trial's rounds; an asynchronous engine's state exactly when the trial
    has ``devices.mode=async``; and the run's tables against it (:func:`check_tables`). What needs the model
    and the strategy built (:mod:`fedsap_ray.persist.statecheck`) is left to the trial, which builds them. Returns it.

    The ``runs`` row's ``rounds_done`` is not compared (unlike :func:`check_resumable`): a trial whose start
    failed once (its data could not be loaded) has a ``failed`` row with no round, beside a good checkpoint."""
    ck = load_checkpoint(out, run_id, field, afresh)
    done = int(ck["state"].round)
    where = f"invalid {field}: checkpoint {checkpoint.path_for(out, run_id)}"
    if not 1 <= done <= cfg.training.rounds:
        raise ConfigError(f"{where} holds round {done}; the trial's checkpoints are written after rounds "
                          f"1-{cfg.training.rounds}{afresh}")
    if (cfg.devices.mode == "async") != ("engine" in ck):
        held = "holds an asynchronous engine's state" if "engine" in ck else "holds no asynchronous engine state"
        raise ConfigError(f"{where} {held}; the trial has devices.mode={cfg.devices.mode}{afresh}")
    check_tables(out, run_id, ck, field, afresh)
    return ck


def check_tables(out: Path, run_id: str, ck: dict[str, Any], field: str, afresh: str = AFRESH) -> None:
    """The run's tables in ``out`` against its checkpoint ``ck``: the checkpoint's table list and row counts
    well formed, every table it had written present and readable, no rows of rounds after it, and the rows
    of each round it counted (a lost, truncated or added part). Each refusal names ``field`` and ends with
    ``afresh`` (what to do)."""
    done = int(ck["state"].round)
    where = f"invalid {field}: checkpoint {checkpoint.path_for(out, run_id)}"
    statecheck.check_rows(ck["tables"], ck.get("rows"), results.DATA_TABLES, done, where)
    # older checkpoints do not list their tables: every run writes a rounds row per round
    expected = ck["tables"] if "tables" in ck else (["rounds"] if done > 0 else [])
    files = results.run_files(out, run_id)
    for g in files:
        try:
            pq.read_schema(g)
        except Exception as e:
            raise ConfigError(f"invalid {field}: {g} is unreadable ({e.__class__.__name__}: "
                              f"{str(e).splitlines()[0][:120] if str(e) else ''}){afresh}") from e
    try:
        counts = results.row_counts(out, run_id)
    except Exception as e:
        raise ConfigError(f"invalid {field}: the run's tables in {out} are unreadable ({e.__class__.__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''}){afresh}") from e
    for table in expected:
        f = out / table / f"{run_id}.parquet"
        if not any(g.parent.name == table for g in files):
            raise ConfigError(f"invalid {field}: {f} is missing (the run had written rounds 1-{done} of its "
                              f"{table} table){afresh}")
        lost = sorted(set(range(1, done + 1)) - set(counts.get(table, {}))) if table == "rounds" else []
        if lost:
            raise ConfigError(f"invalid {field}: {f} lacks rounds {spans(lost)} of the {done} the checkpoint "
                              f"holds{afresh}")
    for table, per in counts.items():
        beyond = sorted(r for r in per if r > done + 1)
        if beyond:
            raise ConfigError(f"{where} holds round {done}, but {out / table} holds rows of round {beyond[-1]}: the "
                              f"checkpoint is older than the tables{afresh}")
    for table, want in (ck.get("rows") or {}).items():
        have = counts.get(table, {})
        for r in range(1, done + 1):
            if have.get(r, 0) != want.get(r, 0):
                raise ConfigError(f"invalid {field}: {out / table} holds {have.get(r, 0)} rows of round {r}, the "
                                  f"checkpoint counted {want.get(r, 0)} (a part was deleted, truncated or added){afresh}")


def check_checkpoint_present(out: Path, run_id: str, *, running: bool = True) -> dict[str, Any]:
    """The first checks of a resume, each a one-line refusal that says what to do: the run exists, has
    not finished, is not running right now (``running``: ask the run's lock for the pid of the process
    that runs it; off under this process's own claim) and has a checkpoint in the current format.
    Returns the run's ``runs`` row."""
    out = Path(out)
    field = f"--resume={run_id!r}"
    runs_file = out / "runs" / f"{run_id}.parquet"
    check_layout(out, run_id)
    if not OutDir(out).is_file(runs_file):
        raise ConfigError(f"invalid {field}: no run with that id in {out}/runs")
    row = _read_first_row(out, runs_file, field)
    if row.get("status") == "finished":
        stale = " (its checkpoint is stale: the run was stopped while it merged its files; `fedsap-ray compact " \
                f"{out}` merges them and removes it)" if OutDir(out).is_file(checkpoint.path_for(out, run_id)) else ""
        raise ConfigError(f"invalid {field}: the run already finished{stale}")
    pid = RunClaim(out, run_id).holder() if running else None
    if pid is not None:
        raise ConfigError(f"invalid {field}: the run is running right now in {out} (pid {pid}); wait for it to end "
                          "or stop it, then resume")
    ck_path = checkpoint.path_for(out, run_id)
    if not OutDir(out).is_file(ck_path):
        legacy = checkpoint.legacy_path_for(out, run_id)
        if OutDir(out).is_file(legacy):
            raise ConfigError(f"invalid {field}: {checkpoint.legacy_refusal(legacy)}")
        raise ConfigError(f"invalid {field}: no checkpoint at {ck_path} (the run ended before its first round was "
                          f"checkpointed, status {row.get('status')!r}); start it again with --run-id {run_id} --overwrite")
    return row


def _read_first_row(out: Path, f: Path, field: str) -> dict[str, Any]:
    try:
        with OutDir(out).open_read(f) as fh:
            rows = pq.read_table(fh).to_pylist()
    except Exception as e:
        raise ConfigError(f"invalid {field}: {f} is unreadable ({e.__class__.__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from e
    if not rows:
        raise ConfigError(f"invalid {field}: {f} holds no row")
    return rows[0]


def spans(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: list[str] = []
    start: int | None = xs[0]
    for a, b in zip(xs, [*xs[1:], None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def recover_abandoned(out: Path) -> dict[str, str]:
    """Finish every overwrite a killed process left half done in ``out`` (:func:`aside.recover`), each under
    its run's claim (one being run right now is left alone); return run id -> what was done. Called by
    every run and by ``fedsap-ray compact``, so a folder heals the first time it is used again."""
    d = OutDir(out)
    done: dict[str, str] = {}
    if not d.is_dir(d.abs / aside.ASIDE):
        return done
    for run_id in d.listdir(d.abs / aside.ASIDE):
        claim = RunClaim(out, run_id)
        try:
            claim.acquire()
        except ConfigError:
            continue  # its overwrite is running now
        try:
            what = aside.recover(out, run_id)
            if what:
                done[run_id] = what
        finally:
            claim.release()
    return done


def check_layout(out: Path, run_id: str) -> None:
    """Before any work: every entry of ``out`` a run touches is of the right kind and no link
    (:class:`~fedsap_ray.persist.outdir.OutDir`): the table and checkpoint folders, the run's lock, files,
    parts and checkpoint, and a pending overwrite's folder. A refusal names the entry (exit 2)."""
    d = OutDir(out)
    d.check(out, DIR)
    for sub in (*results.TABLES, "checkpoints", kept.FOLDER):
        d.check(d.abs / sub, DIR)
    d.check(lock_path(d.abs, run_id), FILE)
    for f in (checkpoint.path_for(out, run_id), checkpoint.legacy_path_for(out, run_id)):
        d.check(f, FILE)
    results.run_files(out, run_id)  # each of them checked
    kept.kept_models(out, run_id)  # its models folder and the files it keeps there
    if d.is_dir(aside.folder(out, run_id)):
        for sub in d.listdir(aside.folder(out, run_id)):
            for name in d.listdir(aside.folder(out, run_id) / sub):
                if sub == kept.FOLDER:  # the old run's models folder, moved whole
                    d.listdir(d.check(aside.folder(out, run_id) / sub / name, DIR))
                else:
                    d.check(aside.folder(out, run_id) / sub / name, FILE)


def check_folder(out: Path, files: tuple[str, ...] = (), dirs: tuple[str, ...] = ()) -> None:
    """Before a sweep starts: every entry a sweep's runs read or write in ``out`` is of the right kind and
    no link: the table and checkpoint folders and everything in them, a pending overwrite's folder, and
    the sweep's own ``files`` and ``dirs`` (e.g. ``optuna.db``, ``_tune``). A refusal names the entry."""
    d = OutDir(out)
    if not d.is_dir(out):
        return
    check_tree(d.filesystem(), str(d.abs), str(out), (*results.TABLES, "checkpoints", aside.ASIDE, kept.FOLDER, *dirs))
    for name in files:
        d.check(d.abs / name, FILE)


def remove_leftovers(out: Path, run_id: str) -> None:
    """Temporary files of this run's earlier, killed writers (call under the run's claim)."""
    results.remove_temp_files(out, run_id)
    checkpoint.remove_temp_files(out, run_id)
    kept.remove_temp_files(out, run_id)


@contextlib.contextmanager
def claimed(out: Path, run_id: str, *, resume: bool, overwrite: bool) -> Iterator[dict[str, Any]]:
    """The checks and the claim around a run: yields ``{"checkpoint": ..., "previous": status, "recovered": ...}``.

    ``previous`` is the status of an old run under the same id that ``--overwrite`` will replace (the
    caller sets it aside: :mod:`fedsap_ray.results.aside`); ``recovered`` says how an overwrite that a
    killed process left half done was finished (``committed``, ``restored`` or None), before any check
    that reads the run.
    """
    created = check_out(out)
    try:
        check_layout(out, run_id)
        check_folder(out)  # another run's entry of the wrong kind would stop this run when it merges its files
    except ConfigError:
        if created:
            with contextlib.suppress(OSError):
                Path(out).rmdir()
        raise
    claim = RunClaim(out, run_id, field="--resume" if resume else "--run-id")
    try:
        claim.acquire()
    except ConfigError:
        if created:
            with contextlib.suppress(OSError):
                Path(out).rmdir()
        raise
    try:
        info: dict[str, Any] = {"checkpoint": None, "previous": None, "recovered": aside.recover(out, run_id)}
        recover_abandoned(out)  # other runs' overwrites a kill left half done
        if resume:
            info["checkpoint"] = check_resumable(out, run_id)
        else:
            info["previous"] = refuse_existing(out, run_id, overwrite=overwrite)
        remove_leftovers(out, run_id)
        yield info
    except (ConfigError, DatasetUnavailable):
        claim.release()
        if created:  # refused before any result was written: leave no empty folder behind
            with contextlib.suppress(OSError):
                Path(out).rmdir()
        raise
    finally:
        claim.release()
