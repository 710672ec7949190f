"""What a private run spends: its (epsilon, delta) after t releases, and the noise a budget needs, from dp-accounting.

No privacy mathematics is written here: every epsilon comes from dp-accounting (Google's library: the RDP
accountant of Mironov 2017 / Mironov, Talwar, Zhang 2019, with Wang, Balle, Kasiviswanathan 2019 Theorem 27 for
sampling without replacement; the PLD accountant of Meiser and Mohammadi 2018 / Doroshenko et al. 2022), and the
noise for a target epsilon from its ``calibrate_dp_mechanism`` (Brent's method on the same accountant). What this
module decides is which event a run's releases are, written down here and in docs/readings.md#privacy:

- The unit is the client (user-level DP, McMahan et al. 2018): neighbouring federations differ in one client's
  data. Every release is a Gaussian mechanism on the clients' clipped updates (norm <= C), so its L2 sensitivity is
  C when a client is added or removed and 2C when one client's data is replaced by another's (the two clipped
  updates can point in opposite directions).
- ``sampling=fixed`` (what our sampler does: k clients uniformly without replacement): n = the federation is
  public, a neighbour replaces one client, the event is ``SampledWithoutReplacementDpEvent(N, k, Gaussian)`` under
  REPLACE_ONE (only the RDP accountant has this analysis; PLD is refused by name in the config).
  ``sampling=poisson``: each client joins with probability q independently, add/remove neighbours,
  ``PoissonSampledDpEvent(q, Gaussian)``: the standard DP-FedAvg analysis.
- ``sampling=none``: no amplification by sampling, every release composes at full strength. Used where the
  released set of clients is not a secret uniform sample: the asynchronous engine (its buffer is whoever the
  simulated clock brings, so each step counts as a Gaussian on whoever is in it) and local DP (the server knows
  whose noised update it holds).
- Adaptive clipping (Andrew et al. 2021) releases a second Gaussian per round, the clipped-count; two Gaussian
  mechanisms on the same clients are one Gaussian with 1/sigma_eff^2 = sum of (sensitivity/std)^2 (Andrew et al.
  2021, section 3.1: sigma_eff = (sigma^-2 + (2 sigma_b)^-2)^-1/2 for add/remove), :func:`effective_multiplier`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("fixed", "poisson", "none")
# The PLD accountant's discretisation of the privacy loss (dp-accounting's default)
PLD_INTERVAL = 1e-4
# The noise multipliers a budget is searched in: below 0.3 the PLD's discretised loss needs gigabytes (and no useful
# private federation runs there), above 1000 the noise is all there is
SIGMA_LOW, SIGMA_HIGH = 0.3, 1000.0


@dataclass(frozen=True)
class Releases:
    """How one run's releases are analysed: the accountant, the sampling of each release (``fixed``: ``cohort`` of
    ``population`` without replacement; ``poisson``: probability cohort/population; ``none``: unsampled) and the
    delta epsilon is reported at."""

    accountant: str
    sampling: str
    population: int
    cohort: int
    delta: float

    @property
    def replace_one(self) -> bool:
        """Whether neighbours replace a client (sampling without replacement) rather than add or remove one."""
        return self.sampling == "fixed"

    @property
    def sensitivity_factor(self) -> float:
        """A release's L2 sensitivity in units of C (the clip norm): 2 under replace-one, 1 under add/remove."""
        return 2.0 if self.replace_one else 1.0


def effective_multiplier(sigma: float, count_sigma: float | None, replace_one: bool) -> float:
    """The one Gaussian's noise multiplier (std / sensitivity) equivalent to a round's releases: the update sum with
    noise std sigma*C (sensitivity C, or 2C under replace-one) and, under adaptive clipping, the clipped-count with
    noise std ``count_sigma`` (each client adds b - 1/2, b in {0, 1}: sensitivity 1/2, or 1 under replace-one).
    Andrew et al. 2021 section 3.1; 0 when ``sigma`` is 0 (no noise: no privacy)."""
    if sigma <= 0 or (count_sigma is not None and count_sigma <= 0):
        return 0.0
    s = 2.0 if replace_one else 1.0
    inv = (s / sigma) ** 2 + (0.0 if count_sigma is None else (s / (2.0 * count_sigma)) ** 2)
    return 1.0 / math.sqrt(inv)


def update_multiplier(sigma_eff: float, count_sigma: float | None, replace_one: bool) -> float | None:
    """The inverse of :func:`effective_multiplier` for the update's sigma given sigma_eff and the count's noise;
    None when the count's noise alone already spends more than sigma_eff allows."""
    s = 2.0 if replace_one else 1.0
    rest = sigma_eff ** -2 - (0.0 if count_sigma is None else (s / (2.0 * count_sigma)) ** 2)
    return None if rest <= 0 else s / math.sqrt(rest)


def event(r: Releases, sigma_eff: float, steps: int) -> Any:
    """The dp-accounting event of ``steps`` releases, each a Gaussian of multiplier ``sigma_eff`` under ``r``'s
    sampling (module docstring)."""
    import dp_accounting as dpa  # 1.2 s to import: only private runs pay it

    base = dpa.GaussianDpEvent(sigma_eff)
    if r.sampling == "fixed" and r.cohort < r.population:
        one = dpa.SampledWithoutReplacementDpEvent(r.population, r.cohort, base)
    elif r.sampling == "poisson" and r.cohort < r.population:
        one = dpa.PoissonSampledDpEvent(r.cohort / r.population, base)
    else:  # none, or every client in every release: no amplification
        one = base
    return dpa.SelfComposedDpEvent(one, steps)


