"""Adaptive layer budgets (papers/000 Eq. 2, section "Adaptive Layer Budget", Appendix C).

A client's capacity kappa_i is spread over layers by global layer utility: a softmax
with temperature T over the layer utilities U_l gives the shape, each layer's keep
ratio is clipped to [max(0.05, 0.15 kappa), min(1, kappa + 0.5)], and the ratios are
rescaled (water-filling: one scale factor found by bisection, re-clipped) until the
channel-weighted budget of Eq. 2,

    sum_l C_l kappa_{i,l} / sum_l C_l = kappa_i,

holds. Channels are integers, so the ratios become channel counts n_l by largest
remainder under the same bounds, with total round(kappa_i * sum_l C_l): Eq. 2 then
holds to within one channel, every n_l / C_l stays inside its clip bounds, and
ceil(kappa_{i,l} C_l) = n_l is exactly the number of channels Algorithm 1 line 14
keeps. ``adaptive=False`` (``adaptive_layer_budget = 0``) gives kappa_{i,l} = kappa_i
for every layer (uniform budgets, still rounded to keep Eq. 2 within one channel).
Where the bounds make Eq. 2 infeasible (a tiny kappa on layers so narrow that one
channel already exceeds it), the nearest feasible total is taken.
"""
from __future__ import annotations

import numpy as np

_EPS = 1e-9


def clip_bounds(kappa: float) -> tuple[float, float]:
    """[max(0.05, 0.15 kappa), min(1, kappa + 0.5)] (papers/000 Appendix C)."""
    return max(0.05, 0.15 * kappa), min(1.0, kappa + 0.5)


def softmax_shape(layer_utility: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(U / T) over layers, scaled to mean 1 (so kappa * shape has mean kappa)."""
    z = np.asarray(layer_utility, dtype=np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.mean()


def _fill(shape: np.ndarray, channels: np.ndarray, kappa: float, lo: float, hi: float) -> np.ndarray:
    """Water-filling: the scale s with sum_l C_l clip(s * shape_l, lo, hi) = kappa * sum_l C_l."""
    target = kappa * channels.sum()

    def total(s: float) -> float:
        return float((channels * np.clip(s * shape, lo, hi)).sum())

    a, b = 0.0, 1.0
    while total(b) < target and b < 1e9:
        b *= 2.0
    for _ in range(100):
        mid = 0.5 * (a + b)
        if total(mid) < target:
            a = mid
        else:
            b = mid
    return np.clip(b * shape, lo, hi)


def layer_channel_counts(kappa: float, channels: np.ndarray, layer_utility: np.ndarray | None = None, *,
                         temperature: float = 1.0, adaptive: bool = True) -> np.ndarray:
    """Active channels per layer for a client with capacity ``kappa`` (Eq. 2 within one channel)."""
    channels = np.asarray(channels, dtype=np.int64)
    if not 0 < kappa <= 1:
        raise ValueError(f"capacity must be in (0, 1], got {kappa}")
    if kappa >= 1.0 - _EPS:
        return channels.copy()
    lo, hi = clip_bounds(kappa)
    if adaptive and layer_utility is not None:
        ratios = _fill(softmax_shape(layer_utility, temperature), channels, kappa, lo, hi)
    else:
        ratios = np.full(len(channels), kappa, dtype=np.float64)
    n_lo = np.maximum(1, np.ceil(lo * channels - _EPS)).astype(np.int64)
    n_hi = np.maximum(n_lo, np.floor(hi * channels + _EPS).astype(np.int64))
    want = ratios * channels
    counts = np.clip(np.floor(want + _EPS).astype(np.int64), n_lo, n_hi)
    total = int(round(kappa * channels.sum()))
    total = min(max(total, int(n_lo.sum())), int(n_hi.sum()))
    # largest remainder first when adding, smallest when removing; ties by layer index
    frac = want - counts
    while counts.sum() < total:
        room = counts < n_hi
        i = int(np.flatnonzero(room)[np.argmax(frac[room])])
        counts[i] += 1
        frac[i] -= 1.0
    while counts.sum() > total:
        room = counts > n_lo
        i = int(np.flatnonzero(room)[np.argmin(frac[room])])
        counts[i] -= 1
        frac[i] += 1.0
    return counts


def keep_ratios(counts: np.ndarray, channels: np.ndarray) -> np.ndarray:
    return np.asarray(counts, dtype=np.float64) / np.asarray(channels, dtype=np.float64)


def budget_error_channels(counts: np.ndarray, channels: np.ndarray, kappa: float) -> float:
    """|sum_l n_l - kappa sum_l C_l| in channels: Eq. 2's residual (at most 1 by construction)."""
    return abs(float(np.sum(counts)) - kappa * float(np.sum(channels)))


__all__ = ["clip_bounds", "softmax_shape", "layer_channel_counts", "keep_ratios", "budget_error_channels"]
