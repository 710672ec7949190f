"""Digits benchmark (MNIST, USPS, SVHN, SynthDigits) and its offline variant.

``digits`` is the four-domain benchmark of FedBN/DapperFL (and the FedSAP paper).
Every domain is read from one of two layouts found under ``root``:

* standard (clusters): torchvision's files -- ``<root>/MNIST/raw/*-ubyte``,
  ``<root>/usps.bz2`` + ``usps.t.bz2``, ``<root>/train_32x32.mat`` + ``test_32x32.mat`` --
  downloaded by torchvision when ``download=True``; SynthDigits (Ganin & Lempitsky
  2015) has no torchvision loader and is read from an image folder
  ``<root>/synth_digits/{train,test}/<digit>/*.png`` (``syn/`` for ``synth_digits/``
  and ``val/`` for ``test/`` are accepted: that is the DapperFL/RethinkFL release);
* shared files (``root`` = the folder holding ``mnist/``, ``usps/``, ``svhn/``):
  ``mnist/mnist.npz``, ``usps/usps.h5``, ``svhn/svhn_50_subset.npz``. The SVHN file
  holds only 50 real images (40 train / 10 test by the ``i % 10 <= 7`` rule): it
  exercises the loader, it is not enough for experiments (a warning says so).

Images become uint8 NCHW, grey repeated to 3 channels, bilinearly resized to 32x32
(MNIST 28->32, USPS 16->32), as in DapperFL's ``transforms.Resize((32, 32))``.

``digits_offline`` keeps the protocol runnable without SVHN/SynthDigits: real MNIST
and USPS plus two domains rendered by :mod:`fedsap_ray.data.render`, named
``street_rendered`` and ``synth_rendered`` -- stand-ins, never reported as SVHN or
SynthDigits. The rendered sets are fixed (seed 0, 10,000 train + 2,000 test each)
and cached, so every run and seed sees the same test sets.
"""
from __future__ import annotations

import hashlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fedsap_ray.data import cachefile
from fedsap_ray.data.base import DomainData, check_labels
from fedsap_ray.data.cachefile import Unusable
from fedsap_ray.data.partition import office_split
from fedsap_ray.data.registry import DomainSplits, FileStatus, corrupt_file_errors, register_dataset, unreadable
from fedsap_ray.data.status import cache_home, default_root, shared_data_root, unavailable

IMAGE_SIZE = 32
IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff"})
Split = tuple[np.ndarray, np.ndarray]  # (uint8 [N, 3, S, S], int64 [N])


# ----------------------------------------------------------------------------- image helpers
def resize_nchw(x: np.ndarray, size: int = IMAGE_SIZE, chunk: int = 4096) -> np.ndarray:
    """Bilinear resize of uint8 NCHW images (antialiased when shrinking), chunked to bound memory."""
    if x.ndim != 4:
        raise ValueError(f"resize_nchw expects [N, C, H, W], got shape {x.shape}")
    if x.shape[-2:] == (size, size):
        return np.ascontiguousarray(x, dtype=np.uint8)
    out = np.empty((len(x), x.shape[1], size, size), np.uint8)
    shrink = x.shape[-1] > size or x.shape[-2] > size  # antialiasing only matters when shrinking (and is slower)
    for s in range(0, len(x), chunk):
        t = torch.from_numpy(np.ascontiguousarray(x[s : s + chunk])).float()
        r = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False, antialias=shrink)
        out[s : s + chunk] = r.round_().clamp_(0, 255).to(torch.uint8).numpy()
    return out


def grey_to_rgb(x: np.ndarray, size: int = IMAGE_SIZE) -> np.ndarray:
    """uint8 [N, H, W] grey -> uint8 [N, 3, size, size] (resized once, then the channel repeated)."""
    if x.ndim != 3 or x.dtype != np.uint8:
        raise ValueError(f"grey_to_rgb expects uint8 [N, H, W], got {x.dtype} {x.shape}")
    one = resize_nchw(x[:, None], size)
    out = np.empty((len(x), 3, size, size), np.uint8)
    out[:] = one  # broadcast copy: faster than np.repeat (measured: docs/guides/performance.md)
    return out


