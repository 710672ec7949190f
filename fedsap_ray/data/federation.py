"""Build a :class:`Federation` from a config: load splits, cap pools, partition, capacities, TV.

Rules (docs/guides/data.md#partitions-and-capacities), in order:

1. Load the dataset's per-domain splits (cached within the process, see :func:`load_splits`).
2. Cap each domain's training pool to ``data.max_train_per_domain`` (random subset drawn
   from the run seed) and its test set to ``data.max_test_per_domain`` (random subset
   drawn from a *fixed* seed, so every run of a sweep is scored on the same samples).
   Partitions then index the capped pools; ``client_fraction`` applies to the capped size.
3. Partition by ``data.partition``:
   - ``domain``: :func:`~fedsap_ray.data.partition.domain_protocol` (Digits/Office).
   - ``dirichlet`` / ``iid``: clients are first given domains as in the domain protocol
     (one per domain, the rest uniformly at random; a single-domain dataset puts every
     client there), then each domain's whole pool is split among its own clients by
     per-class Dirichlet(alpha) label skew, or uniformly. A client's indices always point
     into one domain, so multi-domain datasets get domain shift *and* label skew.
   - ``natural``: the ``num_clients`` natural clients with most samples (Shakespeare
     roles); needs a single-domain dataset with ``natural_train``.
   - ``explicit``: the clients of ``data.partition_file`` (:mod:`fedsap_ray.data.explicit`), or of the
     :class:`~fedsap_ray.data.explicit.ExplicitPartition` passed as ``partition``, which wins over the
     config's scheme; either indexes each domain's uncapped training split.
4. Capacities by :func:`~fedsap_ray.data.capacity.assign_capacities`; an explicit partition's own
   capacities replace those of its clients (pruning ratio 1 - capacity).
5. Ground truth: each client's label counts and the TV distance to the label
   distribution of the union of the training pools its federation draws from
   (papers/003 section 4.4).

Seeds: partition and train-cap generators come from ``SeedSequence((seed, purpose))``
with distinct purpose constants; capacities use their own purpose inside
``assign_capacities``; so changing one never shifts another's stream.

The federation records where its split came from (``Federation.partition_source``: ``builtin:<scheme>``,
``file:<path>``, or the partition object's ``source``) and own data's digest (``data_digest``), which
``runs.partition_source`` and ``runs.partition_hash`` record (:func:`fedsap_ray.data.explicit.partition_digest`).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from fedsap_ray.data.base import ClientSpec, DomainData, Federation
from fedsap_ray.data.capacity import assign_capacities
from fedsap_ray.data.explicit import ExplicitPartition, read_partition
from fedsap_ray.data.partition import (
    PartitionError,
    assign_domains,
    dirichlet_label_skew,
    domain_protocol,
    iid_split,
    label_counts,
    natural_partition,
    tv_distance,
)
from fedsap_ray.data.own import OwnData, digest_if_own
from fedsap_ray.data.registry import DatasetSource, DomainSplits, check_inputs, get_source, unreadable
from fedsap_ray.common.errors import ConfigError, DatasetUnavailable, DatasetUnreadable
from fedsap_ray.config.schema import DataConfig, ExperimentConfig

_PURPOSE_PARTITION = 101
_PURPOSE_TRAIN_CAP = 102
_PURPOSE_TEST_CAP = 103
_TEST_CAP_SEED = 0  # fixed: held-out subsets do not change with the run seed


def resolve_root(data: DataConfig, source: DatasetSource) -> Path:
    """``data.root`` when set, else the source's default location."""
    return Path(data.root).expanduser() if data.root is not None else source.default_root()


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, root: str, download: bool, seed: int) -> DomainSplits:
    source = get_source(name)
    try:
        return source.load(Path(root), download=download, seed=seed)
    except DatasetUnavailable:
        raise
    except _DAMAGED as e:  # a loader without its own per-file message: name the dataset's folder
        if isinstance(e, FileNotFoundError):
            raise
        raise unreadable(name, Path(root), e, source.how_to_obtain) from e


def _damaged() -> tuple[type[BaseException], ...]:
    """Errors that only a truncated or damaged file raises (ValueError/KeyError are left to the loaders)."""
    import pickle
    import tarfile
    import zipfile
    import zlib

    return (zipfile.BadZipFile, zlib.error, EOFError, pickle.UnpicklingError, tarfile.TarError, OSError)


_DAMAGED = _damaged()


