"""A node-local, memory-mapped copy of a dataset's loaded splits, shared by every process on the node.

Why: a sweep runs many trials (separate worker processes) on one node, and each one
builds its Federation from the same :class:`~fedsap_ray.data.registry.DomainSplits`.
:func:`~fedsap_ray.data.federation.load_splits` caches only within a process, so without
this every trial would decode JPEGs / render digits / parse text again and hold its own
copy in RAM. :func:`shared_splits` does that work once per node: the first process loads
the splits as usual and writes every array as a ``.npy`` file; every later process maps
those files copy-on-write (``np.load(..., mmap_mode="c")``), so the node's page cache
holds one copy that all trials share.

Layout: ``<root>/<name>-<key16>/`` with one ``.npy`` per array and ``meta.json`` (written
last; the whole folder is built under a temporary name and renamed into place, so a
folder with the final name is always complete). ``<root>`` is ``cache_dir`` or
``cache_home()/"node_splits"`` (``$FEDSAP_RAY_CACHE/node_splits``, else
``~/.cache/fedsap_ray/node_splits``). ``key16`` hashes what ``load_splits`` keys its own
cache on: dataset name, resolved root, ``download``, the load seed (the run seed only
for ``seed_dependent`` sources) and :data:`FORMAT_VERSION`. Builders serialise on an
exclusive ``fcntl.flock`` of ``<root>/<name>-<key16>.lock`` (node-local: keep the root
off NFS). An entry whose source files (those the source's ``files()`` reports) changed
size or mtime since the build is rebuilt.

Content checks (:mod:`fedsap_ray.data.cachefile`, issue 52): ``meta.json`` holds each array's
sha256 digest beside its shape and dtype, and ``meta_digest``, the digest of its own canonical
content without that field (so the domains' order, the natural split's offsets, the notes and
the array digests are all covered). Once per process, before the first use, the entry is
checked: the folder and every file in it are real (``lstat``; opened with ``O_NOFOLLOW``, so
never read through a link), it holds exactly the files the build wrote, ``meta.json`` matches
its digest and every array its own (the digests are taken in parallel threads over the maps:
the pages they read are those the first use would read). An entry that fails is rebuilt with
one :class:`~fedsap_ray.data.cachefile.CacheRebuilt` line naming the file, or, when its source
is gone, refused with :class:`~fedsap_ray.common.errors.DatasetUnavailable` naming it.

Every build appends one JSON line (entry folder name, pid, time) to ``<root>/builds.jsonl``
(:func:`node_cache_builds` counts them), so "loaded once per node" can be checked on a real
cluster: each node's root should show one build per entry however many trials the node ran.
The line is written with one ``O_APPEND`` write, atomic on a local file system.

The returned tensors view copy-on-write maps: callers should not write to them in place
(the rule :func:`~fedsap_ray.data.federation.load_splits` already states and all code
follows), but if one does, only that process's private copy of the touched pages
changes, never the shared files and never another trial's data (a read-only map would
turn such a write into a SIGSEGV, since torch cannot mark memory read-only).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np
import torch

from fedsap_ray.data import cachefile, federation
from fedsap_ray.data.base import DomainData
from fedsap_ray.data.cachefile import Unusable
from fedsap_ray.data.registry import DomainSplits, get_source
from fedsap_ray.data.status import cache_home
from fedsap_ray.persist.digest import json_digest
from fedsap_ray.common.errors import DatasetUnavailable
from fedsap_ray.config.schema import ExperimentConfig

FORMAT_VERSION = 2  # 2: meta.json holds every array's digest and its own (issue 52)
META = "meta.json"
META_DIGEST = "meta_digest"  # meta.json's field holding the digest of the rest of it
BUILD_LOG = "builds.jsonl"
_TMP_PREFIX = ".tmp-"
# torch.from_numpy warns on every read-only array; the read-only-ness is the point here
_NOT_WRITABLE = "The given NumPy array is not writable"

# in-process memo: entry folder -> splits, so repeated calls in one process reuse the same maps
_OPENED: dict[str, DomainSplits] = {}


def node_cache_root(cache_dir: Path | str | None = None) -> Path:
    """``cache_dir`` when given, else ``cache_home() / "node_splits"``."""
    return Path(cache_dir).expanduser() if cache_dir is not None else cache_home() / "node_splits"


def _key_fields(cfg: ExperimentConfig) -> dict[str, Any]:
    """What identifies the loaded splits; mirrors the arguments ``load_splits`` passes to the source."""
    source = get_source(cfg.data.name)
    root = federation.resolve_root(cfg.data, source)
    seed = int(cfg.seed) if getattr(source, "seed_dependent", False) else 0  # as in load_splits
    return {"name": cfg.data.name, "root": str(Path(root).expanduser().resolve()),
            "download": bool(cfg.data.download), "seed": seed, "format_version": FORMAT_VERSION}


def entry_dir(cfg: ExperimentConfig, cache_dir: Path | str | None = None) -> Path:
    """The cache folder ``shared_splits(cfg, cache_dir)`` reads or builds (it may not exist yet)."""
    fields = _key_fields(cfg)
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return node_cache_root(cache_dir) / f"{fields['name']}-{key}"


def shared_splits(cfg: ExperimentConfig, cache_dir: Path | str | None = None) -> DomainSplits:
    """``load_splits(cfg)``, loaded at most once per node and memory-mapped by every process.

    Reuses this process's maps when it already opened the entry; otherwise opens and checks a
    complete entry without locking, or builds it under the entry's lock (re-checking first, since
    another process may have built it while this one waited). An entry that is there but fails its
    checks is rebuilt with one :class:`~fedsap_ray.data.cachefile.CacheRebuilt` line; when its
    source is gone, :class:`~fedsap_ray.common.errors.DatasetUnavailable` names the entry's file. A source that
    declares ``node_cache = False`` (own data and plugins, :mod:`fedsap_ray.data.own`: no file shows their
    changes) is loaded by each process instead.
    """
    if not getattr(get_source(cfg.data.name), "node_cache", True):
        return federation.load_splits(cfg)
    target = entry_dir(cfg, cache_dir)
    memo = _OPENED.get(str(target))
    if memo is not None:
        return memo
    try:
        splits = _open(target, _source_files(cfg))
    except Unusable:  # checked again under the lock: a builder may be replacing it right now
        splits = None
    if splits is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.parent / (target.name + ".lock")):
            problem: Unusable | None = None
            try:
                splits = _open(target, _source_files(cfg))
            except Unusable as e:
                problem = e
            if splits is None:
                try:
                    _build(cfg, target)
                except DatasetUnavailable as e:
                    if problem is None:
                        raise
                    raise cachefile.cannot_rebuild(problem, e) from e
                if problem is not None:
                    cachefile.rebuilt(problem)
                try:
                    splits = _open(target, None)
                except Unusable as e:
                    raise RuntimeError(f"node cache: {target} was just written but does not read back ({e})") from e
                if splits is None:
                    raise RuntimeError(f"node cache: {target} was just written but is not there")
    _OPENED[str(target)] = splits
    return splits


def node_cache_builds(cache_dir: Path | str | None = None) -> dict[str, int]:
    """Entry folder name -> how many times it was built under this root (from ``builds.jsonl``)."""
    log = node_cache_root(cache_dir) / BUILD_LOG
    counts: dict[str, int] = {}
    try:
        with cachefile.open_file(log) as f:
            text = f.read().decode(errors="replace")
    except (FileNotFoundError, Unusable):
        return counts
    for line in text.splitlines():
        try:
            entry = json.loads(line)["entry"]
        except (ValueError, KeyError, TypeError):  # a line cut short by a crash mid-write
            continue
        counts[entry] = counts.get(entry, 0) + 1
    return counts


def clear_in_process() -> None:
    """Forget this process's open maps (the files stay); the next call re-validates and reopens."""
    _OPENED.clear()


