"""The one door to a results folder: every read, write, rename and delete under ``--out`` goes through
an :class:`OutDir`, which never follows a symbolic link inside the folder and never leaves it.

Why: a results folder holds hours of compute and is shared, copied and synced between people; an entry
in it may have been replaced by a link (``OUT/rounds -> /somewhere/else``, ``OUT/.ID.lock -> ~/.bashrc``)
by mistake or on purpose, and following it would write, truncate or delete files outside the folder.

The rules (docs/guides/running.md#what-a-results-folder-promises):

- ``--out`` itself may be a link (``runs -> /scratch/runs``): it is resolved once, when the
  :class:`OutDir` is made, and everything below is addressed from that real path;
- below it, every existing component of a path is looked at with ``lstat`` before the operation: a
  symbolic link anywhere, a path that leaves the folder, or an entry of the wrong kind (a file where a
  folder is expected, a folder, FIFO or device where a file is expected) is refused with
  :class:`UnsafeEntry`, a :class:`~fedsap_ray.common.errors.ConfigError` (exit 2) naming the entry;
- files are opened with ``O_NOFOLLOW`` as well, so a link swapped in after the check fails the open
  rather than being followed. What is left is a race with a process that swaps a *parent folder* for a
  link between the check and the operation, which needs write access to the folder while the run
  writes it; that is outside what this module promises.

Parquet I/O goes through :meth:`OutDir.filesystem`, a pyarrow filesystem whose every call is checked
the same way (:class:`_Handler`), so :mod:`fedsap_ray.results` keeps one code path for local folders and
object stores. No Ray, no torch.
"""
from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow.fs as pafs

from fedsap_ray.persist.atomic import atomic_write
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.checks import clip

FILE, DIR = "file", "dir"


def lock_path(out: str | Path, run_id: str) -> Path:
    """A run's lock file: ``OUT/.<run_id>.lock`` (:class:`fedsap_ray.run.guard.RunClaim`)."""
    return Path(out) / f".{run_id}.lock"


class UnsafeEntry(ConfigError):
    """An entry of a results folder that fedsap_ray refuses to touch (a link, the wrong kind, outside it)."""


