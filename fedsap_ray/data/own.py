"""Your own data, registered without editing the package (docs/guides/own-data.md).

Two ways in, one result: a dataset in :data:`fedsap_ray.config.registry.DATASETS`, usable as ``data.name`` by the
command line, the sweeps and ``run_experiment`` like the package's own.

- :func:`register_arrays` registers train and test arrays held in this process (a notebook, a script that then
  calls ``run_experiment``). :func:`register_loader` registers a function that returns them, called once, on
  first use.
- A plugin: an installed distribution declares an entry point in the group ``fedsap_ray.datasets`` whose name is
  the dataset's (``mydata = mypkg.data:load``). The registry loads it the first time it is asked for a name it does
  not hold (:meth:`fedsap_ray.config.registry.Registry.load_plugin`), in every process that asks (a Ray worker, a Tune
  trial), and hands it to :func:`register_plugin`: a function is registered as a loader, a class as a dataset
  source like the package's own (docs/guides/development.md#adding-a-dataset).

What the arrays may be (checked when registered, or when a loader's arrays arrive; each refusal names the dataset,
the split and the array): ``x`` uint8 images N x C x H x W (mapped to [-1, 1] per batch, as every image dataset:
:func:`fedsap_ray.data.base.as_input`), floating-point features N x ... (stored as float32, fed unchanged; NaN and
infinity refused) or integer token ids N x T (text; ``vocab_size`` defaults to the largest id + 1); ``y`` one
integer label in 0..num_classes-1 per sample; optionally one domain name per sample (a split without them is one
domain named after the dataset). Every training domain needs test samples, and the test split may name no other
domain. The arrays are copied when registered, so changing the caller's arrays afterwards changes nothing.

Why a digest: the package's datasets are fixed (their caches are checked against digests of their content); own
data can change under the same name between a run and its ``--resume``. Each own dataset carries the sha256 of its
arrays (:attr:`~fedsap_ray.data.registry.DomainSplits.digest`), which ``runs.partition_hash`` covers
(:func:`fedsap_ray.data.explicit.partition_digest`), so a resume on changed data is refused, naming both hashes.
Plugins are loaded in each process, never through the node cache (:mod:`fedsap_ray.data.node_cache`): it watches a
dataset's files, and own data has none to watch.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsap_ray.data.base import DomainData, InputKind
from fedsap_ray.data.registry import DomainSplits, FileStatus, register_dataset
from fedsap_ray.data.status import cache_home
from fedsap_ray.persist.digest import arrays_digest
from fedsap_ray.common.errors import DatasetUnreadable
from fedsap_ray.config.registry import DATASETS

GROUP = "fedsap_ray.datasets"  # the entry point group of dataset plugins (DATASETS.plugins)
SOURCE_ATTRS = ("description", "how_to_obtain", "default_root", "files", "load")  # a dataset class has them all

Split = Any  # (x, y), (x, y, domains) or {domain: (x, y)}; arrays are numpy arrays, torch tensors or sequences


class OwnData:
    """A dataset made of arrays (:func:`register_arrays`, :func:`register_loader`, a plugin's loader function).

    The registry holds it as its own factory (``get_source`` calls what the registry holds, and this returns
    itself), so what the config reads of a dataset (``single_domain``) is known as soon as it is registered."""

    natural_partition = False  # no natural client split: data.partition=explicit is how own splits come in
    node_cache = False  # loaded in each process: there are no files for the node cache to watch
    digest_data = False  # its digest is taken when its arrays arrive (load_splits takes a class plugin's)
    input_kinds: tuple[InputKind, ...] | None = None  # known once its arrays are (register_arrays)

    def __init__(self, name: str, make: Callable[[], DomainSplits], *, description: str, how_to_obtain: str,
                 single_domain: bool, splits: DomainSplits | None = None) -> None:
        self.name, self.description, self.how_to_obtain = name, description, how_to_obtain
        self.single_domain = single_domain
        self._make, self._splits = make, splits

    def __call__(self) -> OwnData:
        return self

    def default_root(self) -> Path:
        return cache_home()  # never read: the arrays are in memory

    def files(self, root: Path) -> list[FileStatus]:
        return []

    def load(self, root: Path, *, download: bool = False, seed: int = 0) -> DomainSplits:
        """The arrays as :class:`DomainSplits` (a loader is called the first time only); ``root``, ``download``
        and ``seed`` are accepted for the protocol and ignored."""
        if self._splits is None:
            self._splits = self._make()
        return self._splits


def register_arrays(name: str, train: Split, test: Split, *, num_classes: int | None = None,
                    vocab_size: int | None = None, description: str | None = None, notes: str = "",
                    replace: bool = False) -> None:
    """Register ``train`` and ``test`` under ``name`` in this process (module docstring: what they may be).

    ``train``/``test``: ``(x, y)``, ``(x, y, domains)`` with one domain name per sample, or ``{domain: (x, y)}``.
    ``num_classes`` defaults to the largest label + 1. ``replace=True`` replaces an own dataset registered under
    ``name`` before (a package dataset is never replaced). Bad arrays raise :class:`ValueError` naming the dataset,
    the split and the array; nothing is registered then."""
    splits = make_splits(name, train, test, num_classes=num_classes, vocab_size=vocab_size, notes=notes
                         or f"{name}: own arrays registered with fedsap_ray.data.register_arrays")
    source = OwnData(name, lambda: splits, description=description or _describe(splits),
                     how_to_obtain="registered in this process by fedsap_ray.data.register_arrays",
                     single_domain=len(splits.domains) == 1, splits=splits)
    source.input_kinds = (splits.input_kind,)
    _register(name, source, replace)


def register_loader(name: str, loader: Callable[[], Mapping[str, Any]], *, description: str | None = None,
                    origin: str | None = None, replace: bool = False) -> None:
    """Register ``loader`` under ``name``: a function of no arguments returning :func:`register_arrays`' keyword
    arguments (``{"train": ..., "test": ..., "num_classes": ...}``), called once per process, the first time the
    dataset is loaded (so registering costs nothing until a run uses it). What it returns is checked as
    :func:`register_arrays` checks its arguments; anything it raises, or a bad array, stops the run with exit 2 and
    one line naming the dataset and ``origin`` (who registered it)."""
    origin = origin or f"the loader {getattr(loader, '__qualname__', loader)!s} registered with register_loader"

    def make() -> DomainSplits:
        try:
            got = loader()
            if not isinstance(got, Mapping):
                raise TypeError(f"it returned {type(got).__name__}, not a mapping of register_arrays' arguments "
                                "(train=..., test=..., ...)")
            allowed = {"train", "test", "num_classes", "vocab_size", "notes"}
            unknown = sorted(str(k) for k in got if k not in allowed)
            if unknown or "train" not in got or "test" not in got:
                raise TypeError(f"it returned the keys {sorted(map(str, got))}; train and test are needed, "
                                f"and only {', '.join(sorted(allowed))} are read")
            return make_splits(name, got["train"], got["test"], num_classes=got.get("num_classes"),
                               vocab_size=got.get("vocab_size"), notes=got.get("notes") or f"{name}: loaded by {origin}")
        except Exception as e:  # someone else's code: one line, exit 2 (DatasetUnavailable), never a traceback
            first = (str(e).splitlines() or [""])[0]
            raise DatasetUnreadable(f"{name}: {origin} failed: {e.__class__.__name__}: {first}") from e

    doc = (getattr(loader, "__doc__", None) or "").strip().splitlines()
    _register(name, OwnData(name, make, description=description or (doc[0] if doc else f"own data ({origin})"),
                            how_to_obtain=f"loaded on first use by {origin}", single_domain=False), replace)


def register_plugin(name: str, obj: Any, entry_point: Any) -> None:
    """What the dataset registry calls with a plugin's loaded entry point (:data:`GROUP`): a class is registered as
    a dataset source (it must have :data:`SOURCE_ATTRS`; its ``single_domain`` and ``natural_partition`` are read
    if it sets them), any other callable as a loader (:func:`register_loader`). Either way it is loaded in every
    process that asks, not through the node cache, and its arrays' digest is taken (module docstring)."""
    where = f"plugin entry point {entry_point.name} = {entry_point.value}"
    if isinstance(obj, type):
        lacking = [a for a in SOURCE_ATTRS if not hasattr(obj, a)]
        if lacking:
            raise TypeError(f"{entry_point.value} is a class without {', '.join(lacking)}: a dataset class has "
                            f"{', '.join(SOURCE_ATTRS)} (docs/guides/development.md#adding-a-dataset)")
        cls: Any = obj  # a class of someone else's: these attributes are ours to set
        cls.node_cache, cls.digest_data = False, True  # loaded by each process; load_splits digests its arrays
        register_dataset(name, single_domain=bool(getattr(cls, "single_domain", False)),
                         natural_partition=bool(getattr(cls, "natural_partition", False)))(cls)
        return
    if not callable(obj):
        raise TypeError(f"{entry_point.value} is a {type(obj).__name__}: a plugin names a loader function or a "
                        "dataset class")
    register_loader(name, obj, origin=where)


def _register(name: str, source: OwnData, replace: bool) -> None:
    if not isinstance(name, str) or not name or name != name.strip() or "=" in name:
        raise ValueError(f"register: the dataset name {name!r} must be a non-empty word (it is data.name)")
    held = DATASETS.entries.get(name)
    if held is not None:
        if not (replace and isinstance(held, OwnData)):
            what = "an own dataset: pass replace=True to replace it" if isinstance(held, OwnData) else \
                "a dataset of the package, which is never replaced: choose another name"
            raise ValueError(f"register: data.name={name!r} is already registered as {what}")
        DATASETS.unregister(name)  # load_splits asks an OwnData itself, never a cache, so the old arrays are gone
    DATASETS.register(name)(source)


def _describe(splits: DomainSplits) -> str:
    n_train = sum(len(d) for d in splits.train.values())
    n_test = sum(len(d) for d in splits.test.values())
    shape = "x".join(str(s) for s in splits.input_shape)
    return (f"own data: {len(splits.domains)} domain(s), {splits.num_classes} classes, {splits.input_kind} "
            f"{shape} ({n_train:,} train / {n_test:,} test)")


# ----------------------------------------------------------------------------- checking the arrays

def make_splits(name: str, train: Split, test: Split, *, num_classes: int | None = None, vocab_size: int | None = None,
                notes: str = "") -> DomainSplits:
    """The checked :class:`DomainSplits` of own arrays (module docstring), with their digest; a
    :class:`ValueError` naming the dataset, the split and the array otherwise."""
    parts = {part: _domains(name, part, value) for part, value in (("train", train), ("test", test))}
    kinds = {(part, d): _kind(x) for part, doms in parts.items() for d, (x, _) in doms.items()}
    first = next(iter(kinds.items()))
    for where, kind in kinds.items():
        if kind != first[1]:
            raise ValueError(f"{name}: {where[0]} domain {where[1]!r}: x is {kind[0]} of per-sample shape {kind[1]}, "
                             f"{first[0][0]} domain {first[0][1]!r} is {first[1][0]} of shape {first[1][1]}: every "
                             "split and domain must hold the same kind of input")
    input_kind, input_shape = first[1]
    domains = list(parts["train"])
    extra = [d for d in parts["test"] if d not in parts["train"]]
    if extra:
        raise ValueError(f"{name}: test names domain(s) {extra} that train lacks (train has {domains})")
    lacking = [d for d in domains if d not in parts["test"] or not len(parts["test"][d][1])]
    if lacking:
        raise ValueError(f"{name}: training domain(s) {lacking} have no test samples: every domain is evaluated "
                         "on its own test set")
    labels = [y for doms in parts.values() for _, y in doms.values()]
    top = max(int(y.max()) for y in labels if len(y))
    if num_classes is None:
        num_classes = top + 1
    if not isinstance(num_classes, (int, np.integer)) or isinstance(num_classes, bool) or num_classes < 1 \
            or top >= num_classes:
        raise ValueError(f"{name}: num_classes={num_classes!r}: must be an integer above every label (the largest "
                         f"is {top})")
    if input_kind == "text":
        top_token = max(int(x.max()) for doms in parts.values() for x, _ in doms.values() if x.numel())
        vocab_size = top_token + 1 if vocab_size is None else vocab_size
        if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool) or vocab_size <= top_token:
            raise ValueError(f"{name}: vocab_size={vocab_size!r}: must be an integer above every token id (the "
                             f"largest is {top_token})")
    elif vocab_size is not None:
        raise ValueError(f"{name}: vocab_size={vocab_size!r} is read only for integer token inputs (text); x is "
                         f"{input_kind}")
    data = {part: {d: DomainData(x, torch.from_numpy(y)) for d, (x, y) in doms.items()}
            for part, doms in parts.items()}
    splits = DomainSplits(dataset=name, domains=domains, train=data["train"],
                          test={d: data["test"][d] for d in domains}, num_classes=int(num_classes),
                          input_kind=input_kind, input_shape=tuple(input_shape),
                          vocab_size=None if vocab_size is None else int(vocab_size), notes=notes)
    splits.digest = splits_digest(splits)
    return splits


