"""The fuzz harness over the data caches (issue 52): Hypothesis tampers with a node-cache entry and with an
``.npz`` cache in random ways (flipped, zeroed, appended and cut bytes; arrays rewritten as valid files with
other numbers, rows or order; ``meta.json`` fields replaced by other JSON; links to altered or identical
copies elsewhere, for a file or the whole entry; stray files, folders, FIFOs and links; files removed or
swapped; members added, removed or rewritten), one to three acts an example. Each time the data a run
gets must equal the intact data (the cache rebuilt), and no link's target is changed; a hang fails the
example, named.

Derandomized and bounded (the fast tier runs ``FEDSAP_FUZZ_EXAMPLES`` examples of each, default 60, in
seconds); to search further: ``FEDSAP_FUZZ_EXAMPLES=800 FEDSAP_FUZZ_SEED=11 python -m pytest
tests/data/test_cache_fuzz.py``. The enumerated cases of the audit are in ``test_cache_tamper.py``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from fedsap_ray.data import cachefile, digits, federation, node_cache
from tests.data.cachekit import (
    assert_same_splits, blob_cfg, npy_array, npy_bytes, read_members, tiny_blobs, tree_bytes, write_members,
)

EXAMPLES = int(os.environ.get("FEDSAP_FUZZ_EXAMPLES", "60"))
SEED = os.environ.get("FEDSAP_FUZZ_SEED")
FUZZ = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=SEED is None)
PER_EXAMPLE_S = 30


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so no ``except Exception`` of the code under test hides it."""


@contextlib.contextmanager
def alarm(seconds: int):
    def ring(signum, frame):
        raise Hang(f"no answer within {seconds} s (a FIFO or a link opened and waited on?)")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def seeded(f):
    return seed(int(SEED))(f) if SEED is not None else f


# ---------------------------------------------------------------------------- acts on files
BYTE_ACTS = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.integers(0, 1 << 20), min_size=1, max_size=64)),
    st.tuples(st.just("zero"), st.integers(0, 1 << 20), st.integers(1, 512)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=32)),
    st.tuples(st.just("cut"), st.floats(0.0, 0.999)),
)


def regular(p: Path) -> bool:
    """A regular file, not a link (an earlier act may have left a link, a folder or a FIFO: never opened)."""
    return not p.is_symlink() and p.is_file()


def copy_entry(src: str, dst: str) -> None:
    """``shutil.copytree``'s copy of one entry that makes a FIFO anew instead of opening it (it would wait)."""
    if stat.S_ISFIFO(os.lstat(src).st_mode):
        os.mkfifo(dst)
    else:
        shutil.copy2(src, dst)


def apply_bytes(path: Path, act: tuple) -> None:
    if not regular(path):
        return
    data = bytearray(path.read_bytes())
    kind = act[0]
    if kind == "flip" and data:
        for p in act[1]:
            data[p % len(data)] ^= 0xA5
    elif kind == "zero" and data:
        start = act[1] % len(data)
        data[start:start + act[2]] = bytes(len(data[start:start + act[2]]))
    elif kind == "append":
        data += act[1]
    elif kind == "cut":
        data = data[:int(len(data) * act[1])]
    path.write_bytes(bytes(data))


ARRAY_ACTS = st.sampled_from(["relabel", "zeros", "reverse", "roll", "negate", "drop_rows", "one_value"])


def change_array(a: np.ndarray, act: str) -> np.ndarray:
    """A valid array of other numbers (same shape and dtype except ``drop_rows``)."""
    if act == "relabel":
        return (a + 1) % 10 if a.dtype.kind in "iu" else a + 1
    if act == "zeros":
        return np.zeros_like(a)
    if act == "reverse":
        return a[::-1].copy() if len(a) > 1 else a + 1
    if act == "roll":
        return np.roll(a, 1, axis=0) if len(a) > 1 else a + 1
    if act == "negate":
        return -a if a.dtype.kind in "if" else a ^ 1
    if act == "drop_rows":
        return a[1:]
    out = a.copy()
    out.reshape(-1)[:1] = out.reshape(-1)[:1] + 1 if out.size else out.reshape(-1)[:1]
    return out


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-3, 70) | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=6)
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.0123456789", min_size=1, max_size=12).filter(
    lambda n: n not in (".", ".."))


# ---------------------------------------------------------------------------- the node cache
@pytest.fixture(scope="module")
def node_template(tmp_path_factory):
    """An intact entry of the tiny generated dataset (copied for every example) and the splits it holds."""
    with tiny_blobs():
        cfg = blob_cfg()
        base = tmp_path_factory.mktemp("node_template")
        node_cache.shared_splits(cfg, base / "nc")
        node_cache.clear_in_process()
        entry = node_cache.entry_dir(cfg, base / "nc")
        files = sorted(p.name for p in entry.iterdir())
        yield cfg, federation.load_splits(cfg), base / "nc", entry.name, files
    node_cache.clear_in_process()


