"""CIFAR-10 (one domain, 10 classes, 3x32x32 uint8).

Layouts under ``root``:

* standard: torchvision's ``<root>/cifar-10-batches-py/`` (downloaded with ``download=True``). Those
  batches are pickles; they are read by :func:`read_batch`, an unpickler that refuses every global
  but numpy's array reconstructors, so a crafted file in a ``data.root`` cannot run code (torchvision's
  own loader would unpickle it with ``pickle.load``);
* shared: ``<root>/cifar10/cifar10_jpg_q75.tar.gz`` or ``<root>/cifar10_jpg_q75.tar.gz``
  (``train/<class>/*.jpg``, ``test/<class>/*.jpg``; class folders sorted = label order).
  The archive is read as one stream and its 60,000 JPEGs are decoded in batches by
  ``torchvision.io.decode_jpeg`` (libjpeg-turbo; about 6 s on 2 cores, pixel-identical to
  PIL) straight into ``<cache>/cifar10/cifar10_jpg_q75_<sha>.npz``, written atomically with
  its arrays' digests (:mod:`fedsap_ray.data.cachefile`); later loads read that file (~0.2 s)
  and check the digests before use. No extracted folder is kept: 60,000 small files would cost
  more to write than the decode itself, and the cache key is the archive's sha256, so a
  changed archive is decoded afresh. JPEG q75 is lossy: pixels differ slightly from the
  original batches (the notes say so).
"""
from __future__ import annotations

import hashlib
import io
import pickle
import tarfile
from pathlib import Path, PurePosixPath

import numpy as np

from fedsap_ray.data import cachefile
from fedsap_ray.data.base import check_labels
from fedsap_ray.data.cachefile import Unusable
from fedsap_ray.data.digits import Split, resize_nchw
from fedsap_ray.data.registry import DomainSplits, FileStatus, register_dataset
from fedsap_ray.data.source import FileSource, one_domain
from fedsap_ray.data.status import cache_home, first_present

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
TARBALL = "cifar10_jpg_q75.tar.gz"
_TV_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch", "batches.meta")