def splits_digest(splits: DomainSplits) -> str:
    """sha256 of a dataset's arrays (every domain's train and test x and y, in domain order) and of what describes
    them (name, domains, classes, input kind and shape, vocabulary): what ``runs.partition_hash`` covers of own
    data (:mod:`fedsap_ray.persist.digest`)."""
    arrays = {f"{part}/{k:06d}/{a}": getattr(getattr(splits, part)[d], a).numpy()
              for part in ("train", "test") for k, d in enumerate(splits.domains) for a in ("x", "y")}
    meta = {"dataset": splits.dataset, "domains": list(splits.domains), "num_classes": splits.num_classes,
            "input_kind": splits.input_kind, "input_shape": list(splits.input_shape), "vocab_size": splits.vocab_size}
    return arrays_digest(arrays, meta=meta)


def _domains(name: str, part: str, value: Split) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    """``{domain: (x, y)}`` of one split, each array checked (:func:`_x`, :func:`_y`)."""
    if isinstance(value, Mapping):
        if not value:
            raise ValueError(f"{name}: {part} is an empty mapping; give {{domain: (x, y)}} with at least one domain")
        out = {}
        for d, xy in value.items():
            if not isinstance(d, str) or not d:
                raise ValueError(f"{name}: {part}: domain names must be non-empty strings, got {d!r}")
            if not isinstance(xy, Sequence) or isinstance(xy, str) or len(xy) != 2:
                raise ValueError(f"{name}: {part}[{d!r}] must be (x, y)")
            out[d] = _pair(name, f"{part}[{d!r}]", xy[0], xy[1])
        return out
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) not in (2, 3):
        raise ValueError(f"{name}: {part} must be (x, y), (x, y, domains) or {{domain: (x, y)}}, got "
                         f"{type(value).__name__}")
    x, y = _pair(name, part, value[0], value[1])
    if len(value) == 2:
        return {name: (x, y)}
    doms = np.asarray(value[2])
    if doms.ndim != 1 or len(doms) != len(y):
        raise ValueError(f"{name}: {part} domains must be one name per sample ({len(y)}), got shape {doms.shape}")
    if doms.dtype.kind not in "iuU" and not (doms.dtype.kind == "O" and all(isinstance(v, str) for v in doms)):
        raise ValueError(f"{name}: {part} domains must be strings or integers, got {doms.dtype}")
    names = doms.astype(str)
    if (names == "").any():
        raise ValueError(f"{name}: {part} domains: a domain name is empty")
    out = {}
    for d in dict.fromkeys(names.tolist()):  # first appearance order
        idx = np.flatnonzero(names == d)
        out[d] = (x[torch.from_numpy(idx)], y[idx])
    return out


