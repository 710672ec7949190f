"""Vectorised coordinate-wise aggregation shared by every strategy.

Heterogeneous FedAvg (HeteroFL, Diao et al. 2021; papers/003 Algorithm 1 line 18):
each coordinate j becomes the sample-weighted mean of the clients that covered it,

    w_j <- sum_i n_i [m_i]_j w_ij / sum_i n_i [m_i]_j     if sum_i n_i [m_i]_j > 0,
    w_j <- w_j (unchanged, bit-identical)                  otherwise.

With every mask full this is exactly FedAvg (McMahan et al. 2017, Alg. 1). FedSAP's
type-matched aggregation (papers/000 Eq. 8) is this same rule applied separately to
the Global coordinates over all clients and to each pseudo-group's Private coordinates.
Accumulation is in float64 in client-id order, so the result does not depend on which
worker returned first.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def masked_weighted_average(
    old: np.ndarray,
    contributions: Iterable[tuple[np.ndarray | None, np.ndarray, float]],
    restrict: np.ndarray | None = None,
) -> np.ndarray:
    """Return a new float32 vector; ``contributions`` are (mask or None=full, values, weight).

    ``restrict`` (bool) limits which coordinates may change (e.g. FedSAP's Global set);
    values outside it keep ``old`` bit-identically.
    """
    acc = np.zeros(old.shape, dtype=np.float64)
    wsum = np.zeros(old.shape, dtype=np.float64)
    for mask, values, weight in contributions:
        if weight < 0:
            raise ValueError(f"aggregation weight must be >= 0, got {weight}")
        if mask is None:
            if values.size != old.size:
                raise ValueError(f"full update has {values.size} values, model has {old.size}")
            acc += weight * values.astype(np.float64)
            wsum += weight
        else:
            if int(mask.sum()) != values.size:
                raise ValueError(f"mask covers {int(mask.sum())} coordinates but {values.size} values were sent")
            acc[mask] += weight * values.astype(np.float64)
            wsum[mask] += weight
    covered = wsum > 0
    if restrict is not None:
        covered &= restrict
    out = old.copy()
    out[covered] = (acc[covered] / wsum[covered]).astype(np.float32)
    return out


def scatter(values: np.ndarray, mask: np.ndarray | None, size: int, fill: np.ndarray | None = None) -> np.ndarray:
    """Place the covered ``values`` into a full-size float32 vector (``fill`` or zeros elsewhere)."""
    out = np.zeros(size, dtype=np.float32) if fill is None else fill.astype(np.float32, copy=True)
    if mask is None:
        out[:] = values
    else:
        out[mask] = values
    return out