def node_acts(files: list[str]):
    arrays = [f for f in files if f.endswith(".npy")]
    target = st.sampled_from(files)
    return st.one_of(
        st.tuples(st.just("bytes"), target, BYTE_ACTS),
        st.tuples(st.just("array"), st.sampled_from(arrays), ARRAY_ACTS, st.booleans()),
        st.tuples(st.just("meta"), st.sampled_from(["domains", "notes", "num_classes", "input_shape", "natural",
                                                    "arrays", "dataset", "domain_notes", "vocab_size", "input_kind",
                                                    "key_fields", "source_files", "format_version", "extra"]),
                  JSON_VALUES),
        st.tuples(st.just("link"), st.sampled_from([*files, ""]), st.one_of(st.none(), BYTE_ACTS)),
        st.tuples(st.just("stray"), NAMES, st.sampled_from(["file", "folder", "fifo", "link"])),
        st.tuples(st.just("remove"), target),
        st.tuples(st.just("swap"), st.sampled_from(arrays), st.sampled_from(arrays)),
        st.tuples(st.just("replace_kind"), st.sampled_from([*files, ""]), st.sampled_from(["folder", "fifo", "file"])),
    )


def apply_node(entry: Path, elsewhere: Path, act: tuple) -> None:
    kind = act[0]
    if not entry.is_dir() or entry.is_symlink():
        return  # an earlier act replaced the entry
    if kind == "bytes":
        if (entry / act[1]).is_file():
            apply_bytes(entry / act[1], act[2])
    elif kind == "array":
        p = entry / act[1]
        if not regular(p):
            return
        try:
            a = change_array(np.load(p, allow_pickle=False), act[2])
        except Exception:  # an earlier act left it unreadable (numpy raises many kinds), or took it away
            return
        np.save(p, a)
        if act[3] and regular(entry / "meta.json"):  # meta.json made to agree with the new shape (digests left)
            try:
                meta = json.loads((entry / "meta.json").read_text())
                meta["arrays"][act[1][:-4]]["shape"] = list(a.shape)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return
            (entry / "meta.json").write_text(json.dumps(meta))
    elif kind == "meta":
        p = entry / "meta.json"
        if not regular(p):
            return
        try:
            meta = json.loads(p.read_text())
            meta[act[1]] = act[2]
            p.write_text(json.dumps(meta))
        except (OSError, ValueError, TypeError):
            pass
    elif kind == "link":
        p = entry / act[1] if act[1] else entry
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            return
        elsewhere.mkdir(parents=True, exist_ok=True)
        copy = elsewhere / f"{len(list(elsewhere.iterdir()))}-{p.name}"
        if p.is_dir():
            shutil.copytree(p, copy, symlinks=True, copy_function=copy_entry)
            shutil.rmtree(p)
            if act[2] is not None:
                apply_bytes(copy / "train_y_0.npy", act[2])
        else:
            shutil.copy2(p, copy)
            p.unlink()
            if act[2] is not None:
                apply_bytes(copy, act[2])
        p.symlink_to(copy)
    elif kind == "stray":
        p = entry / act[1]
        if os.path.lexists(p):
            return
        if act[2] == "file":
            p.write_bytes(b"stray")
        elif act[2] == "folder":
            p.mkdir()
        elif act[2] == "fifo":
            os.mkfifo(p)
        else:
            elsewhere.mkdir(parents=True, exist_ok=True)
            (elsewhere / "stray-target").write_bytes(b"outside")
            p.symlink_to(elsewhere / "stray-target")
    elif kind == "remove":
        if os.path.lexists(entry / act[1]):
            cachefile.discard(entry / act[1])
    elif kind == "swap":
        a, b = entry / act[1], entry / act[2]
        if a != b and regular(a) and regular(b):
            os.replace(a, entry / ".swap")
            os.replace(b, a)
            os.replace(entry / ".swap", b)
    elif kind == "replace_kind":
        p = entry / act[1] if act[1] else entry
        cachefile.discard(p)
        if act[2] == "folder":
            p.mkdir()
        elif act[2] == "fifo":
            os.mkfifo(p)
        else:
            p.write_bytes(b"not what was there")


@seeded
@settings(max_examples=EXAMPLES, **FUZZ)
@given(data=st.data())
def test_fuzz_node_cache_gives_the_intact_data(node_template, data):
    cfg, intact, template, entry_name, files = node_template
    acts = data.draw(st.lists(node_acts(files), min_size=1, max_size=3), label="acts")
    work = Path(tempfile.mkdtemp(prefix="cache-fuzz-"))
    try:
        cache, elsewhere = work / "nc", work / "elsewhere"
        shutil.copytree(template, cache, symlinks=True)
        node_cache.clear_in_process()
        with tiny_blobs(), alarm(PER_EXAMPLE_S):
            for act in acts:
                apply_node(cache / entry_name, elsewhere, act)
            outside = tree_bytes(elsewhere) if elsewhere.exists() else {}
            splits = node_cache.shared_splits(cfg, cache)
            assert_same_splits(intact, splits)
        assert (tree_bytes(elsewhere) if elsewhere.exists() else {}) == outside
        assert not (cache / entry_name).is_symlink()
    finally:
        node_cache.clear_in_process()
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------- an .npz cache (the rendered digits)
def render(n: int, seed_: int):
    rng = np.random.default_rng(seed_)
    return rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), (np.arange(n) % 10).astype(np.int64)