def _pair(name: str, where: str, x: Any, y: Any) -> tuple[torch.Tensor, np.ndarray]:
    xa = _array(x)
    ya = _array(y)
    if ya.ndim != 1 or ya.dtype.kind not in "iu":
        raise ValueError(f"{name}: {where} y must be one integer label per sample (1-D), got {ya.dtype} of shape "
                         f"{ya.shape}")
    if xa.ndim < 2 or len(xa) != len(ya):
        raise ValueError(f"{name}: {where} x has shape {xa.shape}: must be N x ... with N = {len(ya)}, the labels' count")
    if not len(ya):
        raise ValueError(f"{name}: {where} has no samples")
    if ya.min() < 0:
        raise ValueError(f"{name}: {where} y has a negative label ({int(ya.min())}); labels are 0..num_classes-1")
    kind = xa.dtype.kind
    if xa.dtype == np.uint8:
        if xa.ndim != 4:
            raise ValueError(f"{name}: {where} x is uint8 of shape {xa.shape}: uint8 input is images, N x C x H x W "
                             "(give features as floats)")
        out = np.array(xa, dtype=np.uint8, copy=True)
    elif kind == "f":
        out = np.array(xa, dtype=np.float32, copy=True)
        if not np.isfinite(out).all():
            raise ValueError(f"{name}: {where} x holds NaN or infinite values (as float32)")
    elif kind in "iu":
        if xa.ndim != 2 or (len(xa) and xa.min() < 0):
            raise ValueError(f"{name}: {where} x is integer of shape {xa.shape}: integer input is token ids >= 0, "
                             "N x T (give features as floats, images as uint8)")
        out = np.array(xa, dtype=np.int64, copy=True)
    else:
        raise ValueError(f"{name}: {where} x is {xa.dtype}: give uint8 images, floating-point features or integer "
                         "token ids")
    return torch.from_numpy(out), np.array(ya, dtype=np.int64, copy=True)


def _array(a: Any) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _kind(x: torch.Tensor) -> tuple[InputKind, tuple[int, ...]]:
    kind: InputKind = "image" if x.dtype == torch.uint8 else "features" if x.is_floating_point() else "text"
    return kind, tuple(int(s) for s in x.shape[1:])


def digest_if_own(source: Any, splits: DomainSplits) -> DomainSplits:
    """``splits`` with their digest taken when ``source`` is a class plugin's (``digest_data``) and it lacks one:
    what :func:`fedsap_ray.data.federation.load_splits` calls, once per loaded splits."""
    if splits.digest is None and getattr(source, "digest_data", False):
        splits.digest = splits_digest(splits)
    return splits


__all__ = ["GROUP", "OwnData", "make_splits", "register_arrays", "register_loader", "register_plugin", "splits_digest"]
