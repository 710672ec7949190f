"""The server's noisy sum (central DP, ``privacy.mode=central``): what :func:`masked_weighted_average` computes
while the round engine holds a :class:`NoisySum` open (:func:`noisy_sums`).

Every strategy that supports privacy merges its clients' values with
:func:`~fedsap_ray.algorithms.aggregation.masked_weighted_average`, so the mechanism lives there, not in each
strategy: the engine clips each client's update first (:mod:`fedsap_ray.engine.privacy`), so that a client's values
are what it downloaded plus its clipped delta, and opens a ``NoisySum`` around the strategy's ``aggregate`` (or
``merge``); each merge then releases, per coordinate j it may change (DP-FedAvg, McMahan et al. 2018, Algorithm 1,
with sub-models: docs/readings.md#privacy),

    w_j <- w_j + (sum_i [m_i]_j Delta_ij + z_j) / D_j,     z_j ~ N(0, (sigma C s)^2) iid,

where Delta_ij = v_ij - w_j is client i's clipped delta (the values minus the vector merged into: what the client
downloaded, in a synchronous round and in the asynchronous engine's recovered values alike), every client weighs 1
(a sample count is the client's data and unbounded: it would break the sensitivity), s is ``noise_scale`` and D_j
is the denominator: ``cohort``, the expected clients per release for every coordinate (the noise is added to every
coordinate, covered or not: whether a client covered it is not released), or ``coverage``, c_j = the number of
this release's clients whose mask holds j, only where c_j > 0 (the counts are public when masks depend on no data:
the configs that may use it are checked). With sigma = 0 and ``coverage``, w_j is the non-private merge's
unweighted mean itself (:meth:`NoisySum.average` computes the release from it), so a zero-noise run equals the
non-private run with weighting=count bit for bit.

A coordinate's signal and noise are accumulated per group for ``rounds.dp_snr_*``: ``shared`` coordinates every
client of the release trained, ``partial`` ones only some of them (the outer channels of wider sub-models).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

Contribution = tuple[np.ndarray | None, np.ndarray, float]  # (mask or None = full, values, weight): aggregation.py's
GROUPS = ("shared", "partial")  # rounds.dp_snr_shared, dp_snr_partial

_OPEN: contextvars.ContextVar[NoisySum | None] = contextvars.ContextVar("fedsap_noisy_sum", default=None)


@dataclass
class NoisySum:
    """One release's mechanism: noise std on the sum, denominator rule and its cohort, the round's noise generator
    (seeded per run, round and purpose by the engine, so a resumed round draws the same noise) and what the
    release's merges measured."""

    std: float  # sigma x C x noise_scale: the std of z_j
    denominator: str  # cohort | coverage
    cohort: float  # D under ``cohort``
    rng: np.random.Generator
    signal_sq: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0.0))
    noise_sq: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0.0))

    def snr(self, group: str) -> float | None:
        """||signal|| / ||noise|| over the group's coordinates of this release (None: no such coordinate or no
        noise); the signal is the mean clipped delta the merge applied, the noise what it added, both divided by D_j."""
        n = self.noise_sq[group]
        return math.sqrt(self.signal_sq[group] / n) if n > 0 else None

    def average(self, old: np.ndarray, contribs: list[Contribution], restrict: np.ndarray | None,
                unit_mean: Callable[[list[Contribution]], np.ndarray]) -> np.ndarray:
        """The module docstring's release over ``contribs`` (their weights are ignored: every client weighs 1).

        ``unit_mean`` is the ordinary merge (aggregation.py's chunked, threaded one) of contributions of weight 1:
        each covered coordinate's unweighted mean of the clients' values, ``old`` elsewhere. The sum of clipped
        deltas is c_j (mean_j - w_j), so the release costs that merge plus a few passes over the vector, and with
        sigma = 0 under ``coverage`` it is that merge's result itself, bit for bit."""
        n = old.size
        mean = unit_mean([(m, v, 1.0) for m, v, _ in contribs])
        count = np.zeros(n, dtype=np.float32)  # exact: a client count
        for m, _, _ in contribs:
            count += 1.0 if m is None else m  # a bool mask adds 1 where the client trained
        delta_sum = mean.astype(np.float64)
        delta_sum -= old
        delta_sum *= count  # the sum of clipped deltas, c_j (mean_j - w_j): 0 where nobody trained
        z = self.rng.standard_normal(n) if self.std > 0 else np.zeros(n)
        z *= self.std
        covered = count > 0
        denom: np.ndarray | float
        if self.denominator == "coverage":
            where = covered if restrict is None else covered & restrict
            denom = np.maximum(count, 1.0)
            released = z / denom
            released += mean  # the mean itself where z is 0
        else:
            where = None if restrict is None else restrict  # every coordinate, covered or not
            denom = float(self.cohort)
            released = delta_sum + z
            released /= denom
            released += old
        if contribs:  # each group's signal and noise: 0 shared, 1 partial, 2 neither (or outside ``where``)
            group = np.where(count == len(contribs), 0, np.where(covered, 1, 2)).astype(np.int8)
            if where is not None:
                group[~where] = 2
            for name, part in (("signal", delta_sum), ("noise", z)):
                buf = part / denom
                np.square(buf, out=buf)
                sums = np.bincount(group, weights=buf, minlength=3)
                acc = self.signal_sq if name == "signal" else self.noise_sq
                for g, key in enumerate(GROUPS):
                    acc[key] += float(sums[g])
        out = released.astype(np.float32)
        if where is not None:
            out[~where] = old[~where]  # bit for bit: nothing released there
        return out


def current() -> NoisySum | None:
    """The release the round engine holds open in this thread (None: an ordinary merge)."""
    return _OPEN.get()


@contextlib.contextmanager
def noisy_sums(release: NoisySum) -> Iterator[NoisySum]:
    """Every merge inside is a private release of ``release`` (module docstring)."""
    token = _OPEN.set(release)
    try:
        yield release
    finally:
        _OPEN.reset(token)
