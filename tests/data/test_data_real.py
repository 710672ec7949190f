"""Real dataset sources: the shared files, the standard (torchvision/LEAF/image-folder) layouts
built as tiny fakes, and the missing-file errors.

Shared files are read from ``$FEDSAP_SHARED_DATA`` or ``<repo>/../shared/data``; a test that
needs a missing file skips with the path it looked at.
"""
from __future__ import annotations

import bz2
import io
import json
import pickle
import sys
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fedsap_ray.data  # noqa: F401  (registers every source)
from conftest import REPO, SHARED_DATA as SHARED
from conftest import shared_file
from fedsap_ray.data import cifar as cifar_mod
from fedsap_ray.data import digits as digits_mod
from fedsap_ray.data import shakespeare as shk
from fedsap_ray.data.office import OFFICE_DOMAINS, standardise_surf
from fedsap_ray.data.registry import DatasetUnavailable, dataset_names, get_source
from fedsap_ray.data.status import atomic_save_npz, data_home, dataset_table, shared_data_root

MINE = ("digits", "digits_offline", "office_caltech", "cifar10", "emnist", "shakespeare")


need = shared_file  # skips the test, naming the path, when the real file is absent


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fedsap_cache")


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch: pytest.MonkeyPatch, session_cache: Path) -> None:
    """Never write into the user's ~/.cache; one cache per test session keeps decodes shared."""
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(session_cache))


# ----------------------------------------------------------------------------- registry, roots, errors
def test_all_real_sources_registered_with_docs() -> None:
    names = set(dataset_names())
    for name in MINE:
        assert name in names
        src = get_source(name)
        assert src.name == name and src.description and src.how_to_obtain


def test_default_roots_follow_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FEDSAP_RAY_DATA", str(tmp_path / "d"))
    monkeypatch.setenv("FEDSAP_SHARED_DATA", str(tmp_path / "empty_shared"))  # holds nothing: data_home wins
    for name in ("digits", "office_caltech", "cifar10", "emnist", "shakespeare"):
        assert get_source(name).default_root() == tmp_path / "d" / name
    monkeypatch.delenv("FEDSAP_RAY_DATA")
    assert data_home("cifar10") == Path.home() / ".cache" / "fedsap_ray" / "data" / "cifar10"
    monkeypatch.setenv("FEDSAP_SHARED_DATA", str(tmp_path / "shared"))
    assert get_source("digits_offline").default_root() == tmp_path / "shared"
    monkeypatch.delenv("FEDSAP_SHARED_DATA")
    monkeypatch.chdir(tmp_path)  # no ../shared/data from here: falls back to the repo-relative folder
    assert shared_data_root() == (REPO / ".." / "shared" / "data").resolve()


