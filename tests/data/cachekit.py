"""Helpers of the cache tamper tests and the cache fuzz (tests/data/test_cache_tamper.py, test_cache_fuzz.py):
tiny datasets for the node cache, raw rewrites of cache files that leave their digests as they were (what
an edit by hand, a bad copy or a careless script does), and the comparisons a tampered cache must pass
(the data and a tiny run's tables equal the intact ones) or the refusal it may end in."""
from __future__ import annotations

import io
import json
import os
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedsap_ray import results
from fedsap_ray.dev import golden
from fedsap_ray.config import build_config
from fedsap_ray.data import federation, generated, registry
from fedsap_ray.data.base import DomainData, Federation
from fedsap_ray.data.cachefile import CacheRebuilt
from fedsap_ray.data.registry import DomainSplits, FileStatus
from fedsap_ray.data.status import unavailable
from fedsap_ray.experiment import run_experiment

TINY = ["algorithm.name=fedavg", "data.num_clients=4", "data.max_test_per_domain=40", "model.width_mult=0.0625",
        "training.local_epochs=1", "training.batch_size=16", "training.max_steps_per_epoch=3", "training.rounds=3"]
BLOBS = [*TINY, "data.name=generated_blobs", "model.name=mlp", "data.partition=iid"]
BLOB_TRAIN, BLOB_TEST = 48, 16  # per domain: a node-cache entry of a few kilobytes
_DRAW = generated.draw  # the real draw, whatever is patched later


@contextmanager
def tiny_blobs() -> Iterator[None]:
    """``generated_blobs`` drawn at :data:`BLOB_TRAIN` / :data:`BLOB_TEST` samples a domain (its real draw is
    500,000 samples); the in-process split cache is cleared on the way in and out, so neither size leaks."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generated, "draw", lambda: _DRAW(BLOB_TRAIN, BLOB_TEST))
        federation.clear_split_cache()
        try:
            yield
        finally:
            federation.clear_split_cache()


def sets(overrides: list[str]) -> list[str]:
    """``--set`` arguments for ``overrides``."""
    return [a for o in overrides for a in ("--set", o)]


def blob_cfg():
    return build_config(preset="smoke", overrides=BLOBS)


class TinyText:
    """A single-domain text source with natural clients, read from ``<root>/source.txt`` (an integer that
    shifts the data): it stands in for ``shakespeare`` (natural splits, so ``meta.json``'s offsets matter) and
    its file can be deleted, so a cache whose source is gone can be tried."""

    name = "shakespeare"
    single_domain = natural_partition = True
    description = "tiny text, made by the tests"
    how_to_obtain = "made by the tests"

    def default_root(self) -> Path:
        raise AssertionError("the tests always pass data.root")

    def files(self, root: Path) -> list[FileStatus]:
        p = Path(root) / "source.txt"
        return [FileStatus("tiny text", p, p.is_file())]

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits:
        p = Path(root) / "source.txt"
        if not p.is_file():
            raise unavailable("shakespeare", [("tiny text", p, "made by the tests")])
        rng = np.random.default_rng((seed, int(p.read_text())))

        def dd(n: int) -> DomainData:
            return DomainData(torch.from_numpy(rng.integers(0, 30, (n, 8))), torch.from_numpy(rng.integers(0, 30, n)))

        perm = rng.permutation(60)
        return DomainSplits(
            dataset="tiny_text", domains=["plays"], train={"plays": dd(60)}, test={"plays": dd(20)},
            num_classes=30, input_kind="text", input_shape=(8,), vocab_size=30, notes="tiny text",
            domain_notes={"plays": "made up"},
            natural_train={"HAMLET": perm[:30], "OPHELIA": perm[30:45], "YORICK": perm[45:]},
            natural_test={"HAMLET": np.arange(0, 12), "OPHELIA": np.arange(12, 20)},
        )


@contextmanager
def tiny_text(root: Path) -> Iterator[Path]:
    """:class:`TinyText` registered as ``shakespeare`` with its file under ``root``; yields the root."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "source.txt").write_text("3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry._SOURCES, "shakespeare", TinyText)
        federation.clear_split_cache()
        try:
            yield root
        finally:
            federation.clear_split_cache()


def text_cfg(root: Path):
    return build_config(preset="smoke", overrides=[
        *TINY, "data.name=shakespeare", "data.partition=natural", f"data.root={root}", "data.num_clients=2",
        "model.name=char_lstm", "data.max_test_per_domain=null"])


# ---------------------------------------------------------------------------- raw rewrites (digests untouched)
def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def npy_array(b: bytes) -> np.ndarray:
    return np.lib.format.read_array(io.BytesIO(b), allow_pickle=False)


