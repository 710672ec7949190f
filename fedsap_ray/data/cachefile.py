"""The data layer's cache files: each carries a digest of its content, is read back only when the digest
matches, and is never read or written through a symbolic link.

Why (issue 52): the caches the data layer writes (the node-local split cache, the embedded dataset's
``.npz``, the decoded CIFAR-10 archive, the rendered digits) were trusted by their shape and dtype alone:
labels replaced by other valid labels, black images, a few flipped bytes in an uncompressed member, a
``meta.json`` edited consistently after samples were dropped, or a link to an altered copy elsewhere were
all read, and a run trained on them with exit 0.

The rules every cache of :mod:`fedsap_ray.data` keeps (docs/guides/data.md#caches):

- a cache is written with the sha256 digest of each of its arrays (:mod:`fedsap_ray.persist.digest`: name, dtype,
  shape and bytes), and each digest is compared with the content once per process, before the first use;
- below the cache's root (``$FEDSAP_RAY_CACHE``, a ``cache_dir``, the embedded file's ``data.root``: the
  root itself may be a link, like ``--out``), every folder and file is looked at with ``lstat`` and opened
  with ``O_NOFOLLOW``: a link, an entry of another kind (a folder or FIFO where a file is expected), a file
  or member the build did not write, or one it wrote that is gone, makes the cache :class:`Unusable`;
- an unusable cache is rebuilt from its source, then one warning line says so (:class:`CacheRebuilt`,
  naming the file and what was wrong); the link or stray entry is replaced, never followed. Where the
  source is gone too, the load stops with :class:`~fedsap_ray.common.errors.DatasetUnavailable` (exit 2) naming
  the cache file and what is missing (:func:`cannot_rebuild`), and nothing is changed.

What a digest does not prove: whoever can write the cache can also write digests that match an edit. A
deliberate, consistent edit (the numbers changed *and* the digests recomputed) is taken on trust, like
any data file a run is pointed at. Accidental damage, and edits that leave the digests as they were, are
refused.
"""
from __future__ import annotations

import errno
import io
import json
import os
import stat
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np

from fedsap_ray.persist.atomic import atomic_write
from fedsap_ray.persist.digest import arrays_digest
from fedsap_ray.common.errors import DatasetUnavailable
from fedsap_ray.persist.outdir import entry_kind

DIGESTS = "content_digests"  # the member of a cache .npz holding the digest of every other member (JSON)
MAX_THREADS = 8  # digests of a cache's arrays are taken in parallel (hashlib releases the GIL)


class CacheRebuilt(RuntimeWarning):
    """A cache was damaged, altered, linked or held a stray entry, and is rebuilt from its source (one line)."""