def test_one_default_root_rule_honours_shared_data(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 14 item 4: CIFAR-10 and Shakespeare (like MNIST) default to $FEDSAP_SHARED_DATA when it holds
    their files and the cache does not, so ``fedsap-ray datasets`` reports them present."""
    shared = tmp_path / "shared"
    (shared / "cifar10").mkdir(parents=True)
    (shared / "cifar10" / "cifar10_jpg_q75.tar.gz").write_bytes(b"x")
    (shared / "shakespeare").mkdir()
    for split in ("train", "test"):
        (shared / "shakespeare" / f"fedshakespeare_{split}.h5").write_bytes(b"x")
    (shared / "mnist").mkdir()
    (shared / "mnist" / "mnist.npz").write_bytes(b"x")
    monkeypatch.setenv("FEDSAP_RAY_DATA", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDSAP_SHARED_DATA", str(shared))
    for name in ("cifar10", "shakespeare", "mnist"):
        assert get_source(name).default_root() == shared, name
    rows = {r["name"]: r for r in dataset_table()}
    for name in ("cifar10", "shakespeare", "mnist"):
        assert rows[name]["present"] and rows[name]["root"] == str(shared), rows[name]
    assert not rows["emnist"]["present"] and rows["emnist"]["root"] == str(tmp_path / "cache" / "emnist")
    # the cache wins when it holds the files too (preferred first)
    (tmp_path / "cache" / "cifar10" / "cifar10").mkdir(parents=True)
    (tmp_path / "cache" / "cifar10" / "cifar10" / "cifar10_jpg_q75.tar.gz").write_bytes(b"x")
    assert get_source("cifar10").default_root() == tmp_path / "cache" / "cifar10"


HINTS = {
    "digits": ["data.download=true", "synth_digits", "MNIST"],
    "digits_offline": ["data.download=true", "mnist.npz", "usps.h5"],
    "office_caltech": ["<domain>/<class>", "SURF"],
    "cifar10": ["data.download=true", "cifar10_jpg_q75.tar.gz"],
    "emnist": ["data.download=true", "EMNIST"],
    "shakespeare": ["LEAF", "fedshakespeare_train.h5"],
}


@pytest.mark.parametrize("name", MINE)
def test_missing_files_raise_one_line_with_path(name: str, tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailable) as info:
        get_source(name).load(tmp_path, download=False, seed=0)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path) in msg and msg.startswith(f"{name}: ")
    for hint in HINTS[name]:
        assert hint in msg, (hint, msg)
    assert isinstance(info.value, FileNotFoundError)
    statuses = get_source(name).files(tmp_path)
    assert statuses and not all(s.present for s in statuses)


def test_digits_error_names_every_missing_domain(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailable) as info:
        get_source("digits").load(tmp_path, download=False, seed=0)
    msg = str(info.value)
    for path in ("MNIST/raw/train-images-idx3-ubyte", "usps.bz2", "train_32x32.mat", "synth_digits/train", "mnist/mnist.npz"):
        assert str(tmp_path / path) in msg


def test_atomic_save_npz_leaves_only_the_final_file(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "a.npz"
    atomic_save_npz(target, x=np.arange(5))
    assert [p.name for p in target.parent.iterdir()] == ["a.npz"]
    with np.load(target) as d:
        np.testing.assert_array_equal(d["x"], np.arange(5))
    assert target.stat().st_mode & 0o777 == 0o644


# ----------------------------------------------------------------------------- digits: shared files
def _shared_digit(domain: str) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    lay = digits_mod.resolve_layout(digits_mod.digit_layouts(domain, SHARED))
    assert lay is not None and lay.kind == "shared"
    return digits_mod.load_digit_domain(domain, lay, SHARED, download=False)


def test_shared_mnist_sizes_labels_and_resize() -> None:
    raw = need("mnist/mnist.npz")
    (xtr, ytr), (xte, yte) = _shared_digit("mnist")
    assert xtr.shape == (60000, 3, 32, 32) and xte.shape == (10000, 3, 32, 32) and xtr.dtype == np.uint8
    assert ytr.dtype == np.int64 and set(np.unique(ytr)) == set(range(10))
    with np.load(raw) as d:
        np.testing.assert_array_equal(ytr, d["y_train"])
        np.testing.assert_array_equal(yte, d["y_test"])
        orig = d["x_test"][:64].astype(np.float32)
    assert (xte[:, 0] == xte[:, 1]).all() and (xte[:, 0] == xte[:, 2]).all()
    back = F.interpolate(torch.from_numpy(xte[:64, :1]).float(), size=(28, 28), mode="bilinear", antialias=True)[:, 0].numpy()
    assert np.corrcoef(back.ravel(), orig.ravel())[0, 1] > 0.95  # same digits, just resized


def test_shared_usps_sizes_and_labels() -> None:
    import h5py

    raw = need("usps/usps.h5")
    (xtr, ytr), (xte, yte) = _shared_digit("usps")
    assert xtr.shape == (7291, 3, 32, 32) and xte.shape == (2007, 3, 32, 32)
    with h5py.File(raw, "r") as f:
        np.testing.assert_array_equal(ytr, f["train/target"][:])
        np.testing.assert_array_equal(yte, f["test/target"][:])
        first = f["train/data"][0].reshape(16, 16)
    np.testing.assert_array_equal(np.bincount(ytr), [1194, 1005, 731, 658, 652, 556, 664, 645, 542, 644])
    # 16 -> 32 bilinear keeps the mean brightness of the digit
    assert abs(xtr[0, 0].mean() / 255.0 - first.mean()) < 0.02


def test_shared_svhn_subset_is_split_and_flagged() -> None:
    need("svhn/svhn_50_subset.npz")
    with pytest.warns(UserWarning, match="only 50 real images"):
        (xtr, ytr), (xte, yte) = _shared_digit("svhn")
    assert xtr.shape == (40, 3, 32, 32) and xte.shape == (10, 3, 32, 32) and ytr.max() <= 9 and ytr.min() >= 0


def test_digits_on_shared_root_names_missing_synthdigits() -> None:
    need("mnist/mnist.npz")
    with pytest.raises(DatasetUnavailable) as info:
        get_source("digits").load(SHARED, download=False, seed=0)
    msg = str(info.value)
    assert str(SHARED / "synth_digits" / "train") in msg
    assert "mnist files" not in msg and "usps files" not in msg and "svhn files" not in msg
    status = {s.what: s.present for s in get_source("digits").files(SHARED)}
    assert status["mnist (shared)"] and status["usps (shared)"] and status["svhn (shared)"]
    assert not status["synth (folder)"]


# ----------------------------------------------------------------------------- digits: standard layouts (fakes)
def _synth_colour(label: int) -> tuple[int, int, int]:
    return (label * 20, 255 - label * 20, 7)


def _make_synth(folder: Path, per_class: int, size: int = 32) -> None:
    from PIL import Image

    for label in range(10):
        d = folder / str(label)
        d.mkdir(parents=True)
        for k in range(per_class):
            Image.new("RGB", (size, size), _synth_colour(label)).save(d / f"{k:03d}.png")


def test_digits_shared_mnist_usps_svhn_plus_synth_folder(tmp_path: Path) -> None:
    for d in ("mnist", "usps", "svhn"):
        (tmp_path / d).symlink_to(need(d).resolve(), target_is_directory=True)
    _make_synth(tmp_path / "syn" / "train", per_class=2, size=28)  # syn/ + val/: the DapperFL/RethinkFL names
    _make_synth(tmp_path / "syn" / "val", per_class=1, size=28)
    with pytest.warns(UserWarning, match="only 50 real images"):
        s = get_source("digits").load(tmp_path, download=False, seed=0)
    assert s.dataset == "digits" and s.domains == ["mnist", "usps", "svhn", "synth"] and s.num_classes == 10
    assert [len(s.train[d]) for d in s.domains] == [60000, 7291, 40, 20]
    assert [len(s.test[d]) for d in s.domains] == [10000, 2007, 10, 10]
    for d in s.domains:
        assert s.train[d].x.dtype == torch.uint8 and tuple(s.train[d].x.shape[1:]) == (3, 32, 32)
        assert s.train[d].y.dtype == torch.int64
    syn = s.train["synth"]
    np.testing.assert_array_equal(syn.y.numpy(), np.repeat(np.arange(10), 2))
    for i in range(0, 20, 2):
        label = int(syn.y[i])
        assert tuple(int(c) for c in syn.x[i, :, 16, 16]) == _synth_colour(label)
    assert "smoke test" in s.domain_notes["svhn"]


def _idx(path: Path, arr: np.ndarray) -> None:
    """Write an uncompressed IDX file (uint8 data) as torchvision's MNIST/EMNIST readers expect."""
    magic = 0x0800 | arr.ndim
    header = magic.to_bytes(4, "big") + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


def _fake_tv_mnist_usps(root: Path) -> None:
    """torchvision MNIST (30/12 constant images, value 25 * label) and USPS (20/10 white images) files."""
    raw = root / "MNIST" / "raw"
    for prefix, n in (("train", 30), ("t10k", 12)):
        y = np.arange(n) % 10
        _idx(raw / f"{prefix}-images-idx3-ubyte", np.repeat((y * 25)[:, None, None], 28, 1).repeat(28, 2))
        _idx(raw / f"{prefix}-labels-idx1-ubyte", y)
    for fname, n in (("usps.bz2", 20), ("usps.t.bz2", 10)):  # libsvm lines: label 1..10, pixels in [-1, 1]
        lines = [f"{k % 10 + 1} " + " ".join(f"{j + 1}:1" for j in range(256)) for k in range(n)]
        (root / fname).write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))


