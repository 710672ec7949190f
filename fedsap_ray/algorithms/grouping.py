"""Group labels in one canonical form, shared by every strategy that clusters clients or prototypes
(FedSAP's DGA, FPL's FINCH clusters), and :func:`agreement`, how well a grouping matches reference
labels (the recording side scores client groups against the true domains with it: ``rounds.ari_domain``).

Canonical: ``0..K-1`` numbered in order of first appearance by index, so element 0 is in group 0
and equal partitions give equal arrays, whatever labels the clustering produced.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np


def canonical_labels(labels: Sequence[Any] | np.ndarray) -> np.ndarray:
    """Relabel a partition as int64 ``0..K-1`` in order of first appearance by index.

    Any hashable, mutually comparable labels (ints, strings) are accepted (papers/000
    Appendix C's pi(i), 0-based, for client groupings).
    """
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"labels must be one-dimensional (one per client), got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(arr, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int64)
    return rank[inverse.reshape(-1)]


def agreement(groups: Sequence[Any] | np.ndarray, labels: Sequence[Any] | np.ndarray) -> float:
    """Adjusted Rand index of a grouping against reference labels (strings or numbers).

    Used to record what Appendix C's DGA actually recovered: ARI against the true domains
    versus against the device-capacity tiers (a grouping that tracks capacity rather than
    domain is the confound to watch for). 1.0 for identical partitions up to relabelling,
    about 0 for independent ones (can be negative).
    """
    from sklearn.metrics import adjusted_rand_score

    g = np.asarray(groups)
    lab = np.asarray(labels)
    if g.ndim != 1 or lab.ndim != 1 or g.shape != lab.shape:
        raise ValueError(f"groups and labels must be 1-D of equal length, got {g.shape} and {lab.shape}")
    return float(adjusted_rand_score(canonical_labels(lab), canonical_labels(g)))