def load_splits(cfg: ExperimentConfig) -> DomainSplits:
    """The dataset's splits, loaded once per process per (name, root, download).

    Datasets are fixed, so sources are called with ``seed=0`` and the run seed is not part
    of the cache key; a source whose splits really depend on the seed declares
    ``seed_dependent = True`` and is then loaded (and cached) per run seed. Callers must
    not modify the returned tensors in place: they are shared between runs.
    """
    source = get_source(cfg.data.name)
    root = resolve_root(cfg.data, source)
    seed = int(cfg.seed) if getattr(source, "seed_dependent", False) else 0
    if isinstance(source, OwnData):  # holds its arrays itself (and a replaced registration must not be served)
        return source.load(root, download=bool(cfg.data.download), seed=seed)
    try:
        return check_inputs(source, digest_if_own(source, _load_cached(cfg.data.name, str(root), bool(cfg.data.download),
                                                                       seed)))
    except DatasetUnavailable as e:
        shared = os.environ.get("FEDSAP_SHARED_DATA")
        if cfg.data.root is not None or not shared or isinstance(e, DatasetUnreadable):
            raise
        # the default root fell back to the cache because the shared folder lacks the files: say so, naming it
        folder = Path(shared).expanduser()
        state = "does not exist" if not folder.exists() else "is not a folder" if not folder.is_dir() else \
            "is empty" if not any(folder.iterdir()) else f"lacks the {cfg.data.name} files"
        raise type(e)(f"{e}; nor under FEDSAP_SHARED_DATA={shared}: that folder {state}") from e


def clear_split_cache() -> None:
    """Drop the in-process split cache (e.g. after files under a root changed)."""
    _load_cached.cache_clear()


def _subsample(n: int, cap: int | None, rng: np.random.Generator) -> np.ndarray | None:
    """Sorted random subset of ``range(n)`` of size ``cap``, or None when no cap applies."""
    if cap is None or n <= cap:
        return None
    return np.sort(rng.choice(n, size=cap, replace=False)).astype(np.int64)


def _natural_roles(splits: DomainSplits, data: DataConfig) -> list[str] | None:
    """The natural clients of a ``data.partition=natural`` run (papers/003 section 4.1: the
    ``num_clients`` roles with the most training windows), chosen on the full split, before any cap,
    so ``data.max_train_per_domain`` never changes which roles form the federation."""
    if data.partition != "natural" or splits.natural_train is None or len(splits.domains) != 1:
        return None
    try:
        return [name for name, _ in natural_partition(splits.natural_train, data.num_clients)]
    except PartitionError as e:
        raise ConfigError(f"invalid {e.field}={data.num_clients!r}: data.name={data.name}, data.partition=natural: "
                          f"{e}") from e


def _role_pool(dd: DomainData, natural: dict[str, np.ndarray], roles: list[str]) -> tuple[DomainData, dict[str, np.ndarray]]:
    """``dd`` restricted to the rows of ``roles`` (in role order), with each role's positions in the new pool."""
    parts = [np.sort(np.asarray(natural.get(r, np.zeros(0, np.int64)), dtype=np.int64)) for r in roles]
    ends = np.cumsum([len(p) for p in parts])
    pos = {r: np.arange(e - len(p), e, dtype=np.int64) for r, p, e in zip(roles, parts, ends)}
    pool = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return dd.subset(pool), pos


def _cap_splits(splits: DomainSplits, data: DataConfig, seed: int) -> tuple[
        dict[str, DomainData], dict[str, DomainData], dict[str, np.ndarray] | None]:
    """Per-domain train pools and test sets after the caps; for a natural partition the pools first
    shrink to the chosen roles' rows (:func:`_natural_roles`): training windows of those roles only,
    and as test set those roles' own held-out windows (``natural_test``), as LEAF evaluates each
    client on its own text. The caps then subsample what is left."""
    train, test = dict(splits.train), dict(splits.test)
    natural = splits.natural_train
    roles = _natural_roles(splits, data)
    if roles is not None and natural is not None:
        d0 = splits.domains[0]
        train[d0], natural = _role_pool(train[d0], natural, roles)
        if splits.natural_test is not None:
            test[d0], _ = _role_pool(test[d0], splits.natural_test, roles)
    for k, d in enumerate(splits.domains):
        keep = _subsample(len(train[d]), data.max_train_per_domain,
                          np.random.default_rng(np.random.SeedSequence((seed, _PURPOSE_TRAIN_CAP, k))))
        if keep is not None:
            if natural is not None and len(splits.domains) == 1:  # remap natural indices to the capped pool
                new_pos = np.full(len(train[d]), -1, dtype=np.int64)
                new_pos[keep] = np.arange(len(keep))
                natural = {name: new_pos[idx][new_pos[idx] >= 0] for name, idx in natural.items()}
                natural = {name: idx for name, idx in natural.items() if len(idx)}
            train[d] = train[d].subset(keep)
        keep = _subsample(len(test[d]), data.max_test_per_domain,
                          np.random.default_rng(np.random.SeedSequence((_TEST_CAP_SEED, _PURPOSE_TEST_CAP, k))))
        if keep is not None:
            test[d] = test[d].subset(keep)
    return train, test, natural