def test_digits_torchvision_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import scipy.io as sio
    import torchvision.datasets.svhn as tv_svhn

    rng = np.random.default_rng(0)
    _fake_tv_mnist_usps(tmp_path)
    for fname, n in (("train_32x32.mat", 15), ("test_32x32.mat", 5)):
        sio.savemat(tmp_path / fname, {"X": rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8), "y": (np.arange(n) % 10 + 1)[:, None]})
    monkeypatch.setattr(tv_svhn, "check_integrity", lambda *a, **k: True)  # fakes have no official md5
    _make_synth(tmp_path / "synth_digits" / "train", per_class=1)
    _make_synth(tmp_path / "synth_digits" / "test", per_class=1)
    s = get_source("digits").load(tmp_path, download=False, seed=0)
    assert [len(s.train[d]) for d in s.domains] == [30, 20, 15, 10]
    assert [len(s.test[d]) for d in s.domains] == [12, 10, 5, 10]
    mx, my = s.train["mnist"].x, s.train["mnist"].y
    assert (mx == (my * 25).to(torch.uint8)[:, None, None, None]).all()  # constant images survive the resize
    assert (s.train["usps"].x == 255).all() and s.train["usps"].y.tolist() == [k % 10 for k in range(20)]
    assert s.train["svhn"].y.tolist() == [(k % 10 + 1) % 10 for k in range(15)]  # SVHN's 10 means digit 0
    assert all("torchvision" in s.domain_notes[d] for d in ("mnist", "usps", "svhn"))
    assert all(st.present for st in get_source("digits").files(tmp_path))


# ----------------------------------------------------------------------------- digits_offline
def _fake_render_module(calls: list[int]) -> types.ModuleType:
    mod = types.ModuleType("fedsap_ray.data.render")

    def make(offset: int):
        def fn(n: int, seed: int):
            calls.append(n)
            y = (np.arange(n) + offset) % 10
            x = np.broadcast_to((np.arange(n) % 256).astype(np.uint8)[:, None, None, None], (n, 3, 32, 32)).copy()
            return x, y.astype(np.int64)

        return fn

    mod.render_street_digits = make(0)
    mod.render_synth_digits = make(3)
    mod.render_street_digits.__name__ = "render_street_digits"
    mod.render_synth_digits.__name__ = "render_synth_digits"
    mod.render_street_digits.__module__ = mod.render_synth_digits.__module__ = "fedsap_ray.data.render"
    return mod


def test_digits_offline_split_cache_and_honest_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "data"
    _fake_tv_mnist_usps(root)
    calls: list[int] = []
    monkeypatch.setitem(sys.modules, "fedsap_ray.data.render", _fake_render_module(calls))
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(tmp_path / "cache"))
    src = get_source("digits_offline")
    assert (src.n_train, src.n_test, src.render_seed) == (10_000, 2_000, 0)
    monkeypatch.setattr(type(src), "n_train", 30)
    monkeypatch.setattr(type(src), "n_test", 7)
    s = src.load(root, download=False, seed=5)
    assert calls == [37, 37]
    assert s.dataset == "digits_offline" and s.domains == ["mnist", "usps", "street_rendered", "synth_rendered"]
    assert len(s.train["mnist"]) == 30 and len(s.test["usps"]) == 10
    assert len(s.train["street_rendered"]) == 30 and len(s.test["synth_rendered"]) == 7
    assert s.test["street_rendered"].x[0, 0, 0, 0] == 30  # the test set is the tail of the one rendering
    assert s.train["synth_rendered"].y[0] == 3
    assert "NOT SVHN" in s.domain_notes["street_rendered"] and "NOT SynthDigits" in s.domain_notes["synth_rendered"]
    assert "real" in s.domain_notes["mnist"] and "stand-in" in s.notes
    s2 = src.load(root, download=False, seed=6)
    assert calls == [37, 37]  # served from the cache
    assert torch.equal(s2.train["street_rendered"].x, s.train["street_rendered"].x)
    assert len(list((tmp_path / "cache" / "rendered").glob("*.npz"))) == 2


def test_digits_offline_rejects_a_renderer_breaking_the_contract(tmp_path: Path) -> None:
    def bad(n: int, seed: int):
        return np.zeros((n, 32, 32, 3), np.uint8), np.zeros(n, np.int64)

    with pytest.raises(ValueError, match="expected uint8"):
        digits_mod.rendered_splits(bad, 4, 2, 0, cache_dir=tmp_path)


