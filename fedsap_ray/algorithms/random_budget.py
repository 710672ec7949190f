"""Random-budget control (papers/003 section 4.4): random widths at HAS-FL's budget
(docs/readings.md#random-budget-control).

It runs HAS-FL's estimator on its own updates (Eqs. 4-5, normalisation) only to know
what budget HAS-FL's rule would spend: at every adaptation step it computes HAS-FL's
allocation (Eq. 6 + coverage guarantee) and discards it except for its mean. Then each
client draws p uniformly in [0.25, p_max] (p_max if that is below 0.25), the coverage
guarantee pins the widest clients at p_max (when ``coverage`` is on, as for HAS-FL),
and the other draws are scaled by one common factor, capped at p_max
(:func:`match_budget`), so the mean allocation over all N clients equals HAS-FL's
exactly and no client exceeds its p_max. Allocations stay fixed between adaptation
steps, like HAS-FL's. ``target`` replaces the shadow rule by a fixed mean budget (e.g.
a measured HAS-FL run's average p).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsap_ray.algorithms.hasfl import HasFL
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_number
from fedsap_ray.common.seeding import rng_for


def match_budget(draws: np.ndarray, p_max: np.ndarray, fixed: np.ndarray, total: float) -> np.ndarray:
    """Scale the non-``fixed`` draws by one factor s so sum(min(p_max, s * draw)) + sum(p_max[fixed]) = total.

    Exact water-filling: clients whose cap binds are set to p_max and s is solved for the
    rest. If even p_max for everyone cannot reach ``total``, everyone gets p_max.
    """
    p = draws.astype(np.float64).copy()
    p[fixed] = p_max[fixed]
    free = np.flatnonzero(~fixed)
    rem = total - float(p_max[fixed].sum())
    if free.size == 0:
        return p
    u, cap = draws[free].astype(np.float64), p_max[free].astype(np.float64)
    if rem >= cap.sum():
        p[free] = cap
        return p
    order = np.argsort(cap / u, kind="stable")
    capped_sum, u_left = 0.0, float(u.sum())
    for k, idx in enumerate(order):
        s = (rem - capped_sum) / u_left
        if s * u[idx] <= cap[idx]:  # the k smallest-ratio clients are capped, the rest scale by s
            p[free[order[k:]]] = s * u[order[k:]]
            p[free[order[:k]]] = cap[order[:k]]
            return p
        capped_sum += cap[idx]
        u_left -= u[idx]
    p[free] = cap  # unreachable when rem < cap.sum(), kept for floating-point safety
    return p


@register("random_budget")
class RandomBudget(HasFL):
    summary = "matched-budget control: random widths scaled to HAS-FL's mean allocation"
    confound_variants = {"random_budget": ()}  # papers/003: the matched-budget control
    @dataclass(frozen=True)
    class Options(HasFL.Options):
        # lower end of the uniform draw (the smallest tier). Above p_min is legal: p_min only sets the shadow
        # HAS-FL rule's budget, and the draws are rescaled to that budget anyway (a client may end below p_low)
        p_low: float = 0.25
        target: float | None = None  # fixed mean budget instead of HAS-FL's rule

        def __post_init__(self) -> None:
            super().__post_init__()
            check_number("algorithm.p_low", self.p_low, 0, 1, low_open=True)
            check_number("algorithm.target", self.target, 0, 1, low_open=True, nullable=True)

    def budget(self, h_tilde: np.ndarray, t: int) -> float:
        """The mean allocation to match: HAS-FL's rule on this run's estimates, or ``target``."""
        if self.opts.target is not None:
            return float(self.opts.target)
        return float(super().allocate(h_tilde, t).mean())

    def allocate(self, h_tilde: np.ndarray, t: int) -> np.ndarray:
        p_max = self.capacities()
        rng = rng_for(self.cfg.seed, t, -1, "random_budget")
        draws = rng.uniform(np.minimum(self.opts.p_low, p_max), p_max)
        fixed = p_max == p_max.max() if self.opts.coverage else np.zeros(len(p_max), dtype=bool)
        return match_budget(draws, p_max, fixed, self.budget(h_tilde, t) * len(p_max))
