"""Dataset registry: each source loads per-domain train/test splits and reports its files.

Adding a dataset means one module with a ``@register_dataset("name")`` class and one
import line in ``fedsap_ray/data/__init__.py``. The table is :data:`fedsap_ray.config.registry.DATASETS`
(the one generic registry), which the config schema asks for ``data.name``; what the config must
know about a dataset is declared in the decorator (``single_domain``, ``natural_partition``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol
from collections.abc import Callable

import numpy as np

from fedsap_ray.data.base import DomainData, InputKind
from fedsap_ray.common.errors import DatasetUnavailable as DatasetUnavailable  # re-exported: it used to live here
from fedsap_ray.common.errors import DatasetUnreadable
from fedsap_ray.config.registry import DATASETS


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
    # sha256 of the arrays of data the package does not own (own arrays, plugins: fedsap_ray.data.own), which
    # runs.partition_hash covers so a --resume on changed data is refused; None for the package's datasets,
    # which are fixed and whose caches are checked against digests of their own
    digest: str | None = None


@dataclass(frozen=True)
class FileStatus:
    what: str
    path: Path
    present: bool


class DatasetSource(Protocol):
    name: str
    description: str
    how_to_obtain: str
    single_domain: ClassVar[bool]  # one domain: data.partition=domain is refused
    natural_partition: ClassVar[bool]  # has natural client splits (data.partition=natural)

    def default_root(self) -> Path: ...

    def files(self, root: Path) -> list[FileStatus]: ...

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits: ...


_SOURCES: dict[str, Callable[[], DatasetSource]] = DATASETS.entries  # the table itself (tests patch it)


def register_dataset(name: str, *, single_domain: bool = False, natural_partition: bool = False,
                     inputs: tuple[InputKind, ...] | None = None) -> Callable[[Any], Any]:
    """Class decorator: register a dataset source under ``name``; ``single_domain`` (the split has one domain,
    so ``data.partition=domain`` is refused) and ``natural_partition`` (it has natural client splits,
    ``data.partition=natural``) are what the config checks read (:class:`fedsap_ray.config.schema.ExperimentConfig`).
    ``inputs``: the kinds of input its loads give (``InputKind``), whose scaling to the model
    (:data:`fedsap_ray.data.base.INPUT_SCALING`) the datasets reference states; a load of another kind is refused
    (:func:`check_inputs`). None: not declared (the reference says so)."""
    def deco(cls: Any) -> Any:
        cls.single_domain, cls.natural_partition, cls.input_kinds = single_domain, natural_partition, inputs
        return DATASETS.register(name)(cls)
    return deco


def check_inputs(source: Any, splits: DomainSplits) -> DomainSplits:
    """``splits``, if their ``input_kind`` is one the source declared (``register_dataset(inputs=...)``): the
    datasets reference states each dataset's input scaling from that declaration, so it must be the truth."""
    declared = getattr(source, "input_kinds", None)
    if declared is not None and splits.input_kind not in declared:
        raise TypeError(f"dataset {getattr(source, 'name', source)!r} declares inputs {tuple(declared)} but its load "
                        f"gave {splits.input_kind!r}: fix its register_dataset(inputs=...)")
    return splits


def get_source(name: str) -> DatasetSource:
    DATASETS.load()
    if name not in _SOURCES:
        raise KeyError(f"unknown dataset {name!r}; valid: {', '.join(sorted(_SOURCES))}")
    return _SOURCES[name]()


def dataset_names() -> list[str]:
    return DATASETS.names()