def _labels(dd: DomainData) -> np.ndarray:
    return dd.y.numpy() if hasattr(dd.y, "numpy") else np.asarray(dd.y)


def partition_clients_checked(splits_domains: list[str], train: dict[str, DomainData],
                              natural: dict[str, np.ndarray] | None, data: DataConfig,
                              seed: int) -> list[tuple[str, np.ndarray]]:
    """:func:`partition_clients`, with a partition the data cannot give refused as bad input
    (:class:`ConfigError` naming the field, e.g. more clients than samples) before any training."""
    try:
        return partition_clients(splits_domains, train, natural, data, seed)
    except PartitionError as e:
        section, _, name = e.field.partition(".")
        value = getattr(data, name, e.value) if section == "data" else e.value  # the config's value, not a per-domain count
        raise ConfigError(f"invalid {e.field}={value!r}: data.name={data.name}, data.partition={data.partition}: "
                          f"{e}") from e


def partition_clients(splits_domains: list[str], train: dict[str, DomainData],
                      natural: dict[str, np.ndarray] | None, data: DataConfig,
                      seed: int) -> list[tuple[str, np.ndarray]]:
    """(domain, indices into train[domain]) per client id, by ``data.partition``."""
    rng = np.random.default_rng(np.random.SeedSequence((seed, _PURPOSE_PARTITION)))
    n = data.num_clients
    samples = sum(len(train[d]) for d in splits_domains)
    if n > samples:  # before anything is allocated per client (10**12 clients ran out of memory here)
        raise PartitionError("data.num_clients", n, f"{n} clients but only {samples} training samples (every client "
                                                    "needs at least one); use fewer clients")
    if data.partition == "domain":
        return domain_protocol({d: len(train[d]) for d in splits_domains}, n, data.client_fraction, rng)
    if data.partition in ("dirichlet", "iid"):
        client_domain = assign_domains(splits_domains, n, rng)
        out: list[tuple[str, np.ndarray] | None] = [None] * n
        for d in splits_domains:
            ids = [i for i, cd in enumerate(client_domain) if cd == d]
            try:
                if data.partition == "dirichlet":
                    parts = dirichlet_label_skew(_labels(train[d]), len(ids), data.alpha, rng, data.min_samples)
                else:
                    parts = iid_split(len(train[d]), len(ids), rng)
            except PartitionError as e:
                raise PartitionError(e.field, e.value, f"domain {d!r} ({len(train[d])} training samples, "
                                     f"{len(ids)} clients): {e}") from e
            for cid, idx in zip(ids, parts):
                out[cid] = (d, idx)
        return [o for o in out if o is not None]
    if data.partition == "natural":
        if natural is None:
            raise ValueError(f"data.partition=natural: dataset {data.name!r} has no natural client split")
        if len(splits_domains) != 1:
            raise ValueError(f"data.partition=natural needs a single-domain dataset, {data.name!r} has "
                             f"{len(splits_domains)}")
        return [(splits_domains[0], idx) for _, idx in natural_partition(natural, n)]
    raise ValueError(f"unknown data.partition={data.partition!r}; allowed: domain, dirichlet, natural, iid (explicit: "
                     "build_federation reads data.partition_file)")


# (dataset, model) pairs whose model takes the dataset's native input rather than the stored one:
# papers/003 Table 1 sizes the EMNIST CNN on 1x28x28 input (3.28M parameters, 118.2M MACs at p = 1;
# on the stored 3x32x32 the same network costs 154.9M MACs, the CIFAR-10 figure).
NATIVE_INPUT: dict[tuple[str, str], tuple[int, ...]] = {("emnist", "cnn_emnist"): (1, 28, 28)}


