"""Office-Caltech10: four domains (caltech, amazon, webcam, dslr), 10 shared classes.

Two layouts are read from ``root``:

* images (clusters, the papers' input): ``<root>/<domain>/<class>/*.jpg`` as in FedBN's
  ``office_caltech_10`` release (``<root>/<domain>/images/<class>/`` and ``Caltech10``
  for ``caltech`` are accepted). Photos are resized to ``image_size`` = 32x32 by default
  so one ResNet input size serves every benchmark; the FedSAP paper does not state the
  resolution it fed ResNet18, so a subclass may raise ``image_size`` (e.g. 224).
* SURF features (the shared files; no images are available offline):
  ``<root>/office_caltech10_surf/<Domain>_SURF_L10.mat`` or ``<root>/<Domain>_SURF_L10.mat``
  (Gong et al. 2012 800-bin bag of visual words). Counts are heavy-tailed and their totals
  depend on the photo's resolution, so features are ``log1p``-compressed and then
  z-scored per feature with the mean/std of the pooled *training* rows of all four
  domains (a fixed preprocessing constant; no test statistics are used). The dataset is
  then reported as ``office_caltech_surf`` with ``input_kind="features"``.

Split (docs/readings.md#digits-and-office-caltech10-protocol): within each domain, in file order
(class, then file name for images), sample i goes to train when ``i % 10 <= 7``, else to test.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedsap_ray.data.base import DomainData, check_labels
from fedsap_ray.data.digits import read_image_folder, to_domain
from fedsap_ray.data.partition import office_split
from fedsap_ray.data.registry import DomainSplits, FileStatus, register_dataset
from fedsap_ray.data.status import default_root, unavailable

OFFICE_DOMAINS = ("caltech", "amazon", "webcam", "dslr")
# GFK/FedBN label order (alphabetical) of the SURF files' labels 1..10
OFFICE_CLASSES = ("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor", "mouse", "mug", "projector")
_FOLDER_NAMES = {
    "caltech": ("caltech", "Caltech", "caltech10", "Caltech10"),
    "amazon": ("amazon", "Amazon"),
    "webcam": ("webcam", "Webcam"),
    "dslr": ("dslr", "DSLR"),
}
_SURF_NAMES = {"caltech": "Caltech10", "amazon": "amazon", "webcam": "webcam", "dslr": "dslr"}


def image_folder(root: Path, domain: str) -> Path | None:
    """The domain's class-folder directory under ``root``, if any."""
    for name in _FOLDER_NAMES[domain]:
        d = root / name
        if (d / "images").is_dir():
            return d / "images"
        if d.is_dir():
            return d
    return None


def surf_file(root: Path, domain: str) -> Path | None:
    fname = f"{_SURF_NAMES[domain]}_SURF_L10.mat"
    for p in (root / "office_caltech10_surf" / fname, root / fname):
        if p.is_file():
            return p
    return None