def _numpy_globals() -> dict[tuple[str, str], object]:
    """The only globals a CIFAR-10 batch needs: how numpy pickles an array (Python 2 ``cPickle`` protocol 2
    in the original files: ``numpy.core.multiarray._reconstruct``, ``numpy.ndarray``, ``numpy.dtype``;
    numpy 2 writes the reconstructor as ``numpy._core.multiarray._reconstruct``)."""
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return {("numpy.core.multiarray", "_reconstruct"): _reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
            ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles plain data and numpy arrays only: any other global (a function to call, a class to
    build) is refused before it is looked up, so nothing in the file can run."""

    allowed = _numpy_globals()

    def find_class(self, module: str, name: str) -> object:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refused global {module}.{name}: a CIFAR-10 batch holds only "
                                         "bytes, lists and numpy arrays") from None


def read_batch(path: Path) -> dict:
    """One ``cifar-10-batches-py`` file as a dict (``latin1`` strings, as torchvision reads them),
    through :class:`_BatchUnpickler`; a file that is not such a dict raises ``pickle.UnpicklingError``
    naming it."""
    with open(path, "rb") as f:
        try:
            d = _BatchUnpickler(f, encoding="latin1").load()
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"{path}: {e}") from None
    if not isinstance(d, dict):
        raise pickle.UnpicklingError(f"{path}: not a CIFAR-10 batch (a {type(d).__name__}, not a dict)")
    return d


def read_batches(folder: Path) -> tuple[dict[str, Split], list[str]]:
    """``{"train"/"test": (uint8 NCHW, int64)}`` and the class names from ``cifar-10-batches-py``."""
    sp: dict[str, Split] = {}
    for split, names in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
        xs, ys = [], []
        for name in names:
            d = read_batch(folder / name)
            data, labels = d.get("data"), d.get("labels")
            if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 \
                    or not isinstance(labels, list) or len(labels) != len(data):
                raise pickle.UnpicklingError(f"{folder / name}: not a CIFAR-10 batch (needs uint8 data [N, 3072] and "
                                             "N labels)")
            xs.append(data.reshape(-1, 3, 32, 32))
            ys.append(np.asarray(labels, np.int64))
        sp[split] = (np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys))
    meta = read_batch(folder / "batches.meta")
    classes = meta.get("label_names")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise pickle.UnpicklingError(f"{folder / 'batches.meta'}: no list of label_names")
    return sp, classes


def _download_batches(root: Path) -> None:
    """torchvision's archive of the batches, checked against its md5 and extracted (nothing unpickled)."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import download_and_extract_archive

    root.mkdir(parents=True, exist_ok=True)
    download_and_extract_archive(CIFAR10.url, str(root), filename=CIFAR10.filename, md5=CIFAR10.tgz_md5)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def decode_jpegs(blobs: list[bytes]) -> np.ndarray:
    """JPEG bytes -> uint8 [N, 3, 32, 32]: torchvision's batched libjpeg-turbo decoder (~2x PIL), PIL if it is gone.

    torchvision 0.29 deprecates its image codecs in favour of TorchCodec; the fallback keeps
    this working when they are removed (same pixels, slower).
    """
    import warnings

    out = np.empty((len(blobs), 3, 32, 32), np.uint8)
    try:
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from torchvision.io import ImageReadMode, decode_jpeg

            imgs = decode_jpeg([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs], mode=ImageReadMode.RGB)
        arrays = [im.numpy() for im in imgs]
    except (ImportError, AttributeError):
        from PIL import Image

        arrays = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")).transpose(2, 0, 1) for b in blobs]
    for j, a in enumerate(arrays):
        out[j] = a if a.shape[-2:] == (32, 32) else resize_nchw(a[None])[0]
    return out


def decode_cifar_tarball(tar_path: Path, max_per_class: int | None = None, progress: bool = True) -> tuple[dict[str, Split], list[str]]:
    """Decode ``{train,test}/<class>/*.jpg`` from a tar.gz -> ({"train"/"test": (uint8 NCHW, int64)}, classes).

    Samples are ordered by (label, file name); ``max_per_class`` keeps only the first
    files of each class (for tests), decoding nothing else.
    """
    from tqdm import tqdm

    blobs: dict[str, dict[str, list[tuple[str, bytes]]]] = {"train": {}, "test": {}}
    with tarfile.open(tar_path, "r:*") as tf:
        for m in tf:
            parts = PurePosixPath(m.name).parts
            if not m.isfile() or len(parts) < 3 or not parts[-1].lower().endswith((".jpg", ".jpeg")):
                continue
            split, cls, fname = parts[-3:]
            if split not in blobs:
                continue
            f = tf.extractfile(m)
            assert f is not None
            blobs[split].setdefault(cls, []).append((fname, f.read()))
    classes = sorted(blobs["train"])
    if not classes or sorted(blobs["test"]) != classes:
        raise ValueError(f"{tar_path}: train classes {classes} and test classes {sorted(blobs['test'])} differ or are empty")
    out: dict[str, Split] = {}
    total = sum(min(len(v), max_per_class or len(v)) for s in blobs.values() for v in s.values())
    with tqdm(total=total, desc=f"decoding {tar_path.name}", unit="img", disable=None if progress else True) as bar:
        for split, by_class in blobs.items():
            data: list[bytes] = []
            labels: list[int] = []
            for label, cls in enumerate(classes):
                files = sorted(by_class[cls])[:max_per_class] if max_per_class else sorted(by_class[cls])
                data.extend(b for _, b in files)
                labels.extend([label] * len(files))
            x = np.empty((len(data), 3, 32, 32), np.uint8)
            for s in range(0, len(data), 2048):
                x[s : s + 2048] = decode_jpegs(data[s : s + 2048])
                bar.update(len(data[s : s + 2048]))
            out[split] = (x, np.asarray(labels, np.int64))
    return out, classes


def cached_cifar_tarball(tar_path: Path, cache_dir: Path | None = None) -> tuple[dict[str, Split], list[str]]:
    """Decoded arrays of the whole archive, decoding once and caching by the archive's sha256; the cache holds
    its arrays' digests (:mod:`fedsap_ray.data.cachefile`): one that is damaged, altered or a link is decoded
    again, with one line saying so."""
    cache_dir = cache_home() if cache_dir is None else cache_dir
    path = cache_dir / "cifar10" / f"{tar_path.name.split('.')[0]}_{_sha256(tar_path)[:16]}.npz"
    problem: Unusable | None = None
    try:
        d = cachefile.read_npz(cache_dir, path, ("x_train", "y_train", "x_test", "y_test", "classes"))
    except Unusable as e:
        problem, d = e, None
    if d is not None:
        return {"train": (d["x_train"], d["y_train"]), "test": (d["x_test"], d["y_test"])}, [str(c) for c in d["classes"]]
    splits, classes = decode_cifar_tarball(tar_path)
    cachefile.write_npz(cache_dir, path, {"x_train": splits["train"][0], "y_train": splits["train"][1],
                                          "x_test": splits["test"][0], "y_test": splits["test"][1],
                                          "classes": np.asarray(classes)})
    if problem is not None:
        cachefile.rebuilt(problem)
    return splits, classes


@register_dataset("cifar10", single_domain=True, inputs=("image",))
class Cifar10Source(FileSource):
    """CIFAR-10 from torchvision's batches or from the shared JPEG archive."""

    description = "CIFAR-10: 1 domain, 10 classes, 3x32x32 (50,000 train / 10,000 test)"
    how_to_obtain = "--set data.download=true (torchvision), or the JPEG archive <root>/cifar10/cifar10_jpg_q75.tar.gz"

    def _tv_paths(self, root: Path) -> list[Path]:
        return [root / "cifar-10-batches-py" / f for f in _TV_FILES]

    def _tarball(self, root: Path) -> Path | None:
        return next((p for p in (root / "cifar10" / TARBALL, root / TARBALL) if p.is_file()), None)

    def files(self, root: Path) -> list[FileStatus]:
        root = Path(root).expanduser()
        tv = self._tv_paths(root)
        if all(p.exists() for p in tv) or self._tarball(root) is None:
            return [FileStatus(f"CIFAR-10 {p.name} (torchvision)", p, p.exists()) for p in tv]
        return [first_present("CIFAR-10 JPEG archive", [root / "cifar10" / TARBALL, root / TARBALL])]

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits:
        """torchvision batches if present, else the JPEG archive, else download (``seed`` unused)."""
        root = Path(root).expanduser()
        tv = self._tv_paths(root)
        tar = self._tarball(root)
        if all(p.exists() for p in tv) or (tar is None and download):
            if not all(p.exists() for p in tv):
                _download_batches(root)
            sp, classes = read_batches(root / "cifar-10-batches-py")
            notes = "CIFAR-10 (real), torchvision batches"
        elif tar is not None:
            sp, classes = cached_cifar_tarball(tar)
            notes = f"CIFAR-10 (real) decoded from JPEG quality-75 copies ({tar}); pixels differ slightly from the original batches"
        else:
            raise self.missing("CIFAR-10 batches", tv,
                               f"nor {root / 'cifar10' / TARBALL}; use --set data.download=true to download with torchvision")
        if len(classes) != 10:
            raise ValueError(f"cifar10: expected 10 classes, found {len(classes)}: {classes}")
        for split in ("train", "test"):
            check_labels(self.name, "cifar10", sp[split][1], 10)
        return one_domain(self.name, "cifar10", sp["train"], sp["test"], num_classes=10, notes=notes,
                          domain_note=f"{len(sp['train'][1])} train / {len(sp['test'][1])} test; classes {', '.join(classes)}")