def read_members(path: Path) -> dict[str, bytes]:
    """Every member of an ``.npz`` as raw bytes, by name (``x.npy``), in the file's order."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def write_members(path: Path, members: dict[str, bytes], *, deflate: bool = False) -> None:
    """An ``.npz`` of exactly ``members`` (valid CRCs: zip's own check sees nothing wrong)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)


def edit_member(path: Path, name: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """Rewrite one array of the ``.npz`` at ``path`` as ``change`` makes it, leaving every other member as it
    was (its digests too)."""
    members = read_members(path)
    members[name + ".npy"] = npy_bytes(change(npy_array(members[name + ".npy"])))
    write_members(path, members)


def edit_meta(entry: Path, change: Callable[[dict], None]) -> None:
    """Edit a node-cache entry's ``meta.json`` in place (its digests are left as they were)."""
    meta = json.loads((entry / "meta.json").read_text())
    change(meta)
    (entry / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def rewrite_npy(path: Path, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """Rewrite an ``.npy`` file with ``change`` applied (a valid file: only its digest can tell)."""
    a = np.load(path, allow_pickle=False)
    np.save(path, np.ascontiguousarray(change(np.array(a))), allow_pickle=False)


def flip_bytes(path: Path, positions: list[int], start: int = 0) -> None:
    """XOR 0xFF into the bytes of ``path`` at ``start + p`` for each ``p`` (modulo what lies past ``start``)."""
    data = bytearray(path.read_bytes())
    span = len(data) - start
    for p in positions:
        data[start + p % span] ^= 0xFF
    path.write_bytes(bytes(data))


def npy_data_offset(path: Path) -> int:
    """Where an ``.npy`` file's array bytes start (after its header)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f) if version == (1, 0) else np.lib.format.read_array_header_2_0(f)
        return f.tell()


def link_to_altered_copy(path: Path, elsewhere: Path, alter: Callable[[Path], None]) -> Path:
    """Replace ``path`` (a file or a folder) by a symbolic link to an altered copy of it under ``elsewhere``;
    returns the copy (whose bytes the cache must never change)."""
    elsewhere.mkdir(parents=True, exist_ok=True)
    copy = elsewhere / path.name
    if path.is_dir():
        shutil.copytree(path, copy)
        shutil.rmtree(path)
    else:
        shutil.copy2(path, copy)
        path.unlink()
    alter(copy)
    path.symlink_to(copy)
    return copy


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """Every regular file under ``folder`` (links not followed), by relative path: what must stay unchanged."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = Path(dirpath) / f
            if not p.is_symlink() and p.is_file():
                out[str(p.relative_to(folder))] = p.read_bytes()
    return out


# ---------------------------------------------------------------------------- what must hold afterwards
@contextmanager
def one_rebuild_line(path_part: str | None) -> Iterator[None]:
    """The body emits exactly one :class:`CacheRebuilt` warning, one line naming ``path_part`` (None: none)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    lines = [str(w.message) for w in seen if issubclass(w.category, CacheRebuilt)]
    if path_part is None:
        assert lines == [], lines
    else:
        assert len(lines) == 1 and "\n" not in lines[0] and path_part in lines[0] and "rebuilt" in lines[0], lines


def assert_same_splits(a: DomainSplits, b: DomainSplits) -> None:
    for f in ("dataset", "domains", "num_classes", "input_kind", "vocab_size", "notes", "domain_notes"):
        assert getattr(a, f) == getattr(b, f), f
    assert tuple(a.input_shape) == tuple(b.input_shape)
    for part in ("train", "test"):
        for d in a.domains:
            x, y = getattr(a, part)[d], getattr(b, part)[d]
            assert x.x.dtype == y.x.dtype and x.y.dtype == y.y.dtype, (part, d)
            assert np.array_equal(x.x.numpy(), y.x.numpy()) and np.array_equal(x.y.numpy(), y.y.numpy()), (part, d)
    for part in ("natural_train", "natural_test"):
        na, nb = getattr(a, part), getattr(b, part)
        assert (na is None) == (nb is None), part
        if na is not None:
            assert list(na) == list(nb), part
            for k in na:
                assert np.array_equal(na[k], nb[k]) and np.asarray(nb[k]).dtype == np.int64, (part, k)


def assert_same_federation(a: Federation, b: Federation) -> None:
    assert (a.dataset, a.domains, a.num_classes, a.input_shape, a.notes) == (b.dataset, b.domains, b.num_classes,
                                                                            b.input_shape, b.notes)
    for part in ("train", "test"):
        for d in a.domains:
            pa, pb = getattr(a, part)[d], getattr(b, part)[d]
            assert np.array_equal(pa.x.numpy(), pb.x.numpy()) and np.array_equal(pa.y.numpy(), pb.y.numpy()), (part, d)
    assert [(c.domain, c.indices.tolist(), c.label_counts.tolist(), c.tv_distance) for c in a.clients] == \
           [(c.domain, c.indices.tolist(), c.label_counts.tolist(), c.tv_distance) for c in b.clients]


def run_tables(cfg, out: Path, fed: Federation | None = None) -> dict[str, pd.DataFrame]:
    """A run's tables (every column the golden check compares), from ``run_experiment`` on ``fed``."""
    run_experiment(cfg, out, run_id="t", federation=fed)
    res = results.load(out)
    tabs = {}
    for t in golden.TABLES:
        df = getattr(res, t, None)
        if df is None or not len(df):
            continue
        df = df[[c for c in df.columns if c not in golden.DROP]].copy()
        for c in df.columns:
            if df[c].dtype == object:
                df[c] = [json.dumps(np.asarray(v).tolist()) if isinstance(v, (list, tuple, np.ndarray)) else v
                         for v in df[c]]
        keys = [k for k in golden.SORT_KEYS if k in df.columns]
        tabs[t] = df.sort_values(keys, kind="mergesort").reset_index(drop=True) if keys else df
    return tabs


def assert_same_tables(a: dict[str, pd.DataFrame], b: dict[str, pd.DataFrame]) -> None:
    assert sorted(a) == sorted(b)
    for t in a:
        pd.testing.assert_frame_equal(a[t], b[t], check_exact=True, obj=t)