def test_digits_offline_with_the_real_renderer(monkeypatch: pytest.MonkeyPatch) -> None:
    need("mnist/mnist.npz")
    need("usps/usps.h5")
    pytest.importorskip("fedsap_ray.data.render", reason="fedsap_ray.data.render not written yet")
    src = get_source("digits_offline")
    monkeypatch.setattr(type(src), "n_train", 60)
    monkeypatch.setattr(type(src), "n_test", 20)
    s = src.load(SHARED, download=False, seed=0)
    assert (len(s.train["mnist"]), len(s.test["mnist"]), len(s.train["usps"]), len(s.test["usps"])) == (60000, 10000, 7291, 2007)
    for d in ("street_rendered", "synth_rendered"):
        assert tuple(s.train[d].x.shape) == (60, 3, 32, 32) and s.train[d].x.dtype == torch.uint8
        assert 0 <= int(s.train[d].y.min()) and int(s.train[d].y.max()) <= 9
    assert not torch.equal(s.train["street_rendered"].x, s.train["synth_rendered"].x)


# ----------------------------------------------------------------------------- office
SURF_SIZES = {"caltech": 1123, "amazon": 958, "webcam": 295, "dslr": 157}


def test_office_surf_shared_sizes_split_and_scaling() -> None:
    import scipy.io as sio

    folder = need("office_caltech10_surf")
    s = get_source("office_caltech").load(SHARED, download=False, seed=0)
    assert s.dataset == "office_caltech_surf" and s.input_kind == "features" and s.input_shape == (800,)
    assert s.domains == list(OFFICE_DOMAINS) and s.num_classes == 10 and "FEATURES" in s.notes
    expected = {"caltech": (899, 224), "amazon": (768, 190), "webcam": (237, 58), "dslr": (127, 30)}
    for d, n in SURF_SIZES.items():
        assert (len(s.train[d]), len(s.test[d])) == expected[d] and sum(expected[d]) == n
        assert s.train[d].x.dtype == torch.float32 and s.train[d].y.dtype == torch.int64
        raw = sio.loadmat(folder / f"{'Caltech10' if d == 'caltech' else d}_SURF_L10.mat")
        labels = raw["labels"].ravel().astype(np.int64) - 1
        i = np.arange(n)
        np.testing.assert_array_equal(s.train[d].y.numpy(), labels[i % 10 <= 7])
        np.testing.assert_array_equal(s.test[d].y.numpy(), labels[i % 10 > 7])
        # sample 8 is the first test row: its standardised features follow from its raw counts
        row8 = np.log1p(raw["fts"][8].astype(np.float64))
        row0 = np.log1p(raw["fts"][0].astype(np.float64))
        a, b = s.test[d].x[0].double().numpy(), s.train[d].x[0].double().numpy()
        nz = row8 != row0
        assert np.all(np.sign(a[nz] - b[nz]) == np.sign(row8[nz] - row0[nz]))
    pooled = torch.cat([s.train[d].x for d in s.domains]).double()
    assert pooled.mean(0).abs().max() < 1e-6
    std = pooled.std(0, unbiased=False)
    assert ((std - 1).abs() < 1e-6).sum() > 700 and (std[(std - 1).abs() >= 1e-6] == 0).all()


def test_office_surf_flat_layout() -> None:
    folder = need("office_caltech10_surf")
    s = get_source("office_caltech").load(folder, download=False, seed=0)  # <root>/<Domain>_SURF_L10.mat
    assert [len(s.train[d]) + len(s.test[d]) for d in s.domains] == [SURF_SIZES[d] for d in s.domains]


def test_standardise_surf_uses_train_statistics_only() -> None:
    tr = {"a": np.array([[0, 1], [2, 1]], np.uint8)}
    te = {"a": np.array([[100, 1]], np.uint8)}
    ftr, fte = standardise_surf(tr, te)
    np.testing.assert_allclose(ftr["a"][:, 0], [-1, 1], atol=1e-6)
    assert (ftr["a"][:, 1] == 0).all() and fte["a"][0, 1] == 0  # constant feature -> 0
    mu, sd = np.log1p([0, 2]).mean(), np.log1p([0, 2]).std()
    assert fte["a"][0, 0] == pytest.approx((np.log1p(100) - mu) / sd, rel=1e-5)


def _make_office_images(root: Path, per_class: int = 2) -> None:
    from PIL import Image

    names = {"caltech": "Caltech10", "amazon": "amazon", "webcam": "webcam", "dslr": "dslr"}
    for k, d in enumerate(OFFICE_DOMAINS):
        for label, cls in enumerate(("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer",
                                     "monitor", "mouse", "mug", "projector")):
            folder = root / names[d] / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (60 + 7 * k, 45), (label * 25, 10 * k, 200)).save(folder / f"frame_{i:04d}.jpg", quality=95)


def test_office_image_folders(tmp_path: Path) -> None:
    _make_office_images(tmp_path)
    src = get_source("office_caltech")
    assert all(st.present for st in src.files(tmp_path))
    s = src.load(tmp_path, download=False, seed=0)
    assert s.dataset == "office_caltech" and s.input_kind == "image" and s.input_shape == (3, 32, 32)
    for d in OFFICE_DOMAINS:  # 20 images ordered by (class, file): indices 8, 9, 18, 19 are test
        assert len(s.train[d]) == 16 and len(s.test[d]) == 4
        assert s.test[d].y.tolist() == [4, 4, 9, 9]
        assert s.train[d].x.dtype == torch.uint8 and tuple(s.train[d].x.shape[1:]) == (3, 32, 32)
    red = s.test["webcam"].x[:, 0, 16, 16].int()
    assert (red - torch.tensor([100, 100, 225, 225])).abs().max() <= 3  # colour (label * 25) survived JPEG + resize


