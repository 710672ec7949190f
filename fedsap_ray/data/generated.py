"""``generated_blobs``: a generated four-domain feature dataset large enough for 100,000 clients.

Why: the scale questions (does a round cost follow the round or the federation?) need a
federation far larger than any round, and no dataset on this machine holds enough samples
(``embedded_digits`` has 13,437 training images). Nothing is downloaded or stored: the
arrays are drawn from a fixed seed (0, not the run seed, so every run of a sweep sees the
same data) in about a second, and the node cache shares them between a node's processes.

What is drawn: ``FEATURES``-dimensional float32 vectors, ``CLASSES`` classes, four domains.
Class ``k`` has a mean ``m_k ~ N(0, SEPARATION^2 I)`` shared by every domain; domain ``d``
adds its own offset ``o_d ~ N(0, SHIFT^2 I)`` and scales features by ``s_d``. A sample is
``s_d * (m_k + e) + o_d`` with ``e ~ N(0, I)`` and ``k`` uniform. So the domains share the task
but not the input distribution (feature shift, as the digit domains), and an MLP learns it
in a few rounds. It is a load generator for the framework, not a benchmark of methods.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedsap_ray.data.base import DomainData
from fedsap_ray.data.registry import DomainSplits, FileStatus, register_dataset
from fedsap_ray.data.status import cache_home

DOMAINS = ("blob_a", "blob_b", "blob_c", "blob_d")
FEATURES = 32
CLASSES = 10
TRAIN_PER_DOMAIN = 125_000  # 500,000 in all: 100,000 clients of 5 samples (cap with data.max_train_per_domain)
TEST_PER_DOMAIN = 1_000
SEPARATION = 1.0
SHIFT = 0.5
SCALES = (1.0, 0.8, 1.25, 1.1)
GENERATION_SEED = 0


def draw(n_train: int = TRAIN_PER_DOMAIN, n_test: int = TEST_PER_DOMAIN,
         seed: int = GENERATION_SEED) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per domain ``(x_train, y_train, x_test, y_test)``; the same arrays for the same arguments."""
    rng = np.random.default_rng(np.random.SeedSequence((seed, 29)))
    means = rng.normal(0.0, SEPARATION, size=(CLASSES, FEATURES)).astype(np.float32)
    out = {}
    for d, scale in zip(DOMAINS, SCALES):
        offset = rng.normal(0.0, SHIFT, size=FEATURES).astype(np.float32)
        out[d] = (*_sample(rng, means, scale, offset, n_train), *_sample(rng, means, scale, offset, n_test))
    return out


def _sample(rng: np.random.Generator, means: np.ndarray, scale: float, offset: np.ndarray,
            n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples of one domain: ``scale * (m_y + e) + offset`` with uniform labels ``y``."""
    y = rng.integers(0, CLASSES, size=n)
    x = rng.standard_normal(size=(n, FEATURES), dtype=np.float32)
    x += means[y]
    x *= np.float32(scale)
    x += offset
    return x, y.astype(np.int64)


@register_dataset("generated_blobs", inputs=("features",))
class GeneratedBlobs:
    """Generated four-domain Gaussian blobs (32 float features, 10 classes), 125,000 train samples per domain."""

    name = "generated_blobs"
    description = (f"Generated 4-domain Gaussian blobs ({FEATURES} float features, {CLASSES} classes, "
                   f"{TRAIN_PER_DOMAIN:,} train / {TEST_PER_DOMAIN:,} test per domain): a load generator for "
                   "federations of up to 100,000 clients, not a benchmark of methods")
    how_to_obtain = "Nothing to download or store: drawn from a fixed seed at load time (about a second)"

    def default_root(self) -> Path:
        return cache_home()  # unused (nothing is read), but the node cache keys on a root

    def files(self, root: Path) -> list[FileStatus]:
        return []

    def load(self, root: Path, *, download: bool = False, seed: int = 0) -> DomainSplits:
        """The fixed draw; ``root``, ``download`` and ``seed`` are accepted for the protocol and ignored."""
        arrays = draw()

        def dd(x: np.ndarray, y: np.ndarray) -> DomainData:
            return DomainData(torch.from_numpy(x), torch.from_numpy(y))

        return DomainSplits(
            dataset=self.name, domains=list(DOMAINS),
            train={d: dd(a[0], a[1]) for d, a in arrays.items()},
            test={d: dd(a[2], a[3]) for d, a in arrays.items()},
            num_classes=CLASSES, input_kind="features", input_shape=(FEATURES,),
            notes=f"generated_blobs: Gaussian class blobs with a per-domain offset and scale, seed {GENERATION_SEED} "
                  "(generated, not real data)",
            domain_notes={d: f"blobs, scale {s}, {TRAIN_PER_DOMAIN} train / {TEST_PER_DOMAIN} test"
                          for d, s in zip(DOMAINS, SCALES)})