NPZ_ACTS = st.one_of(
    st.tuples(st.just("bytes"), BYTE_ACTS),
    st.tuples(st.just("member"), st.sampled_from(["x", "y"]), ARRAY_ACTS),
    st.tuples(st.just("digests"), st.sampled_from(["garbage", "other", "drop", "swap"])),
    st.tuples(st.just("stray_member"), NAMES),
    st.tuples(st.just("link"), st.booleans(), st.one_of(st.none(), BYTE_ACTS)),
    st.tuples(st.just("replace_kind"), st.sampled_from(["folder", "fifo", "file"])),
    st.tuples(st.just("folder_link"), st.booleans()),
)


def apply_npz(path: Path, elsewhere: Path, act: tuple) -> None:
    kind = act[0]
    if path.parent.is_symlink() or path.is_symlink() or not path.is_file():
        return  # an earlier act linked or replaced it
    if kind == "bytes":
        apply_bytes(path, act[1])
        return
    try:
        members = read_members(path)
    except Exception:  # an earlier act left no zip: the byte acts still apply
        return
    digests = cachefile.DIGESTS + ".npy"
    if kind == "member":
        name = act[1] + ".npy"
        if name in members:
            members[name] = npy_bytes(change_array(npy_array(members[name]), act[2]))
    elif kind == "digests" and digests in members:
        if act[1] == "garbage":
            members[digests] = npy_bytes(np.frombuffer(b"not json", np.uint8))
        elif act[1] == "other":
            try:
                doc = json.loads(npy_array(members[digests]).tobytes())
                doc["x"] = doc.get("y")
            except (ValueError, TypeError, AttributeError):  # an earlier act left it unreadable
                return
            members[digests] = npy_bytes(np.frombuffer(json.dumps(doc).encode(), np.uint8))
        elif act[1] == "drop":
            del members[digests]
        else:
            members["x.npy"], members["y.npy"] = members["y.npy"], members["x.npy"]
    elif kind == "stray_member":
        members[act[1] + ".npy"] = npy_bytes(np.arange(3))
    elif kind == "link":
        elsewhere.mkdir(parents=True, exist_ok=True)
        copy = elsewhere / f"{len(list(elsewhere.iterdir()))}-{path.name}"
        shutil.copy2(path, copy)
        if act[2] is not None:
            apply_bytes(copy, act[2])
        elif act[1]:  # a valid zip with other labels, digests as they were
            m = read_members(copy)
            m["y.npy"] = npy_bytes((npy_array(m["y.npy"]) + 1) % 10)
            write_members(copy, m)
        path.unlink()
        path.symlink_to(copy)
        return
    elif kind == "replace_kind":
        path.unlink()
        if act[1] == "folder":
            path.mkdir()
        elif act[1] == "fifo":
            os.mkfifo(path)
        else:
            path.write_bytes(b"PK not a zip")
        return
    elif kind == "folder_link":
        folder = path.parent
        elsewhere.mkdir(parents=True, exist_ok=True)
        copy = elsewhere / f"{len(list(elsewhere.iterdir()))}-{folder.name}"
        shutil.copytree(folder, copy, symlinks=True, copy_function=copy_entry)
        if act[1]:
            m = read_members(copy / path.name)
            m["y.npy"] = npy_bytes((npy_array(m["y.npy"]) + 1) % 10)
            write_members(copy / path.name, m)
        shutil.rmtree(folder)
        folder.symlink_to(copy)
        return
    write_members(path, members)


@pytest.fixture(scope="module")
def npz_template(tmp_path_factory):
    base = tmp_path_factory.mktemp("npz_template")
    (tr, te) = digits.rendered_splits(render, 10, 4, 3, cache_dir=base / "cache")
    return base / "cache", (tr, te)


@seeded
@settings(max_examples=EXAMPLES, **FUZZ)
@given(acts=st.lists(NPZ_ACTS, min_size=1, max_size=3))
def test_fuzz_npz_cache_gives_the_intact_data(npz_template, acts):
    template, ((xtr, ytr), (xte, yte)) = npz_template
    work = Path(tempfile.mkdtemp(prefix="cache-fuzz-"))
    try:
        cache, elsewhere = work / "cache", work / "elsewhere"
        shutil.copytree(template, cache, symlinks=True)
        path = next((cache / "rendered").glob("*.npz"))
        with alarm(PER_EXAMPLE_S):
            for act in acts:
                apply_npz(path, elsewhere, act)
            outside = tree_bytes(elsewhere) if elsewhere.exists() else {}
            (a, b), (c, d) = digits.rendered_splits(render, 10, 4, 3, cache_dir=cache)
        for got, want in ((a, xtr), (b, ytr), (c, xte), (d, yte)):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        assert (tree_bytes(elsewhere) if elsewhere.exists() else {}) == outside
        assert not path.is_symlink() and not path.parent.is_symlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
