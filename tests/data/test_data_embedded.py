"""The embedded_digits benchmark and its renderers: format, determinism, cache, domain shift."""
from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fedsap_ray.data import cachefile, embedded
from fedsap_ray.data.registry import dataset_names, get_source
from fedsap_ray.data.render import digit_fonts, render_street_digits, render_synth_digits

EXPECTED = {"mnist": (4000, 1000), "uci_digits": (1437, 360), "street": (4000, 1000), "synth": (4000, 1000)}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """A cold build into a fresh root (the first of the two that test_two_cold_builds_are_byte_identical compares)."""
    root = tmp_path_factory.mktemp("fedsap_embedded_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSAP_RAY_CACHE", str(root))
        src = get_source("embedded_digits")
        assert src.default_root() == root
        splits = src.load(src.default_root(), download=False, seed=123)
    return root, splits


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------- renderers
@pytest.mark.parametrize("fn", [render_street_digits, render_synth_digits])
def test_renderer_format_deterministic_prefix_stable(fn):
    x, y = fn(520, seed=7)
    assert x.shape == (520, 3, 32, 32) and x.dtype == np.uint8 and x.flags.c_contiguous
    assert y.dtype == np.int64 and set(np.unique(y)) == set(range(10))
    assert np.bincount(y[:500]).tolist() == [50] * 10  # every full chunk is class-balanced
    x3, y3 = fn(120, seed=7)  # a second call, and prefix-stable: same first images whatever n is
    assert np.array_equal(x[:120], x3) and np.array_equal(y[:120], y3)
    x4, _ = fn(120, seed=8)
    assert not np.array_equal(x3, x4)
    assert x.std() > 20  # real images, not blanks


def test_renderer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n must be"):
        render_street_digits(-1, 0)
    with pytest.raises(ValueError, match="seed must be"):
        render_synth_digits(10, -3)
    x, y = render_synth_digits(0, 0)
    assert x.shape == (0, 3, 32, 32) and y.shape == (0,)


def test_digit_fonts_are_bundled_and_render_digits():
    fonts = digit_fonts()
    assert len(fonts) >= 10
    names = {p.name for p in fonts}
    assert "DejaVuSans.ttf" in names and "LastResortHE-Regular.ttf" not in names and "cmsy10.ttf" not in names


def test_street_digit_is_centred_and_contrasts_with_background():
    """The labelled digit sits in the centre: the centre columns differ more from the border than corners do."""
    x, _ = render_street_digits(500, seed=3)
    g = x.astype(np.float32).mean(1)
    border = np.concatenate([g[:, 0, :], g[:, -1, :]], 1).mean(1, keepdims=True)
    centre_dev = np.abs(g[:, 8:24, 12:20] - border[:, :, None]).mean()
    corner_dev = np.abs(g[:, :4, :4] - border[:, :, None]).mean()
    assert centre_dev > 2 * corner_dev


# ---------------------------------------------------------------------------- the dataset
def test_registered_with_honest_notes(built):
    _, s = built
    assert "embedded_digits" in dataset_names()
    assert s.dataset == "embedded_digits" and s.domains == list(EXPECTED)
    assert "NOT the real Digits" in s.notes
    assert "SVHN" in s.domain_notes["street"] and "RENDERED" in s.domain_notes["street"]
    assert "SynthDigits" in s.domain_notes["synth"] and "RENDERED" in s.domain_notes["synth"]
    assert "real" in s.domain_notes["mnist"] and "real" in s.domain_notes["uci_digits"]
    assert embedded.__doc__ and "stand-in for SVHN" in embedded.__doc__


def test_shapes_dtypes_classes(built):
    _, s = built
    assert s.num_classes == 10 and s.input_kind == "image" and s.input_shape == (3, 32, 32)
    for d, (ntr, nte) in EXPECTED.items():
        for part, n in (("train", ntr), ("test", nte)):
            dd = getattr(s, part)[d]
            assert tuple(dd.x.shape) == (n, 3, 32, 32), (d, part)
            assert str(dd.x.dtype) == "torch.uint8" and str(dd.y.dtype) == "torch.int64"
            counts = np.bincount(dd.y.numpy(), minlength=10)
            assert len(counts) == 10 and counts.min() > 0, (d, part, counts)
        # stratified 20%: every class's test share is close to 0.2
        tr = np.bincount(s.train[d].y.numpy(), minlength=10)
        te = np.bincount(s.test[d].y.numpy(), minlength=10)
        assert np.all(np.abs(te / (tr + te) - 0.2) < 0.02), d


def test_split_is_a_partition_of_the_source(built):
    """Real domains: train + test are exactly the source images (multiset). Rendered: disjoint, complete counts."""
    _, s = built

    def keys(x, y):
        return Counter(xi.tobytes() + bytes([yi]) for xi, yi in zip(x, y))

    for d, make in {"mnist": embedded._mnist, "uci_digits": embedded._uci_digits}.items():
        x, y = make()
        tr, te = keys(s.train[d].x.numpy(), s.train[d].y.numpy()), keys(s.test[d].x.numpy(), s.test[d].y.numpy())
        assert tr + te == keys(x, y), d
        if max(tr.values()) == 1 and max(te.values()) == 1:
            assert not (set(tr) & set(te)), d
    for d in ("street", "synth"):  # continuous random styles: no two rendered images coincide
        tr, te = keys(s.train[d].x.numpy(), s.train[d].y.numpy()), keys(s.test[d].x.numpy(), s.test[d].y.numpy())
        assert len(tr) == 4000 and len(te) == 1000 and not (set(tr) & set(te)), d
        y = np.concatenate([s.train[d].y.numpy(), s.test[d].y.numpy()])
        assert np.bincount(y).tolist() == [500] * 10, d
    x, y = render_synth_digits(40, 0)  # and they are the renderer's images with its labels
    assert set(keys(x, y)) <= set(keys(s.train["synth"].x.numpy(), s.train["synth"].y.numpy())) | set(
        keys(s.test["synth"].x.numpy(), s.test["synth"].y.numpy()))