def test_office_mixed_layout_is_an_error(tmp_path: Path) -> None:
    _make_office_images(tmp_path, per_class=1)
    import shutil

    shutil.rmtree(tmp_path / "dslr")
    with pytest.raises(DatasetUnavailable, match="dslr"):
        get_source("office_caltech").load(tmp_path, download=False, seed=0)


# ----------------------------------------------------------------------------- cifar10
def test_cifar_decode_few_files_matches_pil() -> None:
    from PIL import Image

    tar = need("cifar10/cifar10_jpg_q75.tar.gz")
    splits, classes = cifar_mod.decode_cifar_tarball(tar, max_per_class=3, progress=False)
    assert classes == list(cifar_mod.CIFAR10_CLASSES)
    x, y = splits["train"]
    assert x.shape == (30, 3, 32, 32) and x.dtype == np.uint8 and y.tolist() == list(np.repeat(np.arange(10), 3))
    assert splits["test"][0].shape == (30, 3, 32, 32)
    with tarfile.open(tar, "r|gz") as tf:  # stream: stop at the first member we need
        for m in tf:
            if m.name == "test/airplane/0001.jpg":
                f = tf.extractfile(m)
                assert f is not None
                ref = np.asarray(Image.open(io.BytesIO(f.read())).convert("RGB")).transpose(2, 0, 1)
                break
    np.testing.assert_array_equal(splits["test"][0][1], ref)  # airplane = label 0, second file


def test_cifar_shared_full_load_and_cache(session_cache: Path, monkeypatch) -> None:
    need("cifar10/cifar10_jpg_q75.tar.gz")
    s = get_source("cifar10").load(SHARED, download=False, seed=0)
    d = s.train["cifar10"]
    assert s.domains == ["cifar10"] and tuple(d.x.shape) == (50000, 3, 32, 32) and d.x.dtype == torch.uint8
    assert len(s.test["cifar10"]) == 10000 and "JPEG" in s.notes
    np.testing.assert_array_equal(np.bincount(d.y.numpy()), [5000] * 10)
    np.testing.assert_array_equal(np.bincount(s.test["cifar10"].y.numpy()), [1000] * 10)
    assert len(list((session_cache / "cifar10").glob("*.npz"))) == 1

    def no_decode(*a, **k):
        raise AssertionError("the second load decoded the archive again instead of reading the cache")

    monkeypatch.setattr(cifar_mod, "decode_cifar_tarball", no_decode)
    s2 = get_source("cifar10").load(SHARED, download=False, seed=0)
    assert torch.equal(s2.test["cifar10"].x, s.test["cifar10"].x)


def _jpeg(colour: tuple[int, int, int], size: int = 32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def test_cifar_root_level_tarball_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "root"
    root.mkdir()
    with tarfile.open(root / "cifar10_jpg_q75.tar.gz", "w:gz") as tf:
        # written in reverse order: labels must come from sorted folder names, files sorted by name
        for split, per in (("test", 1), ("train", 2)):
            for label, cls in reversed(list(enumerate(cifar_mod.CIFAR10_CLASSES))):
                for k in reversed(range(per)):
                    blob = _jpeg((label * 25, k * 100, 0))
                    info = tarfile.TarInfo(f"{split}/{cls}/{k:04d}.jpg")
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
    s = get_source("cifar10").load(root, download=False, seed=0)
    x, y = s.train["cifar10"].x, s.train["cifar10"].y
    assert y.tolist() == list(np.repeat(np.arange(10), 2)) and len(s.test["cifar10"]) == 10
    assert (x[:, 0, 16, 16].int() - (y * 25).int()).abs().max() <= 3
    assert (x[:, 1, 16, 16].int() - torch.tensor([0, 100] * 10)).abs().max() <= 3
    assert len(list((tmp_path / "cache" / "cifar10").glob("*.npz"))) == 1
    assert get_source("cifar10").files(root)[0].present


def test_decode_jpegs_pil_fallback_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision.io

    blobs = [_jpeg((10, 200, 30)), _jpeg((250, 5, 90), size=48)]
    fast = cifar_mod.decode_jpegs(blobs)
    monkeypatch.delattr(torchvision.io, "decode_jpeg")
    slow = cifar_mod.decode_jpegs(blobs)
    assert fast.shape == slow.shape == (2, 3, 32, 32)
    np.testing.assert_array_equal(fast, slow)


def test_cifar_torchvision_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision.datasets.cifar as tv_cifar

    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    for i, name in enumerate(cifar_mod._TV_FILES[:-1]):
        labels = [(i + k) % 10 for k in range(4)]
        data = np.stack([np.full(3072, 10 * lab, np.uint8) for lab in labels])
        (base / name).write_bytes(pickle.dumps({"data": data, "labels": labels}))
    (base / "batches.meta").write_bytes(pickle.dumps({"label_names": list(cifar_mod.CIFAR10_CLASSES)}))
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)
    s = get_source("cifar10").load(tmp_path, download=False, seed=0)
    x, y = s.train["cifar10"].x, s.train["cifar10"].y
    assert tuple(x.shape) == (20, 3, 32, 32) and len(s.test["cifar10"]) == 4
    assert (x == (10 * y).to(torch.uint8)[:, None, None, None]).all()


# ----------------------------------------------------------------------------- emnist
def test_emnist_shared_copy_absent_skips() -> None:
    p = SHARED / "emnist"
    if not p.exists():
        pytest.skip(f"no shared EMNIST copy (not found at {p}); EMNIST needs torchvision's download")
    s = get_source("emnist").load(p, download=False, seed=0)  # pragma: no cover - only if someone adds it
    assert s.num_classes == 62


