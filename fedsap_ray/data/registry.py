"""Dataset registry: each source loads per-domain train/test splits and reports its files.

Adding a dataset means one module with a ``@register_dataset("name")`` class and one
import line in ``fedsap_ray/data/__init__.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from collections.abc import Callable

import numpy as np

from fedsap_ray.data.base import DomainData, InputKind
from fedsap_ray.errors import DatasetUnavailable as DatasetUnavailable  # re-exported: it used to live here
from fedsap_ray.errors import DatasetUnreadable


def corrupt_file_errors() -> tuple[type[BaseException], ...]:
    """What numpy/zipfile/h5py/pickle/tar raise on a truncated or damaged file."""
    import pickle
    import tarfile
    import zipfile
    import zlib

    return (zipfile.BadZipFile, zlib.error, EOFError, pickle.UnpicklingError, tarfile.TarError, OSError, ValueError,
            KeyError)


def unreadable(what: str, path: Path, error: BaseException, how: str) -> DatasetUnreadable:
    """One line: which file, what went wrong, and how to get a good copy."""
    first = str(error).splitlines()[0] if str(error) else ""
    return DatasetUnreadable(f"{what}: {path} is unreadable ({error.__class__.__name__}: {first}); the file is "
                             f"truncated or damaged: fetch it again ({how})")


@dataclass
class DomainSplits:
    dataset: str  # honest name shown in outputs
    domains: list[str]
    train: dict[str, DomainData]
    test: dict[str, DomainData]
    num_classes: int
    input_kind: InputKind
    input_shape: tuple[int, ...]
    vocab_size: int | None = None
    notes: str = ""
    domain_notes: dict[str, str] = field(default_factory=dict)
    # natural partitions (Shakespeare): client name -> indices into train[domain] / test[domain]
    natural_train: dict[str, np.ndarray] | None = None
    natural_test: dict[str, np.ndarray] | None = None


@dataclass(frozen=True)
class FileStatus:
    what: str
    path: Path
    present: bool


class DatasetSource(Protocol):
    name: str
    description: str
    how_to_obtain: str

    def default_root(self) -> Path: ...

    def files(self, root: Path) -> list[FileStatus]: ...

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits: ...


_SOURCES: dict[str, Callable[[], DatasetSource]] = {}


def register_dataset(name: str):
    def deco(cls):
        if name in _SOURCES:
            raise ValueError(f"dataset {name!r} registered twice")
        cls.name = name
        _SOURCES[name] = cls
        return cls
    return deco


def get_source(name: str) -> DatasetSource:
    if name not in _SOURCES:
        raise KeyError(f"unknown dataset {name!r}; valid: {', '.join(sorted(_SOURCES))}")
    return _SOURCES[name]()


def dataset_names() -> list[str]:
    return sorted(_SOURCES)
