"""Inductor's on-disk cache under the node's cache folder, content-checked: a damaged entry is rebuilt, never
trusted (issue 56; the rules of the node's dataset cache, :mod:`fedsap_ray.data.cachefile`).

Why: Inductor trusts its code cache. It checks its FX-graph and AOTAutograd entries (a damaged one is compiled
again), but the generated wrapper ``.py`` and the kernels' ``.so`` files are loaded by name: one truncated or
with flipped bytes stops the run with an error, and one replaced by valid code computing something else is
loaded silently and trains on wrong numbers (measured on torch 2.14.1: docs/guides/performance.md).

The rule: every file Inductor writes into our folder gets the sha256 digest of its content
(:mod:`fedsap_ray.persist.digest`), recorded by the process that compiled it once the compile is done
(:func:`record`: after a client's training or a round's evaluation that compiled), one digest file per file
under :data:`DIGESTS` (written whole or not at all, so concurrent processes of a node never race on one
manifest). Before a process's first compile, :func:`check` walks the folder without following links: a file
whose content does not match its digest, a link or an entry of another kind, and a file without a digest
(once :data:`GRACE_S` old: younger, another process of the node may be between writing and recording it) is
removed with its digest, so Inductor generates it again; one warning names the folder and the count.

Inductor's ``locks/`` folder is left alone: its files are empty and flocked by concurrent compiles, and
removing one would break the lock. What a digest does not prove is :mod:`fedsap_ray.persist.digest`'s: whoever
can write the folder can write matching digests (the folder is owner-only for that reason).
"""
from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fedsap_ray.data import cachefile
from fedsap_ray.data.cachefile import Unusable
from fedsap_ray.persist.atomic import atomic_write
from fedsap_ray.persist.digest import file_digest, is_digest

DIGESTS = ".fedsap_digests"  # under the cache folder: ``<DIGESTS>/<the file's relative path>.sha256``
SUFFIX = ".sha256"
UNCHECKED = frozenset({DIGESTS, "locks"})  # top-level folders that are not Inductor's generated content
# an unrecorded file younger than this may be another process's compile between writing and recording it
# (recorded when that client's training ends): left for the next process to judge
GRACE_S = 600.0
MAX_THREADS = cachefile.MAX_THREADS


def _entries(root: Path, skip: frozenset[str] = UNCHECKED) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every entry below ``root`` that is not a real folder (files, links, FIFOs...), as (relative path, entry),
    never descending through a link; the top-level folders in ``skip`` skipped."""
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            it = os.scandir(root / rel if rel else root)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed meanwhile
        with it:
            for e in it:
                sub = f"{rel}/{e.name}" if rel else e.name
                if not rel and e.name in skip:
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append(sub)
                else:
                    yield sub, e


def digest_path(root: Path, rel: str) -> Path:
    """Where the digest of ``root/rel`` is recorded."""
    return root / DIGESTS / (rel + SUFFIX)


def _content(path: Path) -> str | None:
    """The digest of the file at ``path`` read without following a link; None when it is gone or is no file."""
    try:
        with cachefile.open_file(path) as f:
            return file_digest(f)
    except (FileNotFoundError, Unusable):
        return None


def _recorded(root: Path, rel: str) -> str | None:
    """The digest recorded for ``root/rel``, None when there is none (or it, or a folder above it below ``root``,
    is a link: ``O_NOFOLLOW`` guards the last component only; or it is not a digest)."""
    path = digest_path(root, rel)
    try:
        if not cachefile.check_below(root, path):
            return None
        with cachefile.open_file(path) as f:
            text = f.read(100).decode("ascii", "replace").strip()
    except (FileNotFoundError, NotADirectoryError, Unusable):
        return None
    return text if is_digest(text) else None


def _write_digest(root: Path, rel: str, digest: str) -> None:
    target = digest_path(root, rel)
    cachefile.real_folder(root, target.parent)  # a link in the way is removed, never written through
    with atomic_write(target, mode=0o600) as f:
        f.write(digest.encode() + b"\n")


def record(root: Path) -> int:
    """Record the digest of every regular file below ``root`` that has none yet (those the process's compiles
    just wrote, and a concurrent process's not yet recorded); returns how many were recorded."""
    new = [rel for rel, e in _entries(root) if e.is_file(follow_symlinks=False)
           and not os.path.lexists(digest_path(root, rel))]
    with ThreadPoolExecutor(min(MAX_THREADS, max(1, len(new)))) as pool:
        digests = list(pool.map(lambda rel: _content(root / rel), new))
    for rel, digest in zip(new, digests):
        if digest is not None:
            _write_digest(root, rel, digest)
    return sum(d is not None for d in digests)


def _bad(root: Path, rel: str, entry: os.DirEntry[str], now: float) -> bool:
    """Whether ``root/rel`` is to be removed (module docstring)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return True  # a link (never followed: removed as such) or a FIFO, socket...
    recorded = _recorded(root, rel)
    if recorded is None:
        return now - st.st_mtime >= GRACE_S
    actual = _content(root / rel)
    return actual is not None and actual != recorded


def check(root: Path) -> int:
    """Remove every damaged, linked or (after :data:`GRACE_S`) unrecorded entry below ``root`` with its digest,
    and the digests of files that are gone; one warning names the folder when any entry was removed. Returns
    the count of entries removed."""
    now = time.time()
    _real_digests(root)
    entries = list(_entries(root))
    with ThreadPoolExecutor(min(MAX_THREADS, max(1, len(entries)))) as pool:
        bad = [rel for (rel, e), b in zip(entries, pool.map(lambda item: _bad(root, item[0], item[1], now), entries)) if b]
    for rel in bad:
        cachefile.discard(root / rel)
        cachefile.discard(digest_path(root, rel))
    _drop_orphans(root, {rel for rel, _ in entries} - set(bad))
    if bad:
        cachefile.notice(f"Inductor cache {root}: {len(bad)} damaged, linked or unrecorded entr"
                         f"{'y' if len(bad) == 1 else 'ies'} removed (first: {bad[0]}); Inductor compiles them again")
    return len(bad)


def _real_digests(root: Path) -> None:
    """Remove every link or other non-file in the digest folder (the folder itself, if it is one), before a digest
    is read or removed: a linked folder would vouch for files with digests written elsewhere, and removing a
    digest through it would remove a file elsewhere."""
    base = root / DIGESTS
    try:
        cachefile.check_below(root, base, folder=True)
    except Unusable:
        cachefile.discard(base)  # a link or file in its place: removed as such
        return
    for rel, e in _entries(base, frozenset()):
        if not e.is_file(follow_symlinks=False):
            cachefile.discard(base / rel)


def _drop_orphans(root: Path, kept: set[str]) -> None:
    """Remove the digests whose file is gone (removed by hand, or by a process whose check ran meanwhile), and
    anything in the digest folder that is not a digest file: a stale digest would be taken for a new file's."""
    base = root / DIGESTS
    for rel, e in _entries(base, frozenset()):
        name = rel[:-len(SUFFIX)] if rel.endswith(SUFFIX) else None
        if not e.is_file(follow_symlinks=False) or name is None or \
                name not in kept and not os.path.lexists(root / name):  # a file that appeared since: its digest is new
            cachefile.discard(base / rel)