def class_folders(folder: Path) -> list[Path]:
    """Class sub-folders in label order: numeric when every name is an integer, else alphabetical."""
    dirs = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if dirs and all(p.name.isdigit() for p in dirs):
        return sorted(dirs, key=lambda p: int(p.name))
    return sorted(dirs, key=lambda p: p.name)


def read_image(path: Path, size: int) -> np.ndarray:
    """One image file -> uint8 [3, size, size] (JPEG draft mode decodes big photos at reduced scale)."""
    from PIL import Image

    with Image.open(path) as im:
        if im.format == "JPEG":
            im.draft("RGB", (size, size))
        im = im.convert("RGB")
        if im.size != (size, size):
            im = im.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)


def read_image_folder(folder: Path, size: int = IMAGE_SIZE, classes: list[str] | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``<folder>/<class>/<image>`` -> (uint8 [N, 3, size, size], int64 labels, class names).

    Samples are ordered by (label, file name), so index-based splits are reproducible.
    ``classes`` fixes the label order (e.g. the train folder's) and rejects mismatches.
    """
    dirs = class_folders(folder)
    names = [d.name for d in dirs]
    if classes is not None and names != list(classes):
        raise ValueError(f"{folder}: class folders {names} differ from the expected {list(classes)}")
    if not dirs:
        raise ValueError(f"{folder}: no class sub-folders (expected <class>/<image> files)")
    images: list[np.ndarray] = []
    labels: list[int] = []
    for label, d in enumerate(dirs):
        files = sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_EXTS)
        for p in files:
            images.append(read_image(p, size))
            labels.append(label)
    if not images:
        raise ValueError(f"{folder}: class folders hold no images ({', '.join(sorted(IMAGE_EXTS))})")
    return np.stack(images), np.asarray(labels, np.int64), names


def to_domain(split: Split) -> DomainData:
    x, y = split
    return DomainData(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.asarray(y, dtype=np.int64)))


# ----------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """One way a domain's files can lie under a root: its kind and every file/folder it needs."""

    domain: str
    kind: str  # "torchvision" | "shared" | "folder"
    paths: tuple[Path, ...]

    def present(self) -> bool:
        return all(p.exists() for p in self.paths)

    def first_missing(self) -> Path:
        return next((p for p in self.paths if not p.exists()), self.paths[0])


TORCHVISION_DOMAINS = frozenset({"mnist", "usps", "svhn"})


def digit_layouts(domain: str, root: Path) -> list[Layout]:
    """Layouts for one digits domain, preferred (standard) first."""
    if domain == "mnist":
        raw = root / "MNIST" / "raw"
        tv = tuple(raw / f for f in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                                     "t10k-labels-idx1-ubyte"))
        return [Layout(domain, "torchvision", tv), Layout(domain, "shared", (root / "mnist" / "mnist.npz",))]
    if domain == "usps":
        return [Layout(domain, "torchvision", (root / "usps.bz2", root / "usps.t.bz2")),
                Layout(domain, "shared", (root / "usps" / "usps.h5",))]
    if domain == "svhn":
        return [
            Layout(domain, "torchvision", (root / "train_32x32.mat", root / "test_32x32.mat")),
            Layout(domain, "shared", (root / "svhn" / "svhn_50_subset.npz",)),
        ]
    if domain == "synth":
        return [Layout(domain, "folder", (root / top / "train", root / top / test))
                for top in ("synth_digits", "syn") for test in ("test", "val")]
    raise KeyError(f"unknown digits domain {domain!r}")


def resolve_layout(layouts: list[Layout]) -> Layout | None:
    return next((lay for lay in layouts if lay.present()), None)


def how_to_get(domain: str, root: Path) -> str:
    if domain in TORCHVISION_DOMAINS:
        shared = digit_layouts(domain, root)[1].paths[0]
        return f"nor shared file {shared}; use --set data.download=true to download it with torchvision"
    return (
        "SynthDigits cannot be downloaded automatically: place its images as "
        f"{root / 'synth_digits'}/{{train,test}}/<digit>/*.png (the syn/ folder of the DapperFL/RethinkFL data release works)"
    )


def layout_status(domain: str, root: Path) -> list[FileStatus]:
    layouts = digit_layouts(domain, root)
    lay = resolve_layout(layouts) or layouts[0]
    return [FileStatus(f"{domain} ({lay.kind})", p, p.exists()) for p in lay.paths]


def plan_domains(dataset: str, domains: tuple[str, ...], root: Path, download: bool) -> dict[str, Layout | None]:
    """Pick each domain's layout before loading anything, so a missing file fails fast with one message.

    ``None`` means "download with torchvision".
    """
    plan: dict[str, Layout | None] = {}
    missing: list[tuple[str, Path, str]] = []
    for d in domains:
        layouts = digit_layouts(d, root)
        lay = resolve_layout(layouts)
        if lay is None and not (download and d in TORCHVISION_DOMAINS):
            missing.append((f"{d} files", layouts[0].first_missing(), how_to_get(d, root)))
        plan[d] = lay
    if missing:
        raise unavailable(dataset, missing)
    return plan


# ----------------------------------------------------------------------------- per-domain readers
def _torchvision_domain(domain: str, root: Path, download: bool) -> tuple[Split, Split]:
    import torchvision.datasets as tvd

    if download:
        root.mkdir(parents=True, exist_ok=True)
    out: list[Split] = []
    for train in (True, False):
        if domain == "mnist":
            ds = tvd.MNIST(str(root), train=train, download=download)
            x, y = ds.data.numpy(), ds.targets.numpy()
        elif domain == "usps":
            ds = tvd.USPS(str(root), train=train, download=download)
            x, y = np.asarray(ds.data, np.uint8), np.asarray(ds.targets)
        elif domain == "svhn":
            ds = tvd.SVHN(str(root), split="train" if train else "test", download=download)
            out.append((resize_nchw(np.asarray(ds.data, np.uint8)), np.asarray(ds.labels, np.int64)))
            continue
        else:  # pragma: no cover - guarded by TORCHVISION_DOMAINS
            raise KeyError(domain)
        out.append((grey_to_rgb(np.asarray(x, np.uint8)), np.asarray(y, np.int64)))
    return out[0], out[1]


def _shared_domain(domain: str, path: Path) -> tuple[Split, Split]:
    if domain == "mnist":
        with np.load(path) as d:
            return (grey_to_rgb(d["x_train"]), d["y_train"].astype(np.int64)), (grey_to_rgb(d["x_test"]), d["y_test"].astype(np.int64))
    if domain == "usps":
        import h5py

        out = []
        with h5py.File(path, "r") as f:
            for split in ("train", "test"):
                x = np.asarray(f[f"{split}/data"][:], np.float32).reshape(-1, 16, 16)
                x8 = np.clip(np.round(x * 255.0), 0, 255).astype(np.uint8)
                out.append((grey_to_rgb(x8), np.asarray(f[f"{split}/target"][:], np.int64)))
        return out[0], out[1]
    if domain == "svhn":
        with np.load(path) as d:
            x = np.ascontiguousarray(d["x"].transpose(0, 3, 1, 2))
            y = d["y"].astype(np.int64)
        warnings.warn(
            f"digits: SVHN read from {path}, which holds only {len(y)} real images -- enough to test the loader, not for experiments",
            stacklevel=3,
        )
        tr, te = office_split(len(y))
        x = resize_nchw(x)
        return (x[tr], y[tr]), (x[te], y[te])
    raise KeyError(f"no shared file for digits domain {domain!r}")


def _folder_domain(layout: Layout) -> tuple[Split, Split]:
    train_dir, test_dir = layout.paths
    xtr, ytr, names = read_image_folder(train_dir, IMAGE_SIZE)
    xte, yte, _ = read_image_folder(test_dir, IMAGE_SIZE, classes=names)
    return (xtr, ytr), (xte, yte)


def load_digit_domain(domain: str, layout: Layout | None, root: Path, download: bool) -> tuple[Split, Split]:
    """Train and test split of one digits domain from the chosen layout (``None``: torchvision download)."""
    if layout is None or layout.kind == "torchvision":
        return _torchvision_domain(domain, root, download)
    if layout.kind == "shared":
        path = layout.paths[0]
        try:
            return _shared_domain(domain, path)
        except corrupt_file_errors() as e:
            if isinstance(e, FileNotFoundError):
                raise
            source = " (its origin is in SOURCE.txt there)" if (path.parent / "SOURCE.txt").is_file() else ""
            raise unreadable(f"digits domain {domain!r}", path, e,
                             f"put a good copy of {path.name} in {path.parent}{source}, or remove it and use "
                             "torchvision's files with --set data.download=true") from e
    return _folder_domain(layout)


def layout_files(layout: Layout | None) -> tuple[Path, ...]:
    """The files a domain was read from (none for a torchvision download), for the errors that name them."""
    return layout.paths if layout is not None else ()


# ----------------------------------------------------------------------------- sources
@register_dataset("digits", inputs=("image",))
class DigitsSource:
    """MNIST, USPS, SVHN and SynthDigits as four domains of 10 digit classes (3x32x32 uint8)."""

    name: str
    description = "Digits: MNIST, USPS, SVHN, SynthDigits -- 4 domains, 10 classes, 3x32x32"
    how_to_obtain = (
        "MNIST/USPS/SVHN: --set data.download=true (torchvision); SynthDigits: place images as "
        "<root>/synth_digits/{train,test}/<digit>/*.png"
    )
    domains = ("mnist", "usps", "svhn", "synth")
    domain_descriptions = {
        "mnist": "MNIST (real)",
        "usps": "USPS (real)",
        "svhn": "SVHN (real)",
        "synth": "SynthDigits (real, Ganin & Lempitsky 2015)",
    }

    def default_root(self) -> Path:
        return default_root(self.name, self.files)  # one rule for every loader (data/status.py)

    def files(self, root: Path) -> list[FileStatus]:
        root = Path(root).expanduser()
        return [s for d in self.domains for s in layout_status(d, root)]

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits:
        """Read all four domains (``seed`` is unused: the files fix the data)."""
        root = Path(root).expanduser()
        plan = plan_domains(self.name, self.domains, root, download)
        train: dict[str, DomainData] = {}
        test: dict[str, DomainData] = {}
        notes: dict[str, str] = {}
        for d in self.domains:
            tr, te = load_digit_domain(d, plan[d], root, download)
            for s in (tr, te):
                check_labels(self.name, d, s[1], 10, layout_files(plan[d]))
            train[d], test[d] = to_domain(tr), to_domain(te)
            found = plan[d]
            kind = found.kind if found is not None else "torchvision download"
            notes[d] = f"{self.domain_descriptions[d]}, {kind} layout, {len(tr[1])} train / {len(te[1])} test"
            if d == "svhn" and kind == "shared":
                notes[d] += " -- only the 50-image shared subset: loader smoke test, not an experiment"
        return DomainSplits(
            dataset=self.name,
            domains=list(self.domains),
            train=train,
            test=test,
            num_classes=10,
            input_kind="image",
            input_shape=(3, IMAGE_SIZE, IMAGE_SIZE),
            notes="Digits: real MNIST, USPS, SVHN and SynthDigits; grey repeated to 3 channels, resized to 32x32.",
            domain_notes=notes,
        )


RenderFn = Callable[[int, int], tuple[object, object]]


def _render_version(fn: RenderFn) -> str:
    """Hash of the renderer's source file, so a changed renderer never reuses a stale cache."""
    mod = sys.modules.get(fn.__module__)
    path = getattr(mod, "__file__", None)
    if path and Path(path).is_file():
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
    return "nosrc"


def rendered_splits(fn: RenderFn, n_train: int, n_test: int, seed: int, cache_dir: Path | None = None) -> tuple[Split, Split]:
    """Render ``n_train + n_test`` digits once with ``fn(n, seed)`` and cache them (an ``.npz`` with their
    digests, :mod:`fedsap_ray.data.cachefile`: a cache that is damaged, altered or a link is rendered again,
    with one line saying so).

    The first ``n_train`` samples are the training pool, the rest the test set.
    """
    cache_dir = cache_home() if cache_dir is None else cache_dir
    path = cache_dir / "rendered" / f"{fn.__name__}_n{n_train}+{n_test}_seed{seed}_{_render_version(fn)}.npz"
    n = n_train + n_test
    problem: Unusable | None = None
    try:
        cached = cachefile.read_npz(cache_dir, path, ("x", "y"))
        if cached is not None and (cached["x"].dtype != np.uint8 or cached["x"].shape != (n, 3, IMAGE_SIZE, IMAGE_SIZE)
                                   or cached["y"].dtype != np.int64 or cached["y"].shape != (n,)):
            raise Unusable(path, f"holds {cached['x'].dtype} {cached['x'].shape} / {cached['y'].dtype} "
                                 f"{cached['y'].shape}, not {n} rendered digits")
    except Unusable as e:
        problem, cached = e, None
    if cached is not None:
        x, y = cached["x"], cached["y"]
    else:
        xr, yr = fn(n, seed)
        x = np.asarray(xr.numpy() if isinstance(xr, torch.Tensor) else xr)
        y = np.asarray(yr.numpy() if isinstance(yr, torch.Tensor) else yr).astype(np.int64)
        if x.dtype != np.uint8 or x.shape != (n, 3, IMAGE_SIZE, IMAGE_SIZE) or y.shape != (n,):
            raise ValueError(
                f"{fn.__module__}.{fn.__name__}({n}, {seed}) returned {x.dtype} {x.shape} / {y.shape}; "
                f"expected uint8 ({n}, 3, {IMAGE_SIZE}, {IMAGE_SIZE}) and int64 ({n},)"
            )
        cachefile.write_npz(cache_dir, path, {"x": x, "y": y})
        if problem is not None:
            cachefile.rebuilt(problem)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


@register_dataset("digits_offline", inputs=("image",))
class DigitsOfflineSource:
    """Digits protocol offline: real MNIST and USPS plus two rendered stand-in domains."""

    name: str
    description = "Digits offline: real MNIST + USPS, rendered street/synth stand-ins -- 4 domains, 10 classes, 3x32x32"
    how_to_obtain = (
        "MNIST and USPS from the shared files (<root>/mnist/mnist.npz, <root>/usps/usps.h5; root defaults to "
        "$FEDSAP_SHARED_DATA or ../shared/data) or torchvision (--set data.download=true); the other two domains are rendered"
    )
    domains = ("mnist", "usps", "street_rendered", "synth_rendered")
    real_domains = ("mnist", "usps")
    n_train = 10_000
    n_test = 2_000
    render_seed = 0

    def default_root(self) -> Path:
        return shared_data_root()

    def files(self, root: Path) -> list[FileStatus]:
        root = Path(root).expanduser()
        return [s for d in self.real_domains for s in layout_status(d, root)]

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits:
        """Real MNIST/USPS from ``root`` and the cached rendered domains (``seed`` unused: fixed data)."""
        root = Path(root).expanduser()
        plan = plan_domains(self.name, self.real_domains, root, download)
        from fedsap_ray.data.render import render_street_digits, render_synth_digits  # lazy: optional module

        splits: dict[str, tuple[Split, Split]] = {d: load_digit_domain(d, plan[d], root, download) for d in self.real_domains}
        splits["street_rendered"] = rendered_splits(render_street_digits, self.n_train, self.n_test, self.render_seed)
        splits["synth_rendered"] = rendered_splits(render_synth_digits, self.n_train, self.n_test, self.render_seed)
        notes = {
            "mnist": f"MNIST (real), {len(splits['mnist'][0][1])} train / {len(splits['mnist'][1][1])} test",
            "usps": f"USPS (real), {len(splits['usps'][0][1])} train / {len(splits['usps'][1][1])} test",
            "street_rendered": (
                f"rendered street-number-style digits (a stand-in, NOT SVHN), seed {self.render_seed}, "
                f"{self.n_train} train / {self.n_test} test"
            ),
            "synth_rendered": (
                f"rendered synthetic font digits (a stand-in, NOT SynthDigits), seed {self.render_seed}, "
                f"{self.n_train} train / {self.n_test} test"
            ),
        }
        for d, (tr, te) in splits.items():
            check_labels(self.name, d, tr[1], 10)
            check_labels(self.name, d, te[1], 10)
        return DomainSplits(
            dataset=self.name,
            domains=list(self.domains),
            train={d: to_domain(splits[d][0]) for d in self.domains},
            test={d: to_domain(splits[d][1]) for d in self.domains},
            num_classes=10,
            input_kind="image",
            input_shape=(3, IMAGE_SIZE, IMAGE_SIZE),
            notes=(
                "digits_offline: MNIST and USPS are real; street_rendered and synth_rendered are digits rendered by "
                "fedsap_ray.data.render as stand-ins for SVHN and SynthDigits (not those datasets)."
            ),
            domain_notes=notes,
        )
