"""CIFAR-10's torchvision batches are read without unpickling arbitrary objects: a restricted unpickler
that allows only numpy's array reconstructors reads the real format (Python 2 protocol-2 pickles of
dicts of strings, lists and uint8 arrays) exactly, and refuses a crafted batch without running it."""
from __future__ import annotations

import io
import pickle
import pickletools
import struct
from pathlib import Path

import numpy as np
import pytest

from faultkit import cli
from fedsap_ray.data.cifar import Cifar10Source, read_batch

N = 6  # images per batch file
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


class _Py2Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes what Python 2's cPickle wrote for the CIFAR-10 files: bytes as py2 ``str`` (BINSTRING)."""

    def save_bytes(self, obj: bytes) -> None:
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj if n < 256 else pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]
    dispatch[bytes] = save_bytes


def py2_pickle(obj: object) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    # numpy 1.x (which wrote the files) named the reconstructor numpy.core.multiarray
    return buf.getvalue().replace(b"cnumpy._core.multiarray\n_reconstruct\n", b"cnumpy.core.multiarray\n_reconstruct\n")


def write_batches(root: Path) -> dict[str, tuple[np.ndarray, list[int]]]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    made = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        data = rng.integers(0, 256, size=(N, 3072), dtype=np.uint8)
        labels = [(i + j) % 10 for j in range(N)]
        made[name] = (data, labels)
        (folder / name).write_bytes(py2_pickle({b"batch_label": b"batch %d of 5" % i, b"labels": labels,
                                                b"data": data, b"filenames": [b"img_%d.png" % j for j in range(N)]}))
    (folder / "batches.meta").write_bytes(py2_pickle({b"num_cases_per_batch": N, b"num_vis": 3072,
                                                      b"label_names": [c.encode() for c in CLASSES]}))
    return made


def globals_of(blob: bytes) -> set[str]:
    return {str(arg) for op, arg, _ in pickletools.genops(blob) if op.name == "GLOBAL"}


def test_real_format_batches_read_exactly_as_pickle_would(tmp_path):
    made = write_batches(tmp_path)
    f = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    # the file is what the original batches are: protocol 2, the three numpy globals and nothing else
    assert globals_of(f.read_bytes()) == {"numpy.core.multiarray _reconstruct", "numpy ndarray", "numpy dtype"}
    with open(f, "rb") as fh:
        reference = pickle.load(fh, encoding="latin1")  # torchvision's way (trusted test file)
    ours = read_batch(f)
    assert ours.keys() == reference.keys() and ours["labels"] == reference["labels"]
    assert ours["data"].dtype == np.uint8 and np.array_equal(ours["data"], reference["data"])
    splits = Cifar10Source().load(tmp_path, download=False, seed=0)
    x, y = splits.train["cifar10"].x.numpy(), splits.train["cifar10"].y.numpy()
    assert x.shape == (5 * N, 3, 32, 32) and np.array_equal(x[:N], made["data_batch_1"][0].reshape(N, 3, 32, 32))
    assert y.tolist() == [lab for k in range(1, 6) for lab in made[f"data_batch_{k}"][1]]
    assert splits.test["cifar10"].y.numpy().tolist() == made["test_batch"][1]


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_crafted_batch_is_refused_without_running_it(tmp_path, capsys):
    write_batches(tmp_path)
    marker = tmp_path / "pwned"
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    bad.write_bytes(pickle.dumps({"data": _Payload(marker), "labels": []}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match=r"refused global (builtins|io)\.open"):
        read_batch(bad)
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path / "o"),
                    "--set", "data.name=cifar10", "--set", "data.partition=iid", "--set", f"data.root={tmp_path}")
    assert rc == 2 and len(lines) == 1, lines
    assert "data.name='cifar10'" in lines[0] and str(bad) in lines[0] and "refused global" in lines[0], lines
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_labels_outside_0_to_9_exit_2_naming_the_file(tmp_path, capsys):
    """The issue's case: an mnist.npz whose labels lie outside 0..9 (it used to fail the run with exit 1)."""
    f = tmp_path / "mnist" / "mnist.npz"
    f.parent.mkdir()
    z = np.zeros((300, 28, 28), np.uint8)
    np.savez(f, x_train=z, y_train=np.full(300, 12, np.int64), x_test=z, y_test=np.zeros(300, np.int64))
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path / "o"),
                    "--set", "data.name=mnist", "--set", "data.partition=iid", "--set", f"data.root={tmp_path}")
    assert rc == 2 and len(lines) == 1, lines
    assert "labels outside 0..9 (min 12, max 12)" in lines[0] and str(f) in lines[0], lines
    assert not (tmp_path / "o").exists()