def standardise_surf(train: dict[str, np.ndarray], test: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """log1p, then per-feature z-score with the pooled training rows' mean and std (float32 out)."""
    pooled = np.log1p(np.concatenate([v.astype(np.float64) for v in train.values()]))
    mean = pooled.mean(axis=0)
    std = pooled.std(axis=0)
    std[std < 1e-8] = 1.0  # a feature constant on train carries no information: map it to 0
    f = lambda a: ((np.log1p(a.astype(np.float64)) - mean) / std).astype(np.float32)  # noqa: E731
    return {k: f(v) for k, v in train.items()}, {k: f(v) for k, v in test.items()}


def read_surf(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One GFK ``.mat`` file -> (raw counts [N, 800], int64 labels: the file's 1..10 less one; the loader checks
    them with :func:`~fedsap_ray.data.base.check_labels`)."""
    import scipy.io as sio

    m = sio.loadmat(str(path))
    if "fts" not in m or "labels" not in m:
        raise ValueError(f"{path}: expected keys 'fts' and 'labels', found {sorted(k for k in m if not k.startswith('__'))}")
    x = np.asarray(m["fts"])
    y = np.asarray(m["labels"]).ravel().astype(np.int64) - 1
    if x.ndim != 2 or len(x) != len(y):
        raise ValueError(f"{path}: fts shape {x.shape} does not match {len(y)} labels")
    return x, y


@register_dataset("office_caltech", inputs=("image", "features"))
class OfficeCaltechSource:
    """Office-Caltech10 from image folders, or from the SURF feature files when no images exist."""

    name: str
    description = "Office-Caltech10: caltech, amazon, webcam, dslr -- 10 classes; images (32x32) or 800-d SURF features"
    how_to_obtain = (
        "place the images as <root>/<domain>/<class>/*.jpg (domains caltech, amazon, webcam, dslr; e.g. FedBN's "
        "office_caltech_10 release), or the SURF files <root>/office_caltech10_surf/<Domain>_SURF_L10.mat"
    )
    domains = OFFICE_DOMAINS
    image_size = 32

    def default_root(self) -> Path:
        return default_root(self.name, self.files)  # one rule for every loader (data/status.py)

    def _layout(self, root: Path) -> str | None:
        if all(image_folder(root, d) is not None for d in self.domains):
            return "images"
        if all(surf_file(root, d) is not None for d in self.domains):
            return "surf"
        return None

    def files(self, root: Path) -> list[FileStatus]:
        root = Path(root).expanduser()
        if self._layout(root) == "surf":
            return [FileStatus(f"{d} SURF features", surf_file(root, d), True) for d in self.domains]  # type: ignore[arg-type]
        out = []
        for d in self.domains:
            f = image_folder(root, d)
            out.append(FileStatus(f"{d} images", f if f is not None else root / d, f is not None))
        return out

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits:
        """Images when every domain has a folder, else SURF features (``download``/``seed`` unused: no download exists)."""
        root = Path(root).expanduser()
        layout = self._layout(root)
        if layout is None:
            missing = [
                (
                    f"{d} images",
                    root / d,
                    f"nor SURF file {root / 'office_caltech10_surf' / (_SURF_NAMES[d] + '_SURF_L10.mat')}; "
                    "Office-Caltech10 cannot be downloaded automatically: place <root>/<domain>/<class>/*.jpg",
                )
                for d in self.domains
                if image_folder(root, d) is None and surf_file(root, d) is None
            ]
            if not missing:  # every domain exists, but in mixed layouts
                missing = [(f"{d} images", root / d, "all four domains must use the same layout")
                           for d in self.domains if image_folder(root, d) is None]
            raise unavailable(self.name, missing)
        return self._load_images(root) if layout == "images" else self._load_surf(root)

    def _load_images(self, root: Path) -> DomainSplits:
        train: dict[str, DomainData] = {}
        test: dict[str, DomainData] = {}
        notes: dict[str, str] = {}
        classes: list[str] | None = None
        for d in self.domains:
            folder = image_folder(root, d)
            assert folder is not None
            x, y, names = read_image_folder(folder, self.image_size, classes=classes)
            classes = names
            tr, te = office_split(len(y))
            train[d], test[d] = to_domain((x[tr], y[tr])), to_domain((x[te], y[te]))
            notes[d] = f"{folder}: {len(tr)} train / {len(te)} test images (i % 10 <= 7 -> train)"
        assert classes is not None
        return DomainSplits(
            dataset=self.name,
            domains=list(self.domains),
            train=train,
            test=test,
            num_classes=len(classes),
            input_kind="image",
            input_shape=(3, self.image_size, self.image_size),
            notes=f"Office-Caltech10 images (real), resized to {self.image_size}x{self.image_size}; classes {', '.join(classes)}",
            domain_notes=notes,
        )

    def _load_surf(self, root: Path) -> DomainSplits:
        raw_tr: dict[str, np.ndarray] = {}
        raw_te: dict[str, np.ndarray] = {}
        labels: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        notes: dict[str, str] = {}
        for d in self.domains:
            path = surf_file(root, d)
            assert path is not None
            x, y = read_surf(path)
            check_labels(self.name, d, y, 10, (path,))
            tr, te = office_split(len(y))
            raw_tr[d], raw_te[d] = x[tr], x[te]
            labels[d] = (y[tr], y[te])
            notes[d] = f"{path.name}: {len(tr)} train / {len(te)} test SURF histograms (i % 10 <= 7 -> train)"
        ftr, fte = standardise_surf(raw_tr, raw_te)
        dim = next(iter(ftr.values())).shape[1]
        return DomainSplits(
            dataset="office_caltech_surf",
            domains=list(self.domains),
            train={d: DomainData(torch.from_numpy(ftr[d]), torch.from_numpy(labels[d][0])) for d in self.domains},
            test={d: DomainData(torch.from_numpy(fte[d]), torch.from_numpy(labels[d][1])) for d in self.domains},
            num_classes=10,
            input_kind="features",
            input_shape=(dim,),
            notes=(
                "Office-Caltech10 as real 800-bin SURF bag-of-words FEATURES (Gong et al. 2012), not images; "
                "log1p then z-scored with pooled training statistics"
            ),
            domain_notes=notes,
        )