class Unusable(Exception):
    """Why a cache cannot be used, naming the file: ``<path>: <reason>`` (one line)."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


def rebuilt(problem: Unusable) -> None:
    """The one line a cache that was there, but unusable, prints once it was rebuilt from its source (a
    :class:`CacheRebuilt` warning; where the source is gone, :func:`cannot_rebuild`'s refusal is the one line)."""
    notice(f"cache {problem}; rebuilt it from its source")


def notice(text: str) -> None:
    """Emit ``text`` as a :class:`CacheRebuilt` warning printed on one line: attributed to the package, not to a
    source line (a plain ``warnings.warn`` prints the calling line beneath the message, a second line)."""
    warnings.warn_explicit(text, CacheRebuilt, filename="fedsap_ray.data", lineno=0, module="fedsap_ray.data.cachefile")


def cannot_rebuild(problem: Unusable, error: BaseException) -> DatasetUnavailable:
    """The refusal when an unusable cache's source is gone: names the cache file and what is missing."""
    first = str(error).splitlines()[0] if str(error) else error.__class__.__name__
    return DatasetUnavailable(f"cache {problem}, and it cannot be rebuilt: {first}; restore the dataset's files "
                              f"(or delete {problem.path.name} to stop using it)")


# ---------------------------------------------------------------------------- paths: never through a link
def _below(root: Path, path: Path) -> list[Path]:
    """The components of ``path`` below ``root``, outermost first (``path`` must be under ``root``)."""
    rel = Path(os.path.relpath(os.path.abspath(path), os.path.abspath(root)))
    if rel.parts[:1] == ("..",):
        raise ValueError(f"{path} is not under the cache root {root}")
    out, cur = [], Path(root)
    for part in rel.parts if rel != Path(".") else ():
        cur = cur / part
        out.append(cur)
    return out


def check_below(root: Path, path: Path, *, folder: bool = False) -> bool:
    """Whether ``path`` exists, after checking every component below ``root`` with ``lstat``: a folder
    wherever something lies below it, and ``path`` itself a folder (``folder``) or a regular file. A link or
    another kind is :class:`Unusable`; components that do not exist end the walk (False)."""
    parts = _below(root, path)
    for i, p in enumerate(parts):
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            return False
        last = i == len(parts) - 1
        if stat.S_ISLNK(mode):
            raise Unusable(p, f"is a symbolic link (to {os.readlink(p)[:80]}); a cache is never read through a link")
        want_dir = folder or not last
        if want_dir and not stat.S_ISDIR(mode) or not want_dir and not stat.S_ISREG(mode):
            raise Unusable(p, f"is {entry_kind(mode)} where a {'folder' if want_dir else 'file'} is expected")
    return True


def discard(path: Path) -> None:
    """Remove the entry ``path`` (a link or file itself, a folder with what it holds; never a link's target)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def real_folder(root: Path, folder: Path) -> Path:
    """Make ``folder`` (under ``root``) a real folder: a link or file in the way of any component below
    ``root`` is removed (a link's target is left alone), then the missing folders are created."""
    Path(root).mkdir(parents=True, exist_ok=True)
    for p in _below(root, folder):
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISDIR(mode):
            discard(p)
            mode = None
        if mode is None:
            try:
                os.mkdir(p)
            except FileExistsError:  # made by another process meanwhile: checked again below
                pass
    check_below(root, folder, folder=True)
    return folder


def open_file(path: Path) -> BinaryIO:
    """``path`` opened for reading, never through a link (``O_NOFOLLOW``) and never a FIFO (``O_NONBLOCK``,
    then ``fstat``): either is :class:`Unusable`; a missing file raises ``FileNotFoundError``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unusable(path, "is a symbolic link; a cache is never read through a link") from e
        if isinstance(e, FileNotFoundError):
            raise
        raise Unusable(path, f"cannot be opened ({e.strerror})") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise Unusable(path, f"is {entry_kind(mode)} where a file is expected")
    return os.fdopen(fd, "rb")


def open_for_append(path: Path, flags: int) -> int:
    """A descriptor of the small bookkeeping file ``path`` (a lock, a log), created if missing, never through
    a link: a link (or a folder) there is removed first (one :class:`CacheRebuilt` line; a link's target is
    left alone)."""
    for _ in range(2):
        try:
            return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EISDIR):
                raise
            what = "a symbolic link" if e.errno == errno.ELOOP else "a folder"
            notice(f"cache {path}: is {what}; replaced by a file of its own")
            discard(path)
    raise Unusable(path, "became a link or folder again while it was replaced")


def map_npy(path: Path) -> np.ndarray:
    """A copy-on-write map of the ``.npy`` file ``path``, opened through :func:`open_file`; its size must be
    exactly its header's plus the array's bytes (nothing appended)."""
    with open_file(path) as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f".npy format version {version}")
        except Exception as e:  # numpy parses the header with ast and tokenize: ValueError, SyntaxError, TokenError...
            raise Unusable(path, f"is not a readable .npy file ({e.__class__.__name__}: {e})") from e
        if dtype.hasobject:
            raise Unusable(path, "holds Python objects; a cache holds numbers only")
        offset = f.tell()
        size = os.fstat(f.fileno()).st_size
        need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if size != need:
            raise Unusable(path, f"has {size} bytes; its header describes {need}")
        return np.memmap(f, dtype=dtype, mode="c", offset=offset, shape=tuple(shape), order="F" if fortran else "C")


# ---------------------------------------------------------------------------- digests
def array_digests(arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Each array's digest (bound to its name), the largest first, in parallel threads: hashlib releases the
    GIL while it hashes, so a node cache's arrays are read and hashed on every core."""
    names = sorted(arrays, key=lambda k: -int(np.asarray(arrays[k]).nbytes))
    threads = min(len(names), MAX_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if threads <= 1:
        return {k: arrays_digest({k: arrays[k]}) for k in names}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(zip(names, pool.map(lambda k: arrays_digest({k: arrays[k]}), names)))


def verify(arrays: Mapping[str, np.ndarray], expected: Mapping[str, object], path_of: Callable[[str], str | Path]) -> None:
    """The check before first use: every array's digest is the one written when it was built, else
    :class:`Unusable` naming the first that differs (``path_of(name)``: its file, or file and member)."""
    got = array_digests(arrays)
    for k in sorted(arrays):
        if got[k] != expected.get(k):
            raise Unusable(path_of(k), "does not match its content digest: it changed since the cache was built")


# ---------------------------------------------------------------------------- .npz caches
def read_npz(root: Path, path: Path, names: Iterable[str]) -> dict[str, np.ndarray] | None:
    """The arrays ``names`` of the cache ``path`` (under ``root``), read whole and checked against their
    digests; None when there is no such file. :class:`Unusable` when it is a link or under one, unreadable,
    holds a member it should not or lacks one (a file without digests was written by an older version)."""
    if not check_below(root, path):
        return None
    want = set(names)
    try:
        with open_file(path) as f, np.load(f, allow_pickle=False) as z:
            members = list(z.files)
            if DIGESTS not in members:
                raise Unusable(path, "has no content digests (written by an older version, or not by fedsap_ray)")
            stray = sorted(set(members) - want - {DIGESTS}) or sorted(m for m in set(members) if members.count(m) > 1)
            if stray:
                raise Unusable(path, f"holds a member the build did not write ({stray[0]!r})")
            missing = sorted(want - set(members))
            if missing:
                raise Unusable(path, f"lacks the member {missing[0]!r}")
            arrays = {k: z[k] for k in sorted(want)}  # reading a member whole checks its CRC
            expected = json.loads(z[DIGESTS].tobytes().decode())
    except Unusable:
        raise
    except FileNotFoundError:
        return None
    except Exception as e:  # zipfile, zlib, json and numpy's header parser (ast, tokenize) all raise their own
        first = str(e).splitlines()[0] if str(e) else ""
        raise Unusable(path, f"is unreadable ({e.__class__.__name__}: {first[:200]})") from e
    if not isinstance(expected, dict):
        raise Unusable(path, f"its {DIGESTS} member is not a mapping of member names to digests")
    verify(arrays, expected, lambda k: f"{path} (member {k})")
    return arrays


def write_npz(root: Path, path: Path, arrays: Mapping[str, np.ndarray], *, compresslevel: int | None = None) -> None:
    """Write ``arrays`` and their digests as the cache ``path`` (under ``root``), whole or not at all.

    Member order and timestamps are fixed, so the same arrays give the same bytes; ``compresslevel`` None
    stores the members uncompressed. A link or file in the way of the folders below ``root`` is replaced
    by a real folder, and a link at ``path`` by the file (the rename replaces the link, not its target; a
    folder or FIFO there is removed first).
    Mode 0644: a cache is shared like any data file.
    """
    if DIGESTS in arrays:
        raise ValueError(f"{DIGESTS} is the name of the digests member")
    real_folder(root, path.parent)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode) and not stat.S_ISLNK(os.lstat(path).st_mode):
            discard(path)  # a folder or FIFO in the file's place: a rename cannot replace it
    except FileNotFoundError:
        pass
    members = {k: np.ascontiguousarray(a) for k, a in arrays.items()}
    text = json.dumps(array_digests(members), sort_keys=True, separators=(",", ":")).encode()
    members[DIGESTS] = np.frombuffer(text, dtype=np.uint8)
    compression = zipfile.ZIP_STORED if compresslevel is None else zipfile.ZIP_DEFLATED
    with atomic_write(path, mode=0o644) as fh, zipfile.ZipFile(fh, "w", compression=compression, allowZip64=True) as zf:
        for key in sorted(members):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, members[key], allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = compression
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getbuffer(), compresslevel=compresslevel)