def test_emnist_torchvision_layout_upright_and_padded(tmp_path: Path) -> None:
    from fedsap_ray.data.emnist import emnist_paths

    paths = emnist_paths(tmp_path)
    for (img, lab), n in zip((paths[0:2], paths[2:4]), (8, 3)):
        x = np.zeros((n, 28, 28), np.uint8)
        x[:, 3, 5] = 200  # stored (transposed) at row 3, col 5 -> upright row 5, col 3
        _idx(img, x)
        _idx(lab, np.arange(n) * 8 % 62)
    s = get_source("emnist").load(tmp_path, download=False, seed=0)
    x = s.train["emnist"].x
    assert s.num_classes == 62 and tuple(x.shape) == (8, 3, 32, 32) and x.dtype == torch.uint8
    assert (x[:, :, 2 + 5, 2 + 3] == 200).all() and int(x.sum()) == 8 * 3 * 200
    assert s.train["emnist"].y.tolist() == [0, 8, 16, 24, 32, 40, 48, 56] and len(s.test["emnist"]) == 3


def test_emnist_fed_as_1x28x28_to_the_papers_emnist_cnn(tmp_path: Path) -> None:
    """Issue 14 item 5: with model cnn_emnist the federation feeds the native upright 1x28x28 images, so
    paper_emnist builds papers/003 Table 1's network (118.2M MACs at p = 1, not the 154.9M of 3x32x32)."""
    from fedsap_ray.config import build_config
    from fedsap_ray.data import build_federation
    from fedsap_ray.data.emnist import emnist_paths
    from fedsap_ray.models import build_model, model_macs

    rng = np.random.default_rng(0)
    paths = emnist_paths(tmp_path)
    raw = {}
    for (img, lab), n, split in zip((paths[0:2], paths[2:4]), (80, 20), ("train", "test")):
        raw[split] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        _idx(img, raw[split])
        _idx(lab, np.arange(n) % 62)
    splits = get_source("emnist").load(tmp_path, download=False, seed=0)
    cfg = build_config("paper_emnist", overrides=[f"data.root={tmp_path}", "data.num_clients=4", "data.min_samples=1"])
    fed = build_federation(cfg, splits)
    assert fed.input_shape == (1, 28, 28)
    x = fed.train["emnist"].x
    assert tuple(x.shape) == (80, 1, 28, 28) and x.dtype == torch.uint8
    np.testing.assert_array_equal(x[:, 0].numpy(), raw["train"].transpose(0, 2, 1))  # upright, no border
    np.testing.assert_array_equal(fed.test["emnist"].x[:, 0].numpy(), raw["test"].transpose(0, 2, 1))
    model = build_model(cfg.model.name, num_classes=fed.num_classes, input_shape=fed.input_shape)
    assert round(model_macs(model, fed.input_shape) / 1e6, 1) == 118.2
    # any other model keeps the stored 3x32x32 framing
    other = build_federation(build_config("paper_emnist", overrides=[f"data.root={tmp_path}", "data.num_clients=4",
                                                           "data.min_samples=1", "model.name=cnn_cifar"]), splits)
    assert other.input_shape == (3, 32, 32) and tuple(other.train["emnist"].x.shape[1:]) == (3, 32, 32)


# ----------------------------------------------------------------------------- shakespeare
def test_encode_vocabulary() -> None:
    assert shk.encode(" ~A").tolist() == [0, 94, 33]
    assert shk.decode(shk.encode("To be,\n\n  or\tnot é")) == "To be, or not "
    assert shk.encode("a\nb", squeeze_spaces=False).tolist() == [65, 0, 66]


def test_windows_stride_and_owner() -> None:
    texts = [np.arange(85) % 95, np.arange(50), np.arange(100) % 95]
    x, y, owner = shk.windows(texts, stride=2)
    assert owner.tolist() == [0, 0, 0] + [2] * 10  # text 0: starts 0,2,4 (need start + 80 < 85); text 1 too short
    np.testing.assert_array_equal(x[1], np.arange(2, 82))
    assert y[1] == 82 and y[3] == 80 and x.dtype == np.int64


def test_shakespeare_shared_h5_natural_roles() -> None:
    import h5py

    path = need("shakespeare/fedshakespeare_train.h5")
    need("shakespeare/fedshakespeare_test.h5")
    s = get_source("shakespeare").load(SHARED, download=False, seed=0)
    tr, te = s.train["shakespeare"], s.test["shakespeare"]
    assert s.input_kind == "text" and s.vocab_size == 95 and s.num_classes == 95 and s.input_shape == (80,)
    assert tr.x.dtype == torch.int64 and tuple(tr.x.shape[1:]) == (80,) and tr.y.dtype == torch.int64
    assert 0 <= int(tr.x.min()) and int(tr.x.max()) <= 94 and int(tr.y.max()) <= 94
    with h5py.File(path, "r") as f:
        clients = list(f["examples"])
        adam = "\n".join(b.decode() for b in f["examples"]["ALL_S_WELL_THAT_ENDS_WELL_ADAM"]["snippets"][()])
    assert len(clients) == 715
    assert s.natural_train is not None and s.natural_test is not None
    assert set(s.natural_train) == set(s.natural_test) and set(s.natural_train) <= set(clients)
    assert 600 <= len(s.natural_train) <= 715
    cover = np.concatenate(list(s.natural_train.values()))
    np.testing.assert_array_equal(np.sort(cover), np.arange(len(tr)))
    assert sum(len(v) for v in s.natural_test.values()) == len(te)
    # LEAF cleaning: newlines -> space, runs of spaces squeezed; windows every `stride` characters
    clean = " ".join(adam.replace("\n", " ").split(" "))
    while "  " in clean:
        clean = clean.replace("  ", " ")
    idx = s.natural_train["ALL_S_WELL_THAT_ENDS_WELL_ADAM"]
    stride = get_source("shakespeare").stride
    assert len(idx) == len(range(0, len(clean) - 80, stride))
    assert shk.decode(tr.x[idx[0]]) == clean[:80] and shk.decode(tr.y[idx[0]]) == clean[80]
    assert shk.decode(tr.x[idx[2]]) == clean[2 * stride : 2 * stride + 80]


