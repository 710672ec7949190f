"""Flower Datasets' partitioners as explicit partitions (docs/guides/own-data.md#flower-datasets-partitioners).

Flower Datasets (``flwr_datasets.partitioner``: ``IidPartitioner``, ``DirichletPartitioner``,
``ShardPartitioner``, ``PathologicalPartitioner``, ...) splits a Hugging Face ``datasets.Dataset`` into
partitions. :func:`from_flower` gives a partitioner the training labels of each domain of our splits as such a
dataset, built in memory (a ``label`` column and the samples' positions; nothing is downloaded, no image is
copied), and turns its partitions into an :class:`~fedsap_ray.data.explicit.ExplicitPartition`: one client per
partition, numbered domain by domain, each client's indices the positions its partition holds. Save it for
``data.partition=explicit`` (``partition.save(path)``), or pass it to ``build_federation(cfg, partition=...)``;
either way the federation is checked as any explicit partition is, and ``runs.partition_source`` records
``file:<path>`` or ``flower:<Partitioner>``.

The extra it needs is ``flower`` (``pip install 'fedsap-ray[flower]'``: flwr-datasets, which brings
``datasets``), imported only here, when called.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedsap_ray.data.explicit import ExplicitClient, ExplicitPartition
from fedsap_ray.data.registry import DomainSplits
from fedsap_ray.common.errors import ConfigError

LABEL, INDEX = "label", "fedsap_index"  # the columns of the in-memory dataset a partitioner sees
EXTRA = "from_flower needs the flower extra: pip install 'fedsap-ray[flower]'"


def from_flower(partitioners: Any | Mapping[str, Any], splits: DomainSplits) -> ExplicitPartition:
    """The explicit partition a Flower partitioner (or one per domain) makes of ``splits``' training samples.

    ``partitioners``: one partitioner (a dataset of one domain) or ``{domain: partitioner}`` (each domain split
    by its own, e.g. ``DirichletPartitioner(num_partitions=5, partition_by="label", alpha=0.5)``; the domains not
    named get no clients). A partitioner that groups by a column must group by ``label``. Each must be fresh
    (Flower assigns a dataset to a partitioner once). Client ids follow the domains' order, then the partition
    ids; a partition with no sample is refused (every client needs one), naming the domain and partition."""
    try:
        from datasets import Dataset
        from flwr_datasets.partitioner import Partitioner
    except ImportError as e:
        raise ConfigError(f"{EXTRA} ({e})") from e
    if isinstance(partitioners, Partitioner):
        if len(splits.domains) != 1:
            raise ConfigError(f"invalid partitioners: {splits.dataset} has domains {', '.join(splits.domains)}; give one "
                              "partitioner per domain as {domain: partitioner}")
        partitioners = {splits.domains[0]: partitioners}
    if not isinstance(partitioners, Mapping) or not partitioners:
        raise ConfigError("invalid partitioners: a flwr_datasets Partitioner or a non-empty {domain: Partitioner}")
    clients: list[ExplicitClient] = []
    kinds = []
    for domain, p in partitioners.items():
        if domain not in splits.train:
            raise ConfigError(f"invalid partitioners: domain {domain!r} is not one of {splits.dataset}'s: "
                              f"{', '.join(splits.domains)}")
        if not isinstance(p, Partitioner):
            raise ConfigError(f"invalid partitioners[{domain!r}]: {type(p).__name__} is not a flwr_datasets Partitioner")
        labels = np.asarray(splits.train[domain].y, dtype=np.int64)
        p.dataset = Dataset.from_dict({LABEL: labels, INDEX: np.arange(len(labels), dtype=np.int64)})
        for pid in range(p.num_partitions):
            idx = np.asarray(p.load_partition(pid)[INDEX], dtype=np.int64)
            if not len(idx):
                raise ConfigError(f"invalid partitioners[{domain!r}]: partition {pid} of {type(p).__name__} holds no "
                                  "sample; every client needs one (e.g. raise min_partition_size)")
            clients.append(ExplicitClient(len(clients), domain, idx))
        kinds.append(type(p).__name__)
    return ExplicitPartition(tuple(clients), source="flower:" + "+".join(dict.fromkeys(kinds)),
                             where="invalid partition from flwr_datasets")
