"""Client device capacities: FedSAP's cyclic pruning ratios and HAS-FL's p_max tiers.

Returns, per client, ``pruning_ratio`` (FedSAP rho_i) and ``capacity`` (what the device can train:
kappa_i = 1 - rho_i for FedSAP-style methods, or p_max for HAS-FL-style methods).
"""
from __future__ import annotations

import numpy as np

from fedsap_ray.config.schema import CapacityConfig

_PURPOSE_TIERS = 201


def tier_counts(shares: np.ndarray | tuple[float, ...], num_clients: int) -> np.ndarray:
    """Clients per tier, proportional to ``shares``, by largest-remainder (Hamilton) rounding.

    quota_t = N * s_t / sum(s); each tier gets floor(quota_t), and the clients left over go
    one each to the tiers with the largest fractional parts (ties: lower tier index first).
    For shares 7/7/3/3 and N = 20 this is exactly 7/7/3/3, our reading of papers/003 section 4.1
    (the paper gives the tiers and their mean 0.525 only; docs/readings.md).
    """
    s = np.asarray(shares, dtype=np.float64)
    if s.ndim != 1 or len(s) == 0 or (s < 0).any() or s.sum() <= 0:
        raise ValueError(f"capacity.tier_shares={s.tolist()} must be non-negative with a positive sum")
    quota = num_clients * s / s.sum()
    counts = np.floor(quota + 1e-9).astype(np.int64)  # tolerance: 20*7/20 must not floor to 6
    left = num_clients - int(counts.sum())
    frac = quota - counts
    order = sorted(range(len(s)), key=lambda t: (-frac[t], t))
    for t in order[:left]:
        counts[t] += 1
    return counts


def assign_capacities(cfg: CapacityConfig, num_clients: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(pruning_ratio, capacity) float64 arrays of length ``num_clients`` under ``cfg.scheme``.

    - ``cyclic`` (papers/000 Appendix C): rho_i = pruning_ratios[i % len], capacity = 1 - rho_i.
    - ``tiers`` (papers/003 section 4.1; docs/readings.md#capacity-tiers): p_max tiers in counts from
      :func:`tier_counts`, shuffled by ``SeedSequence((seed, 201))``; pruning_ratio 0, capacity p_max.
    - ``full``: every client keeps the whole model (pruning_ratio 0, capacity 1).
    - ``explicit``: capacity = keep_ratios (one per client), pruning_ratio = 1 - capacity.
    """
    if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    n = int(num_clients)
    if cfg.scheme == "cyclic":
        rho = np.array([cfg.pruning_ratios[i % len(cfg.pruning_ratios)] for i in range(n)], dtype=np.float64)
        return rho, 1.0 - rho
    if cfg.scheme == "tiers":
        counts = tier_counts(cfg.tier_shares, n)
        pmax = np.repeat(np.asarray(cfg.tiers, dtype=np.float64), counts)
        rng = np.random.default_rng(np.random.SeedSequence((int(seed), _PURPOSE_TIERS)))
        return np.zeros(n), rng.permutation(pmax)
    if cfg.scheme == "full":
        return np.zeros(n), np.ones(n)
    if cfg.scheme == "explicit":
        if cfg.keep_ratios is None or len(cfg.keep_ratios) != n:
            got = None if cfg.keep_ratios is None else len(cfg.keep_ratios)
            raise ValueError(f"capacity.keep_ratios needs exactly {n} entries (one per client), got {got}")
        keep = np.asarray(cfg.keep_ratios, dtype=np.float64)
        return 1.0 - keep, keep
    raise ValueError(f"unknown capacity.scheme={cfg.scheme!r}; allowed: cyclic, tiers, full, explicit")
