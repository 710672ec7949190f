"""MNIST alone (one domain, 10 classes), e.g. for Dirichlet label-skew federations.

The same images as the ``mnist`` domain of ``digits``/``digits_offline``, read by the same
code (:mod:`fedsap_ray.data.digits`): torchvision's files ``<root>/MNIST/raw/*-ubyte``
(downloaded with ``download=True``) or the shared lossless copy ``<root>/mnist/mnist.npz``.
Images become uint8 [N, 3, 32, 32]: grey repeated to 3 channels, bilinearly resized
28->32 exactly as in ``digits``, so models and results carry over between the two.

Default root: the rule every loader shares (:func:`fedsap_ray.data.status.default_root`): the
first of ``data_home("mnist")`` (``$FEDSAP_RAY_DATA/mnist`` or ``~/.cache/fedsap_ray/data/mnist``)
and the shared folder (``$FEDSAP_SHARED_DATA`` or ``../shared/data``) that holds MNIST in either
layout; when neither does, ``data_home``, which is where ``download=True`` puts torchvision's files.
"""
from __future__ import annotations

from pathlib import Path

from fedsap_ray.data.digits import (
    IMAGE_SIZE,
    layout_files,
    layout_status,
    load_digit_domain,
    plan_domains,
    to_domain,
)
from fedsap_ray.data.base import check_labels
from fedsap_ray.data.registry import DomainSplits, FileStatus, register_dataset
from fedsap_ray.data.status import default_root

MNIST_CLASSES = 10
DOMAIN = "mnist"


@register_dataset("mnist", single_domain=True, inputs=("image",))
class MnistSource:
    """Real MNIST (60,000 train / 10,000 test) as a single domain of 10 classes (3x32x32 uint8)."""

    name: str
    description = "MNIST: 1 domain, 10 classes, 28x28 grey resized to 3x32x32 (as the digits mnist domain)"
    how_to_obtain = (
        "shared file <root>/mnist/mnist.npz (root defaults to $FEDSAP_SHARED_DATA or ../shared/data when it holds "
        "MNIST) or torchvision's <root>/MNIST/raw files: --set data.download=true (torchvision MNIST, ~12 MB)"
    )

    def default_root(self) -> Path:
        return default_root(self.name, self.files)  # one rule for every loader (data/status.py)

    def files(self, root: Path) -> list[FileStatus]:
        return layout_status(DOMAIN, Path(root).expanduser())

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits:
        """Train/test of MNIST from ``root`` (``seed`` unused: the files fix the data)."""
        root = Path(root).expanduser()
        plan = plan_domains(self.name, (DOMAIN,), root, download)
        tr, te = load_digit_domain(DOMAIN, plan[DOMAIN], root, download)
        for split in (tr, te):
            check_labels(self.name, DOMAIN, split[1], MNIST_CLASSES, layout_files(plan[DOMAIN]))
        found = plan[DOMAIN]
        kind = found.kind if found is not None else "torchvision download"
        return DomainSplits(
            dataset=self.name,
            domains=[DOMAIN],
            train={DOMAIN: to_domain(tr)},
            test={DOMAIN: to_domain(te)},
            num_classes=MNIST_CLASSES,
            input_kind="image",
            input_shape=(3, IMAGE_SIZE, IMAGE_SIZE),
            notes="MNIST (real), one domain; grey repeated to 3 channels, resized 28->32 as in the digits dataset",
            domain_notes={DOMAIN: f"MNIST (real), {kind} layout, {len(tr[1])} train / {len(te[1])} test"},
        )