def node_cache_info(cache_dir: Path | str | None = None) -> list[dict[str, Any]]:
    """One dict per complete entry: ``name``, ``key``, ``path``, ``bytes`` and the key's ``fields`` (links and
    unreadable entries are left out: they are rebuilt when next used)."""
    root = node_cache_root(cache_dir)
    out: list[dict[str, Any]] = []
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if d.name.startswith(_TMP_PREFIX) or not stat.S_ISDIR(os.lstat(d).st_mode):
            continue
        try:
            with cachefile.open_file(d / META) as f:
                meta = json.loads(f.read())
            files = [os.lstat(p) for p in d.iterdir()]
        except (OSError, ValueError, Unusable):
            continue
        fields = meta.get("key_fields", {}) if isinstance(meta, dict) else {}
        out.append({"name": fields.get("name", d.name.rsplit("-", 1)[0]),
                    "key": d.name.rsplit("-", 1)[-1], "path": d,
                    "bytes": sum(st.st_size for st in files if stat.S_ISREG(st.st_mode)),
                    "fields": fields})
    return out


def clear_node_cache(cache_dir: Path | str | None = None) -> int:
    """Delete every entry (each under its lock, so no build is cut short); return how many were removed.

    Processes that already mapped an entry keep reading it (the files stay alive until unmapped). An
    entry that is a link is removed as a link (its target is left alone).
    """
    root = node_cache_root(cache_dir)
    if not root.is_dir():
        return 0
    n = 0
    for d in sorted(root.iterdir()):
        if d.name.startswith(_TMP_PREFIX) or d.name == BUILD_LOG or d.name.endswith(".lock"):
            continue
        mode = os.lstat(d).st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            continue
        with _locked(root / (d.name + ".lock")):
            cachefile.discard(d)
            _remove_tmp(root, d.name)
        n += 1
    clear_in_process()
    return n


