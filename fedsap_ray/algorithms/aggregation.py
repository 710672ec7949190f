"""Vectorised coordinate-wise aggregation shared by every strategy.

Heterogeneous FedAvg (papers/003 Algorithm 1 line 18, its reading of HeteroFL, Diao et al. 2021):
each coordinate j becomes the sample-weighted mean of the clients that covered it,

    w_j <- sum_i n_i [m_i]_j w_ij / sum_i n_i [m_i]_j     if sum_i n_i [m_i]_j > 0,
    w_j <- w_j (unchanged, bit-identical)                  otherwise.

With every mask full this is exactly FedAvg (McMahan et al. 2017, Alg. 1). HeteroFL's own code weights
every client by 1 instead of n_i (``heterofl``'s ``algorithm.weighting=count``: the same function, other
weights; docs/readings.md#heterofl-as-its-authors-code-runs-it). FedSAP's
type-matched aggregation (papers/000 Eq. 8) is this same rule applied separately to
the Global coordinates over all clients and to each pseudo-group's Private coordinates.
Accumulation is in float64 in client-id order, so the result does not depend on which
worker returned first.

Speed (issue 42). At the papers' width (ResNet10, 4.9M parameters) the plain form, one
``acc[mask] += w * values.astype(float64)`` over the whole vector per client, ran on one core
while the other cores idled (docs/guides/performance.md has the figure). The coordinates are independent,
so the vector is cut into :data:`CHUNK`-coordinate pieces (float64 accumulators that stay in
cache) and the pieces are shared among up to :data:`THREADS` threads (numpy releases the GIL in
its loops). Every coordinate still sees the same float64 operations in the same client order, so
the result is bit-identical to the plain form (:func:`reference_average`) whatever the chunk size
or thread count (tests/algorithms/test_aggregation.py compares them on random masks and weights).

Under ``privacy.mode=central`` the round engine holds a private release open and every call is that release's
noisy sum instead (:mod:`fedsap_ray.algorithms.dpnoise`).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fedsap_ray.algorithms import dpnoise

CHUNK = 1 << 16  # coordinates per piece: two float64 accumulators of 512 KiB, in a core's L2
THREADS = max(1, min(8, os.cpu_count() or 1))  # pieces aggregated at once (more cores gain little: memory-bound)

Contribution = dpnoise.Contribution  # (mask or None = full, values, weight)


def masked_weighted_average(
    old: np.ndarray,
    contributions: Iterable[Contribution],
    restrict: np.ndarray | None = None,
    *,
    chunk: int = CHUNK,
    threads: int | None = None,
) -> np.ndarray:
    """Return a new float32 vector; ``contributions`` are (mask or None=full, values, weight).

    ``restrict`` (bool) limits which coordinates may change (e.g. FedSAP's Global set);
    values outside it keep ``old`` bit-identically. ``chunk`` and ``threads`` change only the
    speed, never a bit of the result (module docstring).
    """
    contribs = _checked(old, contributions)
    release = dpnoise.current()
    if release is not None:  # privacy.mode=central: the round engine holds a private release open (dpnoise.py)
        return release.average(old, contribs, restrict, lambda unit: _mean(old, unit, None, chunk, threads))
    return _mean(old, contribs, restrict, chunk, threads)


def _mean(old: np.ndarray, contribs: list[Contribution], restrict: np.ndarray | None, chunk: int,
          threads: int | None) -> np.ndarray:
    """:func:`masked_weighted_average` of checked contributions (the module docstring's chunked, threaded form)."""
    out = old.copy()
    if not contribs:
        return out
    n = old.size
    bounds = list(range(0, n, chunk)) + [n]
    offsets = _offsets(contribs, bounds)
    pieces = len(bounds) - 1
    workers = max(1, min(THREADS if threads is None else threads, pieces))

    def work(first: int) -> None:
        acc = np.empty(min(chunk, n), dtype=np.float64)
        wsum, dense = np.empty_like(acc), np.empty_like(acc)
        for k in range(first, pieces, workers):  # interleaved pieces: each thread writes its own slices
            lo, hi = bounds[k], bounds[k + 1]
            a, w, d = acc[:hi - lo], wsum[:hi - lo], dense[:hi - lo]
            a.fill(0.0)
            w.fill(0.0)
            for (mask, values, weight), off in zip(contribs, offsets):
                if mask is None:
                    a += weight * values[lo:hi].astype(np.float64)
                    w += weight
                else:
                    assert off is not None  # a masked contribution has its offsets (_offsets)
                    v = values[off[k]:off[k + 1]]
                    if v.size:
                        # the packed values spread over the piece, +0.0 elsewhere: adding weight * +0.0 leaves
                        # an accumulator bit-identical (it starts at +0.0 and so is never -0.0), and one
                        # boolean assignment is a third of the cost of acc[m] += ... (read, add, write back)
                        m = mask[lo:hi]
                        d.fill(0.0)
                        d[m] = v
                        d *= weight
                        a += d
                        np.add(w, weight, out=w, where=m)
            covered = w > 0
            if restrict is not None:
                covered &= restrict[lo:hi]
            out[lo:hi][covered] = (a[covered] / w[covered]).astype(np.float32)

    if workers == 1:
        work(0)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="fedsap-aggregate") as pool:
            list(pool.map(work, range(workers)))
    return out


def reference_average(old: np.ndarray, contributions: Iterable[Contribution],
                      restrict: np.ndarray | None = None) -> np.ndarray:
    """The plain form of :func:`masked_weighted_average` (one pass over the whole vector per client):
    the definition the fast form is tested against."""
    acc = np.zeros(old.shape, dtype=np.float64)
    wsum = np.zeros(old.shape, dtype=np.float64)
    for mask, values, weight in _checked(old, contributions):
        if mask is None:
            acc += weight * values.astype(np.float64)
            wsum += weight
        else:
            acc[mask] += weight * values.astype(np.float64)
            wsum[mask] += weight
    covered = wsum > 0
    if restrict is not None:
        covered &= restrict
    out = old.copy()
    out[covered] = (acc[covered] / wsum[covered]).astype(np.float32)
    return out


def _checked(old: np.ndarray, contributions: Iterable[Contribution]) -> list[Contribution]:
    """The contributions as a list, each checked: weight >= 0, values matching the model or the mask (each
    distinct mask object counted once: the clients of one width share theirs)."""
    out = []
    counts: dict[int, int] = {}
    for mask, values, weight in contributions:
        if weight < 0:
            raise ValueError(f"aggregation weight must be >= 0, got {weight}")
        if mask is None:
            if values.size != old.size:
                raise ValueError(f"full update has {values.size} values, model has {old.size}")
        else:
            if id(mask) not in counts:
                counts[id(mask)] = int(np.count_nonzero(mask))
            if counts[id(mask)] != values.size:
                raise ValueError(f"mask covers {counts[id(mask)]} coordinates but {values.size} values were sent")
        out.append((mask, values, weight))
    return out


def _offsets(contribs: list[Contribution], bounds: list[int]) -> list[np.ndarray | None]:
    """Per contribution, where each piece's values start in its packed ``values`` (None for a full
    update): the mask's running count at the piece bounds, computed once per distinct mask object."""
    starts = np.asarray(bounds[:-1], dtype=np.intp)
    seen: dict[int, np.ndarray] = {}
    out: list[np.ndarray | None] = []
    for mask, _, _ in contribs:
        if mask is None:
            out.append(None)
            continue
        if id(mask) not in seen:
            counts = np.add.reduceat(mask.view(np.uint8), starts, dtype=np.int64)
            seen[id(mask)] = np.concatenate(([0], np.cumsum(counts)))
        out.append(seen[id(mask)])
    return out


def scatter(values: np.ndarray, mask: np.ndarray | None, size: int, fill: np.ndarray | None = None) -> np.ndarray:
    """Place the covered ``values`` into a full-size float32 vector (``fill`` or zeros elsewhere)."""
    out = np.zeros(size, dtype=np.float32) if fill is None else fill.astype(np.float32, copy=True)
    if mask is None:
        out[:] = values
    else:
        out[mask] = values
    return out