def native_emnist(dd: DomainData) -> DomainData:
    """EMNIST as stored by :mod:`fedsap_ray.data.emnist` (uint8 3x32x32: upright, grey repeated, 2-pixel
    zero border) back to the native upright 1x28x28 -- exact: the border is zero and the channels equal."""
    x = dd.x
    if tuple(x.shape[1:]) == (1, 28, 28):
        return dd
    if tuple(x.shape[1:]) != (3, 32, 32):
        raise ValueError(f"emnist: expected stored images of shape (3, 32, 32), got {tuple(x.shape[1:])}")
    return DomainData(x[:, :1, 2:30, 2:30].contiguous(), dd.y)


def _model_input(dataset: str, model: str, train: dict[str, DomainData], test: dict[str, DomainData],
                 input_shape: tuple[int, ...]) -> tuple[dict[str, DomainData], dict[str, DomainData], tuple[int, ...]]:
    """The pools and input shape the run's model is fed (:data:`NATIVE_INPUT`; others unchanged)."""
    shape = NATIVE_INPUT.get((dataset, model))
    if shape is None or tuple(input_shape) == shape:
        return train, test, tuple(input_shape)
    return ({d: native_emnist(v) for d, v in train.items()}, {d: native_emnist(v) for d, v in test.items()}, shape)


def build_federation(cfg: ExperimentConfig, splits: DomainSplits | None = None,
                     partition: ExplicitPartition | None = None) -> Federation:
    """The run's data: capped per-domain pools and test sets, clients with capacities and TV.

    ``splits``: the dataset's splits when the caller already has them (e.g. the node-shared,
    memory-mapped ones of :func:`fedsap_ray.data.node_cache.shared_splits`); else ``load_splits(cfg)``.
    ``partition``: the clients' samples, replacing ``data.partition`` (e.g. from a Flower partitioner,
    :func:`fedsap_ray.data.flower.from_flower`); with ``data.partition=explicit`` it is read from
    ``data.partition_file``. Either is checked against the data here, before any work.
    """
    data = cfg.data
    if partition is None and data.partition == "explicit":
        partition = read_partition(str(data.partition_file))  # structural refusals before the data is loaded
    if partition is not None and data.max_train_per_domain is not None:
        raise ConfigError(f"invalid data.max_train_per_domain={data.max_train_per_domain!r}: not read with an explicit "
                          "partition (it names each client's samples in the dataset's own training split): leave it null")
    if splits is None:
        splits = load_splits(cfg)
    if partition is None and data.partition == "domain" and len(splits.domains) == 1:  # own data: known once loaded
        raise ConfigError(f"invalid data.partition='domain': data.name={data.name} has one domain: use dirichlet, "
                          "iid or explicit")
    train, test, natural = _cap_splits(splits, data, int(cfg.seed))
    train, test, input_shape = _model_input(data.name, cfg.model.name, train, test, tuple(splits.input_shape))
    if partition is not None:
        parts = partition.assign(list(splits.domains), {d: len(train[d]) for d in splits.domains}, data.num_clients)
        source = partition.source
    else:
        parts = partition_clients_checked(list(splits.domains), train, natural, data, int(cfg.seed))
        source = f"builtin:{data.partition}"
    rho, cap = assign_capacities(cfg.capacity, data.num_clients, int(cfg.seed))
    if partition is not None:
        for cid, kappa in partition.capacities().items():  # the partition's own capacities win (module docstring)
            rho[cid], cap[cid] = 1.0 - kappa, kappa

    used = [d for d in splits.domains if any(cd == d for cd, _ in parts)]
    global_counts = np.sum([label_counts(_labels(train[d]), splits.num_classes) for d in used], axis=0)
    clients = []
    for cid, (d, idx) in enumerate(parts):
        counts = label_counts(_labels(train[d])[idx], splits.num_classes)
        clients.append(ClientSpec(client_id=cid, domain=d, indices=idx, pruning_ratio=float(rho[cid]),
                                  capacity=float(cap[cid]), tv_distance=tv_distance(counts, global_counts),
                                  label_counts=counts))
    return Federation(
        dataset=splits.dataset,
        domains=list(splits.domains),
        train=train,
        test=test,
        clients=clients,
        num_classes=splits.num_classes,
        input_kind=splits.input_kind,
        input_shape=input_shape,
        vocab_size=splits.vocab_size,
        notes=splits.notes,
        domain_notes=dict(splits.domain_notes),
        partition_source=source,
        data_digest=splits.digest,
    )