def test_shakespeare_tff_h5_names_and_roles_without_training_text(tmp_path: Path) -> None:
    import h5py

    long = "Now is the winter of our discontent\nMade glorious summer by this sun of York; And all the clouds"
    for split, texts in (("train", {"A_KING": [long, long], "A_PAGE": ["Ay."]}), ("test", {"A_KING": [long], "A_PAGE": [long]})):
        with h5py.File(tmp_path / f"shakespeare_{split}.h5", "w") as f:  # TFF's own file names
            for client, snippets in texts.items():
                f.create_dataset(f"examples/{client}/snippets", data=np.array([t.encode() for t in snippets]))
    src = get_source("shakespeare")
    s = src.load(tmp_path, download=False, seed=0)
    clean = long.replace("\n", " ")
    n_train = len(range(0, 2 * len(clean) + 1 - 80, src.stride))  # two snippets joined by one space
    n_test = len(range(0, len(clean) - 80, src.stride))
    assert list(s.natural_train) == ["A_KING"]  # A_PAGE has no 81-character training text
    assert len(s.train["shakespeare"]) == n_train and len(s.test["shakespeare"]) == n_test  # A_PAGE's test rows dropped
    assert s.natural_test["A_KING"].tolist() == list(range(n_test))
    assert shk.decode(s.test["shakespeare"].x[1]) == clean[src.stride : src.stride + 80]


def test_shakespeare_play_text_by_role(tmp_path: Path) -> None:
    txt = need("shakespeare/tinyshakespeare_input.txt")
    (tmp_path / "tinyshakespeare_input.txt").symlink_to(txt.resolve())
    s = get_source("shakespeare").load(tmp_path, download=False, seed=0)
    assert "play text" in s.notes and s.natural_train is not None
    assert 200 <= len(s.natural_train) <= 308
    first = s.natural_train["First Citizen"][0]
    expected = "Before we proceed any further, hear me speak. You are all resolved rather to die than to famish?"
    assert shk.decode(s.train["shakespeare"].x[first]) == expected[:80]
    assert shk.decode(s.train["shakespeare"].y[first]) == expected[80]


def test_parse_roles_blocks() -> None:
    text = "Alice:\nHi there\nyou.\n\nBob:\nHello.\n\nStage direction without a speaker\n\nAlice:\nAgain.\n"
    assert shk.parse_roles(text) == {"Alice": "Hi there\nyou.\nAgain.", "Bob": "Hello."}


def _leaf_blob(users: dict[str, int]) -> dict:
    data = {}
    for u, n in users.items():
        xs = [(f"{u}{k:02d}" * 40)[:80] for k in range(n)]
        data[u] = {"x": xs, "y": [chr(ord("a") + k % 26) for k in range(n)]}
    return {"users": list(users), "num_samples": list(users.values()), "user_data": data}


def test_shakespeare_leaf_json(tmp_path: Path) -> None:
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "test").mkdir(parents=True)
    (tmp_path / "data" / "train" / "t.json").write_text(json.dumps(_leaf_blob({"KING": 5, "FOOL": 3})))
    (tmp_path / "data" / "test" / "t.json").write_text(json.dumps(_leaf_blob({"KING": 2, "FOOL": 1})))
    s = get_source("shakespeare").load(tmp_path, download=False, seed=0)
    assert "LEAF json" in s.notes and len(s.train["shakespeare"]) == 8 and len(s.test["shakespeare"]) == 3
    assert s.natural_train["FOOL"].tolist() == [5, 6, 7] and s.natural_test["FOOL"].tolist() == [2]
    assert shk.decode(s.train["shakespeare"].x[6]) == ("FOOL01" * 40)[:80]
    assert shk.decode(s.train["shakespeare"].y[:5]) == "abcde"


def test_shakespeare_leaf_all_data_split(tmp_path: Path) -> None:
    (tmp_path / "all_data").mkdir()
    (tmp_path / "all_data" / "all.json").write_text(json.dumps(_leaf_blob({"KING": 10})))
    s = get_source("shakespeare").load(tmp_path, download=False, seed=0)
    assert s.natural_train["KING"].tolist() == list(range(8)) and s.natural_test["KING"].tolist() == [0, 1]
    assert shk.decode(s.test["shakespeare"].y) == "ij"


def test_shakespeare_leaf_rejects_wrong_window_length(tmp_path: Path) -> None:
    (tmp_path / "all_data").mkdir()
    blob = _leaf_blob({"KING": 2})
    blob["user_data"]["KING"]["x"][1] = "short"
    (tmp_path / "all_data" / "all.json").write_text(json.dumps(blob))
    with pytest.raises(ValueError, match="5 characters, expected 80"):
        get_source("shakespeare").load(tmp_path, download=False, seed=0)


# ----------------------------------------------------------------------------- status table
def test_dataset_table_on_shared_root() -> None:
    need("office_caltech10_surf")
    need("shakespeare/fedshakespeare_train.h5")
    rows = {r["name"]: r for r in dataset_table(SHARED)}
    assert set(MINE) <= set(rows)
    for r in rows.values():
        assert set(r) == {"name", "description", "root", "present", "missing", "how_to_obtain"}
    assert rows["office_caltech"]["present"] and rows["shakespeare"]["present"]
    assert rows["office_caltech"]["root"] == str(SHARED)
    assert not rows["digits"]["present"] and any("synth_digits" in m for m in rows["digits"]["missing"])
    assert not rows["emnist"]["present"]
    if (SHARED / "cifar10" / "cifar10_jpg_q75.tar.gz").exists():
        assert rows["cifar10"]["present"]
    if (SHARED / "mnist" / "mnist.npz").exists() and (SHARED / "usps" / "usps.h5").exists():
        assert rows["digits_offline"]["present"]