# ---------------------------------------------------------------------------- internals
@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive flock on ``path`` (created if needed, never through a link), held for the ``with`` body."""
    fd = cachefile.open_for_append(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _source_files(cfg: ExperimentConfig) -> dict[str, list[int]]:
    """``path -> [size, mtime_ns]`` of the files the source reports present (its ``files()``)."""
    source = get_source(cfg.data.name)
    root = federation.resolve_root(cfg.data, source)
    out: dict[str, list[int]] = {}
    try:
        statuses = source.files(root)
    except Exception:  # a status helper must never stop a run; no fingerprint then
        return out
    for fs in statuses:
        try:
            st = Path(fs.path).stat()
        except OSError:
            continue
        out[str(fs.path)] = [int(st.st_size), int(st.st_mtime_ns)]
    return out


def _stale(recorded: dict[str, list[int]], now: dict[str, list[int]]) -> bool:
    """A source file present now that differs from (or was absent at) the build; deletions are not staleness."""
    return any(recorded.get(p) != v for p, v in now.items())


def _to_numpy(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(np.asarray(t))


def _concat_natural(nat: dict[str, np.ndarray] | None) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    """A natural split as one int64 array plus its client names and offsets (``offsets[i]:offsets[i+1]``)."""
    if nat is None:
        return None, None
    names = list(nat)
    parts = [np.asarray(nat[n], dtype=np.int64).reshape(-1) for n in names]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return flat, {"names": names, "offsets": offsets.tolist()}


def meta_digest(meta: dict[str, Any]) -> str:
    """The digest ``meta.json`` carries of itself: its canonical JSON without the :data:`META_DIGEST` field."""
    return json_digest({k: v for k, v in meta.items() if k != META_DIGEST})


def _build(cfg: ExperimentConfig, target: Path) -> None:
    """Load via ``load_splits`` and write the entry under a temporary name, then rename it into place.

    Runs under the entry's lock. ``meta.json`` is the last file written, and the folder
    only gets its final name once complete. Each array's digest is taken from the arrays
    as loaded, before they are written.
    """
    root = target.parent
    _remove_tmp(root, target.name)  # leftovers of a builder that crashed (we hold the lock)
    if os.path.lexists(target):  # incomplete, corrupt, altered or stale; the process's own copy may be stale too
        federation.clear_split_cache()
    splits = federation.load_splits(cfg)
    sources = _source_files(cfg)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=root))
    try:
        arrays: dict[str, np.ndarray] = {}
        for k, d in enumerate(splits.domains):
            for part, dd in (("train", splits.train[d]), ("test", splits.test[d])):
                arrays[f"{part}_x_{k}"] = _to_numpy(dd.x)
                arrays[f"{part}_y_{k}"] = _to_numpy(dd.y)
        natural: dict[str, Any] = {}
        for part, nat in (("train", splits.natural_train), ("test", splits.natural_test)):
            flat, index = _concat_natural(nat)
            if flat is not None:
                arrays[f"natural_{part}"] = flat
                natural[part] = index
        digests = cachefile.array_digests(arrays)
        for fname, a in arrays.items():
            np.save(tmp / f"{fname}.npy", a, allow_pickle=False)
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "key_fields": _key_fields(cfg),
            "dataset": splits.dataset,
            "domains": list(splits.domains),
            "num_classes": int(splits.num_classes),
            "input_kind": splits.input_kind,
            "input_shape": [int(s) for s in splits.input_shape],
            "vocab_size": None if splits.vocab_size is None else int(splits.vocab_size),
            "notes": splits.notes,
            "domain_notes": dict(splits.domain_notes),
            "natural": natural,
            "arrays": {f: {"shape": list(a.shape), "dtype": a.dtype.str, "digest": digests[f]}
                       for f, a in arrays.items()},
            "source_files": sources,
        }
        meta = json.loads(json.dumps(meta))  # the digest is of the document as it reads back
        meta[META_DIGEST] = meta_digest(meta)
        with open(tmp / META, "w") as f:  # last: its presence marks a complete folder
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the entry is meant to be read like any data file
        _place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log_build(root, target.name)


def _log_build(root: Path, entry: str) -> None:
    line = (json.dumps({"entry": entry, "pid": os.getpid(), "unix_time": round(time.time(), 3)}) + "\n").encode()
    fd = cachefile.open_for_append(root / BUILD_LOG, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``, first moving a bad existing ``target`` aside (rename cannot replace a full
    dir); a link or file there is removed as such (a link's target is left alone)."""
    if os.path.lexists(target):
        if stat.S_ISDIR(os.lstat(target).st_mode):
            old = target.parent / f"{_TMP_PREFIX}{target.name}-old-{os.getpid()}"
            os.replace(target, old)
            shutil.rmtree(old, ignore_errors=True)  # readers that mapped it keep their pages
        else:
            cachefile.discard(target)
    try:
        os.replace(tmp, target)
    except OSError as e:  # someone placed it meanwhile without our lock (lock file removed by hand)
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_tmp(root: Path, name: str) -> None:
    for p in root.glob(f"{_TMP_PREFIX}{name}-*"):
        cachefile.discard(p)


