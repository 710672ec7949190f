"""EMNIST ByClass (one domain, 62 classes: 10 digits, 26 upper, 26 lower case letters).

Read through torchvision (``<root>/EMNIST/raw/emnist-byclass-*-ubyte``, downloaded with
``download=True``; no shared copy exists). The raw NIST arrays are stored transposed,
so images are transposed back to upright. The 28x28 images are zero-padded by 2 pixels
to 32x32 (not resized: padding keeps the strokes' pixels exact and the background is
already 0, the same framing as the 32x32 LeNet input) and grey is repeated to 3 channels.
The paper's EMNIST CNN (``model.name=cnn_emnist``) is fed the native upright 1x28x28 instead
(:func:`fedsap_ray.data.federation.native_emnist`, an exact inverse of the padding), the input
papers/003 Table 1 sizes it on (118.2M MACs at p = 1).
Full ByClass is 697,932 train + 116,323 test images: about 2.5 GB as uint8 3x32x32.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fedsap_ray.data.base import check_labels
from fedsap_ray.data.registry import DomainSplits, FileStatus, register_dataset
from fedsap_ray.data.source import FileSource, one_domain

EMNIST_SPLIT = "byclass"
EMNIST_CLASSES = 62


def emnist_paths(root: Path, split: str = EMNIST_SPLIT) -> list[Path]:
    raw = root / "EMNIST" / "raw"
    return [raw / f"emnist-{split}-{s}-{k}" for s in ("train", "test") for k in ("images-idx3-ubyte", "labels-idx1-ubyte")]


def pad_upright_rgb(x: np.ndarray) -> np.ndarray:
    """uint8 [N, 28, 28] as stored by NIST (transposed) -> upright uint8 [N, 3, 32, 32], 2-pixel zero border."""
    if x.ndim != 3 or x.shape[1:] != (28, 28):
        raise ValueError(f"EMNIST images should be [N, 28, 28], got {x.shape}")
    out = np.zeros((len(x), 3, 32, 32), np.uint8)
    out[:, :, 2:30, 2:30] = x.transpose(0, 2, 1)[:, None]
    return out


@register_dataset("emnist", single_domain=True, inputs=("image",))
class EmnistSource(FileSource):
    """EMNIST ByClass via torchvision."""

    description = "EMNIST ByClass: 1 domain, 62 classes, 28x28 padded to 3x32x32 (native 1x28x28 for cnn_emnist)"
    how_to_obtain = "--set data.download=true (torchvision EMNIST, ~535 MB zip)"

    def files(self, root: Path) -> list[FileStatus]:
        return [FileStatus(f"EMNIST {p.name}", p, p.exists()) for p in emnist_paths(Path(root).expanduser())]

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits:
        """Train/test of ByClass (``seed`` unused: the files fix the data)."""
        import torchvision.datasets as tvd

        root = Path(root).expanduser()
        paths = emnist_paths(root)
        if not download:
            self.require("EMNIST ByClass", paths, "use --set data.download=true to download it with torchvision")
        if download:
            root.mkdir(parents=True, exist_ok=True)
        sp = {}
        for split in ("train", "test"):
            ds = tvd.EMNIST(str(root), split=EMNIST_SPLIT, train=split == "train", download=download)
            y = ds.targets.numpy().astype(np.int64)
            check_labels(self.name, "emnist", y, EMNIST_CLASSES, paths)
            sp[split] = (pad_upright_rgb(ds.data.numpy()), y)
        return one_domain(self.name, "emnist", sp["train"], sp["test"], num_classes=EMNIST_CLASSES,
                          notes="EMNIST ByClass (real), upright, zero-padded 28->32, grey repeated to 3 channels",
                          domain_note=f"{len(sp['train'][1])} train / {len(sp['test'][1])} test, 62 classes (0-9, A-Z, a-z)")