def _fresh(r: Releases) -> Any:
    """A fresh accountant of ``r``'s kind and neighbouring relation."""
    import dp_accounting as dpa

    rel = (dpa.NeighboringRelation.REPLACE_ONE if r.replace_one else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    if r.accountant == "rdp":
        return dpa.rdp.RdpAccountant(neighboring_relation=rel)
    return dpa.pld.PLDAccountant(neighboring_relation=rel, value_discretization_interval=PLD_INTERVAL)


@functools.lru_cache(maxsize=4096)
def epsilon(r: Releases, sigma_eff: float, steps: int) -> float:
    """Epsilon at ``r.delta`` after ``steps`` releases of multiplier ``sigma_eff`` (inf without noise, 0 for no
    release). Under RDP the one release's curve is computed once and scaled by ``steps`` (RDP composes by addition:
    exactly what the accountant's own ``SelfComposedDpEvent`` does), so a run's per-round epsilons cost one
    evaluation of the sampled Gaussian's curve, not one per round."""
    if steps <= 0:
        return 0.0
    if sigma_eff <= 0:
        return math.inf
    with _quiet():
        if r.accountant == "rdp":
            from dp_accounting.rdp import rdp_privacy_accountant as rdp

            orders, one = _rdp_curve(dataclasses.replace(r, delta=0.5), sigma_eff)  # the curve has no delta
            return float(rdp.compute_epsilon(orders, one * steps, r.delta)[0])
        acc = _fresh(r)
        acc.compose(event(r, sigma_eff, steps))
        return float(acc.get_epsilon(r.delta))


@functools.lru_cache(maxsize=256)
def _rdp_curve(r: Releases, sigma_eff: float) -> tuple[Any, Any]:
    """(orders, RDP of one release at each order) from a fresh accountant that composed one release."""
    acc = _fresh(r)
    acc.compose(event(r, sigma_eff, 1))
    return acc._orders, acc._rdp  # the accountant's own curve: dp-accounting has no public getter for it


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """dp-accounting logs (absl) each RDP order its series leaves out as not converged, dozens of lines per call;
    the orders left out only make the bound less tight, never wrong, so the lines are kept from the run's output."""
    import logging

    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@functools.lru_cache(maxsize=256)
def calibrate(r: Releases, target_epsilon: float, steps: int) -> float:
    """The smallest multiplier sigma_eff whose ``steps`` releases spend at most ``target_epsilon`` at ``r.delta``
    (dp-accounting's ``calibrate_dp_mechanism``; the result is checked against the target by :func:`epsilon`)."""
    from scipy.optimize import brentq

    # the same search as dp-accounting's calibrate_dp_mechanism (Brent's method on epsilon(sigma) - target), run on
    # :func:`epsilon` so each probe costs one curve; bracketed in [SIGMA_LOW, SIGMA_HIGH] (a target outside is refused
    # by the config with both ends' epsilons)
    # in log(sigma), to a relative 1e-4 of sigma: epsilon is smooth and monotone in it, so Brent's method needs ~10
    # probes (each a 0.2 s curve for sampling without replacement) where a linear search over [0.3, 1000] needed 30
    def gap(log_s: float) -> float:
        return epsilon(r, math.exp(log_s), steps) - target_epsilon

    sigma = math.exp(float(brentq(gap, math.log(SIGMA_LOW), math.log(SIGMA_HIGH), xtol=1e-4)))
    # Brent's tolerance can leave sigma a hair below the budget's edge: step up until the spend is within it
    while epsilon(r, sigma, steps) > target_epsilon:
        sigma *= 1 + 1e-4
    return sigma


class Ledger:
    """A run's releases so far, composed one at a time: its epsilon after each round at the cost of one more
    composition (the PLD accountant's self-composition of t releases costs as much as t compositions, so a fresh
    accountant per round would grow quadratically). Rebuilt from the count alone on resume: the releases of a run
    are identical (same multiplier, same sampling), so ``Ledger(r, sigma_eff, steps)`` is the ledger after them,
    composed one release at a time as the run composed them (the PLD of ``steps`` releases self-composed at once
    differs in the 12th digit, and a resumed run's epsilons must equal the uninterrupted run's exactly)."""

    def __init__(self, r: Releases, sigma_eff: float, steps: int = 0) -> None:
        self.r, self.sigma_eff, self.steps = r, sigma_eff, 0
        self._acc: Any = None
        if sigma_eff > 0 and r.accountant == "pld":
            self._acc = _fresh(r)
        for _ in range(steps):
            self.advance(1)

    def advance(self, releases: int = 1) -> None:
        """Compose ``releases`` more releases."""
        if releases <= 0:
            return
        self.steps += releases
        if self._acc is not None:
            with _quiet():
                self._acc.compose(event(self.r, self.sigma_eff, releases))

    def epsilon(self) -> float:
        """Epsilon at the run's delta after the releases so far."""
        if self._acc is None or self.steps == 0:
            return epsilon(self.r, self.sigma_eff, self.steps)
        with _quiet():
            return float(self._acc.get_epsilon(self.r.delta))
