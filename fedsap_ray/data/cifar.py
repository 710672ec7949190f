"""CIFAR-10 (one domain, 10 classes, 3x32x32 uint8).

Layouts under ``root``:

* standard: torchvision's ``<root>/cifar-10-batches-py/`` (downloaded with ``download=True``);
* shared: ``<root>/cifar10/cifar10_jpg_q75.tar.gz`` or ``<root>/cifar10_jpg_q75.tar.gz``
  (``train/<class>/*.jpg``, ``test/<class>/*.jpg``; class folders sorted = label order).
  The archive is read as one stream and its 60,000 JPEGs are decoded in batches by
  ``torchvision.io.decode_jpeg`` (libjpeg-turbo; about 6 s on 2 cores, pixel-identical to
  PIL) straight into ``<cache>/cifar10/cifar10_jpg_q75_<sha>.npz``, written atomically; later
  loads read that file (~0.2 s). No extracted folder is kept: 60,000 small files would cost
  more to write than the decode itself, and the cache key is the archive's sha256, so a
  changed archive is decoded afresh. JPEG q75 is lossy: pixels differ slightly from the
  original batches (the notes say so).
"""
from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path, PurePosixPath

import numpy as np

from fedsap_ray.data.digits import Split, resize_nchw, to_domain
from fedsap_ray.data.registry import DomainSplits, FileStatus, register_dataset
from fedsap_ray.data.status import atomic_save_npz, cache_home, default_root, first_present, unavailable

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
TARBALL = "cifar10_jpg_q75.tar.gz"
_TV_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch", "batches.meta")


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
    """Decoded arrays of the whole archive, decoding once and caching by the archive's sha256."""
    cache_dir = cache_home() if cache_dir is None else cache_dir
    path = cache_dir / "cifar10" / f"{tar_path.name.split('.')[0]}_{_sha256(tar_path)[:16]}.npz"
    if path.is_file():
        try:
            with np.load(path) as d:
                return {"train": (d["x_train"], d["y_train"]), "test": (d["x_test"], d["y_test"])}, [str(c) for c in d["classes"]]
        except (OSError, ValueError, KeyError):
            pass  # unreadable cache: decode again
    splits, classes = decode_cifar_tarball(tar_path)
    atomic_save_npz(
        path,
        x_train=splits["train"][0],
        y_train=splits["train"][1],
        x_test=splits["test"][0],
        y_test=splits["test"][1],
        classes=np.asarray(classes),
    )
    return splits, classes


@register_dataset("cifar10")
class Cifar10Source:
    """CIFAR-10 from torchvision's batches or from the shared JPEG archive."""

    name: str
    description = "CIFAR-10: 1 domain, 10 classes, 3x32x32 (50,000 train / 10,000 test)"
    how_to_obtain = "--set data.download=true (torchvision), or the JPEG archive <root>/cifar10/cifar10_jpg_q75.tar.gz"

    def default_root(self) -> Path:
        return default_root(self.name, self.files)  # one rule for every loader (data/status.py)

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
            import torchvision.datasets as tvd

            if download:
                root.mkdir(parents=True, exist_ok=True)
            sp = {}
            for split in ("train", "test"):
                ds = tvd.CIFAR10(str(root), train=split == "train", download=download)
                sp[split] = (np.ascontiguousarray(np.asarray(ds.data, np.uint8).transpose(0, 3, 1, 2)), np.asarray(ds.targets, np.int64))
            classes = list(ds.classes)
            notes = "CIFAR-10 (real), torchvision batches"
        elif tar is not None:
            sp, classes = cached_cifar_tarball(tar)
            notes = f"CIFAR-10 (real) decoded from JPEG quality-75 copies ({tar}); pixels differ slightly from the original batches"
        else:
            missing = next(p for p in tv if not p.exists())
            raise unavailable(
                self.name,
                [("CIFAR-10 batches", missing,
                  f"nor {root / 'cifar10' / TARBALL}; use --set data.download=true to download with torchvision")],
            )
        if len(classes) != 10:
            raise ValueError(f"cifar10: expected 10 classes, found {len(classes)}: {classes}")
        return DomainSplits(
            dataset=self.name,
            domains=["cifar10"],
            train={"cifar10": to_domain(sp["train"])},
            test={"cifar10": to_domain(sp["test"])},
            num_classes=10,
            input_kind="image",
            input_shape=(3, 32, 32),
            notes=notes,
            domain_notes={"cifar10": f"{len(sp['train'][1])} train / {len(sp['test'][1])} test; classes {', '.join(classes)}"},
        )