def test_dataset_table_default_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDSAP_RAY_DATA", str(tmp_path))
    monkeypatch.setenv("FEDSAP_SHARED_DATA", str(tmp_path / "no_shared"))  # neither candidate holds CIFAR-10
    rows = {r["name"]: r for r in dataset_table()}
    assert rows["cifar10"]["root"] == str(tmp_path / "cifar10") and not rows["cifar10"]["present"]
    assert rows["cifar10"]["missing"][0].endswith(str(tmp_path / "cifar10" / "cifar-10-batches-py" / "data_batch_1"))


# ----------------------------------------------------------------------------- mnist (single domain)
def test_mnist_shared_file_loads_and_builds_dirichlet_tiers_federation(
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    from fedsap_ray.config import build_config
    from fedsap_ray.data import as_input, build_federation, load_splits
    from fedsap_ray.data.federation import clear_split_cache
    from fedsap_ray.models import build_model

    raw = need("mnist/mnist.npz")
    request.addfinalizer(clear_split_cache)  # free the ~200 MB of cached splits for the rest of the session
    monkeypatch.setenv("FEDSAP_SHARED_DATA", str(SHARED))
    monkeypatch.setenv("FEDSAP_RAY_DATA", str(SHARED / "no_such_folder"))  # no torchvision copy: the shared file wins
    assert get_source("mnist").default_root() == SHARED
    cfg = build_config(overrides=[
        "data.name=mnist", "data.partition=dirichlet", "data.num_clients=20", "data.alpha=0.3",
        "data.min_samples=10", "capacity.scheme=tiers", "model.name=cnn_small",
    ])
    assert cfg.data.root is None  # default root, as `--set data.name=mnist` gets it
    s = load_splits(cfg)  # cached per process: build_federation below reuses it
    assert s.dataset == "mnist" and s.domains == ["mnist"] and s.num_classes == 10
    assert s.input_kind == "image" and s.input_shape == (3, 32, 32)
    tr, te = s.train["mnist"], s.test["mnist"]
    assert tuple(tr.x.shape) == (60000, 3, 32, 32) and tuple(te.x.shape) == (10000, 3, 32, 32)
    assert tr.x.dtype == te.x.dtype == torch.uint8 and tr.y.dtype == te.y.dtype == torch.int64
    assert set(tr.y.unique().tolist()) == set(te.y.unique().tolist()) == set(range(10))
    with np.load(raw) as d:
        np.testing.assert_array_equal(tr.y.numpy(), d["y_train"])
        np.testing.assert_array_equal(te.y.numpy(), d["y_test"])
    assert "shared" in s.domain_notes["mnist"] and "real" in s.notes

    fed = build_federation(cfg)
    assert fed.dataset == "mnist" and len(fed.clients) == 20
    assert all(c.domain == "mnist" and len(c.indices) >= cfg.data.min_samples for c in fed.clients)
    assert {c.capacity for c in fed.clients} <= set(cfg.capacity.tiers)
    cover = np.concatenate([c.indices for c in fed.clients])
    assert len(np.unique(cover)) == len(cover) == 60000  # a partition of the whole pool
    skew = np.mean([c.tv_distance for c in fed.clients])
    assert skew > 0.2, skew  # Dirichlet(0.3) label skew, not an iid split
    model = build_model("cnn_small", num_classes=fed.num_classes, input_shape=fed.input_shape, width_mult=0.25)
    batch = fed.client_data(0)
    assert tuple(model(as_input(batch.x[:4])).shape) == (4, 10)


def test_mnist_torchvision_layout_and_default_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDSAP_RAY_DATA", str(tmp_path / "home"))
    monkeypatch.setenv("FEDSAP_SHARED_DATA", str(tmp_path / "shared"))  # holds nothing
    src = get_source("mnist")
    assert src.default_root() == tmp_path / "home" / "mnist"  # nothing anywhere: where download=true puts it
    _fake_tv_mnist_usps(tmp_path / "home" / "mnist")
    assert src.default_root() == tmp_path / "home" / "mnist"
    assert [st.what for st in src.files(src.default_root())] == ["mnist (torchvision)"] * 4
    s = src.load(src.default_root(), download=False, seed=0)
    assert len(s.train["mnist"]) == 30 and len(s.test["mnist"]) == 12 and "torchvision" in s.domain_notes["mnist"]
    x, y = s.train["mnist"].x, s.train["mnist"].y
    assert tuple(x.shape[1:]) == (3, 32, 32) and (x == (y * 25).to(torch.uint8)[:, None, None, None]).all()


def test_mnist_missing_files_name_the_paths(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailable) as info:
        get_source("mnist").load(tmp_path, download=False, seed=0)
    msg = str(info.value)
    assert isinstance(info.value, FileNotFoundError) and "\n" not in msg and msg.startswith("mnist: ")
    assert str(tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte") in msg
    assert str(tmp_path / "mnist" / "mnist.npz") in msg and "data.download=true" in msg
    statuses = get_source("mnist").files(tmp_path)
    assert statuses and not any(st.present for st in statuses)
    row = next(r for r in dataset_table(tmp_path) if r["name"] == "mnist")
    assert not row["present"] and row["missing"] and row["how_to_obtain"] == get_source("mnist").how_to_obtain
