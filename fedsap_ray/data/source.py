"""What file-backed dataset sources share (CIFAR-10, EMNIST): the default root, the missing-file error
and the one-domain splits.

A source subclasses :class:`FileSource`, lists its files in ``files(root)`` and reads them in ``load``;
:meth:`FileSource.require` stops a load whose files are missing with the one-line
:class:`~fedsap_ray.common.errors.DatasetUnavailable` that names the first missing path and how to get it
(exit code 2), and :func:`one_domain` builds the :class:`DomainSplits` of a dataset with one domain.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from fedsap_ray.data.base import InputKind
from fedsap_ray.data.digits import Split, to_domain
from fedsap_ray.data.registry import DomainSplits, FileStatus
from fedsap_ray.data.status import default_root, unavailable
from fedsap_ray.common.errors import DatasetUnavailable


class FileSource(ABC):
    """A registered dataset read from files under a root folder."""

    name: str  # set by @register_dataset

    def default_root(self) -> Path:
        return default_root(self.name, self.files)  # one rule for every loader (data/status.py)

    @abstractmethod
    def files(self, root: Path) -> list[FileStatus]:
        """The dataset's files under ``root``, each present or not (``fedsap-ray data``)."""

    def missing(self, what: str, paths: Sequence[Path], how: str) -> DatasetUnavailable:
        """The error naming the first of ``paths`` that does not exist (``what`` it is, ``how`` to get it)."""
        first = next((p for p in paths if not p.exists()), paths[0])
        return unavailable(self.name, [(what, first, how)])

    def require(self, what: str, paths: Sequence[Path], how: str) -> None:
        """Raise :meth:`missing` unless every one of ``paths`` exists."""
        if not all(p.exists() for p in paths):
            raise self.missing(what, paths, how)


def one_domain(dataset: str, domain: str, train: Split, test: Split, *, num_classes: int, notes: str, domain_note: str,
               input_kind: InputKind = "image", input_shape: tuple[int, ...] = (3, 32, 32)) -> DomainSplits:
    """The splits of a dataset with one domain, ``domain``, from its (x, y) train and test arrays."""
    return DomainSplits(dataset=dataset, domains=[domain], train={domain: to_domain(train)}, test={domain: to_domain(test)},
                        num_classes=num_classes, input_kind=input_kind, input_shape=input_shape, notes=notes,
                        domain_notes={domain: domain_note})