def entry_kind(mode: int) -> str:
    """What a file-system entry of ``mode`` (an ``lstat`` result's) is, in words, for refusals."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    return "a special file (FIFO, socket or device)"


#: The longest path this package writes below a results folder, beyond the folder itself: a temporary part
#: file of a run id of 128 characters (``/allocations/.<run_id>@r000001.parquet.<uuid8>.tmp``), with room to spare.
DEEPEST_BELOW = 200


def check_name_lengths(path: Path, field: str) -> None:
    """A :class:`ConfigError` naming ``field`` (e.g. ``--out='runs/x'``) when ``path`` (absolute) has a component longer than its file
    system allows, or is so long that the files a run writes below it would pass the system's path limit.

    Why: the first write otherwise fails deep in a run with ``OSError: File name too long`` (exit 1, a
    traceback); the limits are the file system's own (``os.pathconf`` of the nearest existing folder), 255
    bytes a name and 4096 a path where it does not say."""
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    try:
        name_max = os.pathconf(probe, "PC_NAME_MAX")
        path_max = os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            raise ConfigError(f"invalid {field}: its component {clip(part, 40)} is {len(os.fsencode(part))} bytes long; "
                              f"the file system allows {name_max} bytes a name: choose a shorter folder name")
    if len(os.fsencode(str(path))) + DEEPEST_BELOW > path_max:
        raise ConfigError(f"invalid {field}: the path is {len(os.fsencode(str(path)))} bytes long; the files a run "
                          f"writes below it would pass the system's limit of {path_max} bytes a path: choose a "
                          "shorter path")


class OutDir:
    """A results folder, addressed only through checked paths (module docstring).

    ``field``: how refusals name the folder (default: ``out`` as given; a ``file://`` URI is named as
    written). Paths given to the methods may be absolute or relative to the current folder, spelled
    through ``out`` as given or through its real path: both map to the same entry.
    """

    def __init__(self, out: str | Path, field: str | None = None) -> None:
        self.given = str(out) if field is None else field
        self.abs = Path(os.path.abspath(out))
        check_name_lengths(self.abs, f"results folder {clip(self.given, 120)}")
        self.root = Path(os.path.realpath(out))

    def __repr__(self) -> str:
        return f"OutDir({self.given!r})"

    # ------------------------------------------------------------------ checking paths
    def refuse(self, entry: str | Path, what: str) -> UnsafeEntry:
        return UnsafeEntry(f"results folder {self.given}: {entry} {what}")

    def rel(self, path: str | Path) -> str:
        """``path`` relative to the folder ('' for the folder itself); an :class:`UnsafeEntry` outside it."""
        p = os.path.abspath(path)
        for base in (str(self.abs), str(self.root)):
            if p == base:
                return ""
            if p.startswith(base.rstrip("/") + "/"):
                return p[len(base.rstrip("/")) + 1:]
        raise self.refuse(path, "is outside the results folder; fedsap_ray never writes or reads there")

    def check(self, path: str | Path, kind: str | None = None) -> Path:
        """The real path of ``path`` after checking every existing component below the folder: no link,
        a folder wherever a component has something below it, and the last one of ``kind`` (``FILE``,
        ``DIR`` or None: any) when it exists. Components that do not exist yet are not checked (they are
        created by the caller, through this class)."""
        rel = self.rel(path)
        cur = self.root
        parts = [p for p in rel.split("/") if p] if rel else []
        for i, part in enumerate(parts):
            cur = cur / part
            try:
                mode = os.lstat(cur).st_mode
            except FileNotFoundError:
                break
            last = i == len(parts) - 1
            shown = self.show(cur)
            if stat.S_ISLNK(mode):
                target = os.readlink(cur)
                raise self.refuse(shown, f"is a symbolic link (to {target[:80]}); fedsap_ray never follows a link "
                                         "inside a results folder: put the real folder or file there")
            if not last and not stat.S_ISDIR(mode):
                raise self.refuse(shown, f"is {entry_kind(mode)} where a folder is expected; move it away")
            if last and kind == DIR and not stat.S_ISDIR(mode):
                raise self.refuse(shown, f"is {entry_kind(mode)} where a folder is expected; move it away")
            if last and kind == FILE and not stat.S_ISREG(mode):
                raise self.refuse(shown, f"is {entry_kind(mode)} where a file is expected; move it away")
        return self.root.joinpath(*parts)

    def show(self, real: str | Path) -> str:
        """How an entry is named in messages: its path inside the folder."""
        rel = os.path.relpath(real, self.root)
        return "the folder itself" if rel == "." else rel

    def kind_of(self, path: str | Path) -> str | None:
        """``FILE``, ``DIR`` or None (absent), after :meth:`check` (a link or other kind is refused)."""
        real = self.check(path)
        try:
            mode = os.lstat(real).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISDIR(mode):
            return DIR
        if stat.S_ISREG(mode):
            return FILE
        raise self.refuse(self.show(real), f"is {entry_kind(mode)}; move it away")

    def is_file(self, path: str | Path) -> bool:
        """Whether ``path`` is a regular file (a folder there is refused: it should be a file)."""
        real = self.check(path, FILE)
        return real.exists()

    def is_dir(self, path: str | Path) -> bool:
        real = self.check(path, DIR)
        return real.exists()

    # ------------------------------------------------------------------ operations
    def mkdir(self, path: str | Path) -> Path:
        """Create the folder ``path`` (and missing parents), each checked first; return its real path."""
        real = self.check(path, DIR)
        real.mkdir(parents=True, exist_ok=True)
        return self.check(path, DIR)  # a parent made by someone else meanwhile is checked too

    def listdir(self, path: str | Path) -> list[str]:
        """The names in the folder ``path`` ([] when it does not exist)."""
        real = self.check(path, DIR)
        try:
            return sorted(os.listdir(real))
        except FileNotFoundError:
            return []

    def glob(self, folder: str | Path, pattern: str) -> list[Path]:
        """Entries of ``folder`` whose names match ``pattern`` (fnmatch: no ``[`` escaping needed for run
        ids, whose alphabet has no pattern characters), as real paths, each checked to be a regular file."""
        real = self.check(folder, DIR)
        return [self.check(real / n, FILE) for n in self.listdir(real) if fnmatch.fnmatchcase(n, pattern)]

    def open_read(self, path: str | Path) -> BinaryIO:
        """``path`` opened for reading; refuses a link or anything but a regular file (no FIFO to hang on)."""
        real = self.check(path, FILE)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == 40:  # ELOOP: became a link after the check
                raise self.refuse(self.show(real), "is a symbolic link; fedsap_ray never follows one") from e
            raise
        return os.fdopen(fd, "rb")

    def read_bytes(self, path: str | Path) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    @contextmanager
    def atomic_write(self, path: str | Path, *, mode: int | None = None) -> Iterator[BinaryIO]:
        """:func:`fedsap_ray.persist.atomic.atomic_write` at a checked path (its folder created through :meth:`mkdir`)."""
        real = self.check(path, FILE)
        self.mkdir(real.parent)
        with atomic_write(real, mode=mode) as f:
            yield f

    def unlink(self, path: str | Path) -> bool:
        """Remove the file ``path`` (the entry itself: a link is removed, never what it points to); whether it was there."""
        real = self.check(Path(path).parent, DIR) / Path(path).name
        try:
            os.unlink(real)
            return True
        except FileNotFoundError:
            return False

    def replace(self, src: str | Path, dst: str | Path) -> None:
        """Move the entry ``src`` to ``dst`` (both inside the folder; ``dst``'s folder is created)."""
        s = self.check(src)
        d = self.check(dst)
        self.mkdir(d.parent)
        os.replace(s, d)

    def rmtree(self, path: str | Path) -> None:
        """Remove the folder ``path`` and what it holds (links inside are removed, never followed)."""
        real = self.check(path, DIR)
        if real.exists():
            shutil.rmtree(real)

    def open_lock(self, path: str | Path) -> int:
        """A file descriptor of the lock file ``path``, created if missing, never through a link."""
        real = self.check(path, FILE)
        self.mkdir(real.parent)
        try:
            return os.open(real, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == 40:  # ELOOP
                raise self.refuse(self.show(real), "is a symbolic link; a run's lock is never opened through one") from e
            raise

    def lock_holder(self, path: str | Path) -> str | None:
        """The pid written in the lock file ``path`` while a process holds its ``flock``, else None (asks the
        kernel without creating the file or keeping any lock: :class:`fedsap_ray.run.guard.RunClaim`)."""
        if not self.is_file(path):
            return None  # no lock file: nobody has claimed it since it was last released
        try:
            fd = os.open(self.check(path), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                raise
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def filesystem(self) -> pafs.FileSystem:
        """A pyarrow filesystem over this folder whose every call is checked as above (for Parquet I/O)."""
        return pafs.PyFileSystem(_Handler(self))


LOCAL_TYPE = "py::fedsap_ray.persist.outdir"  # the type_name of OutDir.filesystem()


class _Handler(pafs.FileSystemHandler):
    """pyarrow's local filesystem behind :meth:`OutDir.check` (each call's paths checked first)."""

    def __init__(self, d: OutDir) -> None:
        self.d = d
        self.fs = pafs.LocalFileSystem()

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Handler) and other.d.root == self.d.root

    def __ne__(self, other: Any) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return LOCAL_TYPE.removeprefix("py::")

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        for p in paths:
            self.d.kind_of(p)
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self.d.check(selector.base_dir, DIR)
        infos = self.fs.get_file_info(selector)
        for i in infos:  # an entry that is a link (the local filesystem reports its target's type)
            self.d.kind_of(i.path)
        return infos

    def create_dir(self, path: str, recursive: bool) -> None:
        self.d.mkdir(path)

    def delete_dir(self, path: str) -> None:
        self.d.rmtree(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        real = self.d.check(path, DIR)
        for name in self.d.listdir(real):
            if self.d.kind_of(real / name) == DIR:
                self.d.rmtree(real / name)
            else:
                self.d.unlink(real / name)

    def delete_root_dir_contents(self) -> None:
        raise self.d.refuse("/", "cannot be emptied through a results folder")

    def delete_file(self, path: str) -> None:
        self.d.check(path, FILE)
        if not self.d.unlink(path):
            raise FileNotFoundError(path)

    def move(self, src: str, dest: str) -> None:
        self.d.replace(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        with self.d.open_read(src) as f, self.d.atomic_write(dest) as g:
            shutil.copyfileobj(f, g)

    def open_input_stream(self, path: str) -> Any:
        self.d.check(path, FILE)
        return self.fs.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        self.d.check(path, FILE)
        return self.fs.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        real = self.d.check(path, FILE)
        self.d.mkdir(real.parent)
        return self.fs.open_output_stream(path)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        real = self.d.check(path, FILE)
        self.d.mkdir(real.parent)
        return self.fs.open_append_stream(path)