def test_domains_differ_in_appearance(built):
    """Simple colour/contrast statistics identify the domain: a real appearance shift."""
    from sklearn.linear_model import LogisticRegression

    _, s = built

    def stats(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32) / 255
        sat = (x.max(1) - x.min(1)).mean((1, 2))
        border = np.concatenate([x[:, :, 0, :], x[:, :, -1, :]], 2).mean((1, 2))
        grad = np.abs(np.diff(x, axis=3)).mean((1, 2, 3))
        return np.stack([sat, x.mean((1, 2, 3)), x.std((1, 2, 3)), grad, border], 1)

    feats = {d: stats(s.train[d].x.numpy()[:1000]) for d in EXPECTED}
    assert feats["mnist"][:, 0].max() == 0 and feats["uci_digits"][:, 0].max() == 0  # grey
    assert feats["street"][:, 0].mean() > 0.1 and feats["synth"][:, 0].mean() > 0.1  # colour
    assert feats["mnist"][:, 4].mean() < 0.02 < 0.1 < feats["uci_digits"][:, 4].mean()  # black frame vs filled 8x8
    X = np.concatenate(list(feats.values()))
    y = np.repeat(np.arange(4), [len(f) for f in feats.values()])
    Xt = np.concatenate([stats(s.test[d].x.numpy()[:300]) for d in EXPECTED])
    yt = np.repeat(np.arange(4), [min(300, len(s.test[d])) for d in EXPECTED])
    clf = LogisticRegression(max_iter=2000).fit((X - X.mean(0)) / X.std(0), y)
    assert clf.score((Xt - X.mean(0)) / X.std(0), yt) > 0.85  # 0.91 at the time of writing


def test_cache_reused_without_rebuilding(built, monkeypatch):
    root, s = built
    path = root / embedded.CACHE_FILE
    mtime = path.stat().st_mtime_ns
    monkeypatch.setattr(embedded, "build_arrays", lambda: pytest.fail("cache was rebuilt"))
    s2 = get_source("embedded_digits").load(root, download=False, seed=5)  # the run seed does not matter
    assert path.stat().st_mtime_ns == mtime
    for d in EXPECTED:
        assert np.array_equal(s2.train[d].x.numpy(), s.train[d].x.numpy())
    st = get_source("embedded_digits").files(root)
    assert len(st) == 1 and st[0].present and st[0].path == path
    assert not get_source("embedded_digits").files(root / "nowhere")[0].present


def test_two_cold_builds_are_byte_identical(built, tmp_path, monkeypatch):
    root, _ = built
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(tmp_path))
    src = get_source("embedded_digits")
    src.load(src.default_root(), download=False, seed=0)
    assert _sha(tmp_path / embedded.CACHE_FILE) == _sha(root / embedded.CACHE_FILE)
    assert [p.name for p in tmp_path.iterdir()] == [embedded.CACHE_FILE]  # no temp file left behind


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped"])
def test_corrupt_cache_is_rebuilt(built, tmp_path, monkeypatch, damage):
    root, _ = built
    good = (root / embedded.CACHE_FILE).read_bytes()
    bad = {"garbage": b"not a zip file",
           "truncated": good[: len(good) // 2],
           "flipped": good[:5000] + bytes([good[5000] ^ 0xFF]) + good[5001:]}[damage]
    path = tmp_path / embedded.CACHE_FILE
    path.write_bytes(bad)
    # rebuild with a small stand-in build so the test stays fast; the real build is tested above
    real = embedded.read_cache(root / embedded.CACHE_FILE)
    small = {k: (v[:20] if k != "meta" else v) for k, v in real.items()}
    monkeypatch.setattr(embedded, "build_arrays", lambda: small)
    with pytest.warns(cachefile.CacheRebuilt, match=f"{embedded.CACHE_FILE}.*rebuilt it"):
        s = get_source("embedded_digits").load(tmp_path, download=False, seed=0)
    assert len(s.train["street"]) == 20
    again = embedded.read_cache(path)
    assert again is not None and np.array_equal(again["synth_x_test"], small["synth_x_test"])


def test_unwritable_cache_warns_and_still_loads(built, tmp_path, monkeypatch):
    root, _ = built
    real = embedded.read_cache(root / embedded.CACHE_FILE)
    monkeypatch.setattr(embedded, "build_arrays", lambda: {k: (v[:10] if k != "meta" else v) for k, v in real.items()})

    def refuse(path, arrays):
        raise PermissionError("read-only")

    monkeypatch.setattr(embedded, "_write_npz_atomic", refuse)
    with pytest.warns(RuntimeWarning, match="could not write the cache"):
        s = get_source("embedded_digits").load(tmp_path, download=False, seed=0)
    assert len(s.test["mnist"]) == 10 and not os.listdir(tmp_path)