def _open(target: Path, sources_now: dict[str, list[int]] | None) -> DomainSplits | None:
    """The entry as DomainSplits over copy-on-write maps, checked (module docstring); None when there is no
    entry or it is stale (its source changed: rebuilt without a word), :class:`Unusable` naming the file
    when it is there but damaged, altered, linked or holds a stray file."""
    if not cachefile.check_below(target.parent, target, folder=True):
        return None
    meta_path = target / META
    try:
        with cachefile.open_file(meta_path) as f:
            raw = f.read()
    except FileNotFoundError:
        raise Unusable(meta_path, "is missing: the entry is incomplete") from None
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
        if meta.get("format_version") != FORMAT_VERSION:
            raise Unusable(meta_path, f"is format version {meta.get('format_version')!r}, not {FORMAT_VERSION}: "
                                      "written by an older fedsap_ray, without content digests")
        if meta.get(META_DIGEST) != meta_digest(meta):
            raise Unusable(meta_path, "does not match its meta_digest: it was edited since the entry was built")
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise Unusable(meta_path, f"is not a readable meta.json ({e})") from e
    if sources_now is not None and _stale(meta.get("source_files", {}), sources_now):
        return None
    try:
        specs = meta["arrays"]
        wanted = {META} | {f"{f}.npy" for f in specs}
        present = set(os.listdir(target))
        stray, missing = sorted(present - wanted), sorted(wanted - present)
        if stray:
            raise Unusable(target / stray[0], "was not written by the build (a stray entry)")
        if missing:
            raise Unusable(target / missing[0], "is missing")
        arrays = {f: _map(target / f"{f}.npy", spec) for f, spec in specs.items()}
        cachefile.verify(arrays, {f: spec.get("digest") for f, spec in specs.items()},
                         lambda f: target / f"{f}.npy")
        return _splits(meta, arrays)
    except Unusable:
        raise
    except FileNotFoundError as e:  # a file removed between the listing and the open
        raise Unusable(target, f"changed while it was read ({e})") from e
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise Unusable(meta_path, f"does not describe the entry ({e.__class__.__name__}: {e})") from e


def _splits(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> DomainSplits:
    """DomainSplits over the entry's checked maps, as ``meta.json`` describes them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning)
        tensors = {f: torch.from_numpy(a) for f, a in arrays.items() if not f.startswith("natural_")}

    def domain(part: str, k: int) -> DomainData:
        return DomainData(tensors[f"{part}_x_{k}"], tensors[f"{part}_y_{k}"])

    def natural(part: str) -> dict[str, np.ndarray] | None:
        index = meta["natural"].get(part)
        if index is None:
            return None
        flat, off = arrays[f"natural_{part}"], index["offsets"]
        if len(off) != len(index["names"]) + 1 or off[0] != 0 or off[-1] != len(flat) or \
                any(b < a for a, b in zip(off, off[1:])):
            raise ValueError(f"natural_{part}: offsets do not match the array")
        return {n: flat[off[i]:off[i + 1]] for i, n in enumerate(index["names"])}

    domains = list(meta["domains"])
    return DomainSplits(
        dataset=meta["dataset"],
        domains=domains,
        train={d: domain("train", k) for k, d in enumerate(domains)},
        test={d: domain("test", k) for k, d in enumerate(domains)},
        num_classes=int(meta["num_classes"]),
        input_kind=meta["input_kind"],
        input_shape=tuple(meta["input_shape"]),
        vocab_size=meta["vocab_size"],
        notes=meta["notes"],
        domain_notes=dict(meta["domain_notes"]),
        natural_train=natural("train"),
        natural_test=natural("test"),
    )


def _map(path: Path, spec: dict[str, Any]) -> np.ndarray:
    """Copy-on-write map of one array, never through a link, checked against the shape and dtype in meta.json."""
    a = cachefile.map_npy(path)
    if list(a.shape) != list(spec["shape"]) or a.dtype.str != spec["dtype"]:
        raise Unusable(path, f"holds {a.dtype.str} {list(a.shape)}, meta.json says {spec['dtype']} {spec['shape']}")
    return a
