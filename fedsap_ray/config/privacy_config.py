"""The ``privacy`` config section: client-level differential privacy of the updates (docs/guides/privacy.md), and
the checks across sections it needs (:func:`check_privacy`), which resolve the run's noise and refuse a budget it
would exceed before any work.

Off by default; its defaults leave a run's hash as it was before the section existed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from fedsap_ray.config.accountant import (ACCOUNTANTS, SIGMA_HIGH, SIGMA_LOW, Releases, calibrate, effective_multiplier,
                                          epsilon, update_multiplier)
from fedsap_ray.config.checks import check_choice, check_number, check_positive, check_ratio, check_supported, fail, is_number

# ``cfg`` below is the whole ExperimentConfig, typed Any: schema.py imports this module (the section), so this one
# cannot import it back (the architecture test counts TYPE_CHECKING imports in the graph too)
ExperimentConfig = Any

PRIVACY_MODES = ("off", "central", "local")
CLIPPINGS = ("fixed", "adaptive")
DENOMINATORS = ("cohort", "coverage")
PRIVACY_SAMPLINGS = ("fixed", "poisson")


@dataclass(frozen=True)
class PrivacyConfig:
    """Client-level DP of the clients' updates (docs/guides/privacy.md). ``central``: each update (what the client
    trained minus what it downloaded, over the coordinates it trained) is clipped to L2 norm ``clip_norm`` and the
    server adds Gaussian noise of std ``noise_multiplier`` x C to their sum (DP-FedAvg, McMahan et al. 2018);
    ``local``: each client clips and noises its own update. Give ``noise_multiplier``, ``target_epsilon`` (the
    noise is calibrated to spend it over ``training.rounds``) or both (the run is refused if the noise would spend
    more). Only read with mode central or local (a field set with mode off is refused)."""

    mode: str = "off"  # off | central (the server noises the sum) | local (each client noises its own update)
    noise_multiplier: float | None = None  # sigma: the noise std on the update sum is sigma x clip_norm; 0: no noise
    target_epsilon: float | None = None  # the budget over training.rounds; calibrates sigma when noise_multiplier is null
    delta: float | None = None  # null: 1 / population (1/N, N the federation)
    clip_norm: float = 1.0  # C: every update's L2 norm is clipped to it (the initial C under clipping=adaptive)
    # fixed: C throughout; adaptive: C follows the target_quantile of the update norms (Andrew et al. 2021, Alg. 1)
    clipping: str = "fixed"
    target_quantile: float = 0.5  # gamma: the fraction of updates adaptive clipping aims to leave unclipped
    clip_lr: float = 0.2  # eta_C: C <- C exp(-eta_C (b_noised - gamma)) (Andrew et al. 2021's geometric update)
    count_noise: float | None = None  # sigma_b: std of the noise on the unclipped count; null: expected cohort / 20
    # the noisy sum is divided by: cohort (the expected clients per release, fixed: the sensitivity stays C / cohort)
    # or coverage (each coordinate's count of clients that trained it: public only when masks depend on no data)
    denominator: str = "cohort"
    # noise as for a cohort this large (pfl-research): the sum's noise is scaled by cohort / noise_cohort_size and
    # epsilon is that of noise_cohort_size clients of privacy.population; null: the run's own cohort
    noise_cohort_size: int | None = None
    population: int | None = None  # the population epsilon is computed for; null: data.num_clients
    sampling: str = "fixed"  # fixed: k clients without replacement (our sampler); poisson: each with probability q
    accountant: str = "rdp"  # rdp (fast; both samplings) | pld (tighter; poisson only: no analysis without replacement)

    def __post_init__(self) -> None:
        check_choice("privacy.mode", self.mode, PRIVACY_MODES)
        if self.noise_multiplier is not None:
            check_number("privacy.noise_multiplier", self.noise_multiplier, 0.0, SIGMA_HIGH)
        if self.target_epsilon is not None:
            check_positive("privacy.target_epsilon", self.target_epsilon)
            if not math.isfinite(self.target_epsilon):
                fail("privacy.target_epsilon", self.target_epsilon, "must be a finite number > 0 (null: no budget)")
        if self.delta is not None:
            check_number("privacy.delta", self.delta, 0.0, 1.0, low_open=True, high_open=True)
        if not (is_number(self.clip_norm) and math.isfinite(self.clip_norm) and self.clip_norm > 0):
            fail("privacy.clip_norm", self.clip_norm, "must be a finite number > 0")
        check_choice("privacy.clipping", self.clipping, CLIPPINGS)
        check_ratio("privacy.target_quantile", self.target_quantile)
        check_positive("privacy.clip_lr", self.clip_lr, allow_zero=True)
        if self.count_noise is not None:
            check_positive("privacy.count_noise", self.count_noise)
        check_choice("privacy.denominator", self.denominator, DENOMINATORS)
        for f in ("noise_cohort_size", "population"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                fail(f"privacy.{f}", v, "must be null or an integer >= 1")
        check_choice("privacy.sampling", self.sampling, PRIVACY_SAMPLINGS)
        check_choice("privacy.accountant", self.accountant, ACCOUNTANTS)


@dataclass(frozen=True)
class Noise:
    """A private run's resolved mechanism (:func:`resolve`): the update's noise multiplier ``sigma`` (std sigma x C on
    the sum of ``cohort`` clipped updates, before ``noise_scale``), the count's ``count_sigma`` (adaptive clipping),
    the one-Gaussian multiplier the accountant composes, and how its releases are analysed."""

    sigma: float
    count_sigma: float | None
    sigma_eff: float
    releases: Releases
    cohort: int  # clients per merge: a round's sample (expected, under Poisson sampling) or the asynchronous buffer
    noise_scale: float  # cohort / noise_cohort_size (1 without it): the sum's noise std is sigma x C x noise_scale
    planned_epsilon: float  # epsilon after training.rounds releases (inf without noise)


def resolve(cfg: ExperimentConfig) -> Noise | None:
    """The run's :class:`Noise` (None with privacy off), calibrated and checked: a ConfigError naming the fields and
    numbers when the noise would spend more than ``target_epsilon`` or no multiplier in range reaches it."""
    p = cfg.privacy
    if p.mode == "off":
        return None
    return _resolve(p, cfg.data.num_clients, _cohort(cfg), cfg.training.rounds, cfg.devices.mode == "async")


def _cohort(cfg: ExperimentConfig) -> int:
    """Clients per release: a round's sample (round(participation x N)), or the asynchronous buffer."""
    if cfg.devices.mode == "async":
        a = cfg.asynchronous
        conc = a.concurrency if a.concurrency is not None else max(1, round(cfg.training.participation * cfg.data.num_clients))
        return a.buffer_size if a.buffer_size is not None else conc
    return max(1, int(round(cfg.training.participation * cfg.data.num_clients)))


@functools.lru_cache(maxsize=64)
def _resolve(p: PrivacyConfig, n: int, cohort: int, rounds: int, asynchronous: bool) -> Noise:
    local = p.mode == "local"
    population = p.population if p.population is not None else n
    sampled = p.noise_cohort_size if p.noise_cohort_size is not None else cohort
    sampling = "none" if (local or asynchronous) else p.sampling
    delta = p.delta if p.delta is not None else 1.0 / population
    releases = Releases(p.accountant, sampling, population, 1 if local else sampled, delta)
    count_sigma = None
    if p.clipping == "adaptive":
        count_sigma = p.count_noise if p.count_noise is not None else cohort / 20.0
    replace_one = releases.replace_one or local  # a local release: any two updates of one client, 2C apart
    if p.noise_multiplier is not None:
        sigma = float(p.noise_multiplier)
        sigma_eff = effective_multiplier(sigma, count_sigma, replace_one)
        planned = epsilon(releases, sigma_eff, rounds) if sigma_eff > 0 else math.inf
        if p.target_epsilon is not None and planned > p.target_epsilon:
            fail("privacy.noise_multiplier", sigma, f"spends epsilon {planned:.4g} at delta {delta:.3g} over "
                                                    f"training.rounds={rounds}, more than privacy.target_epsilon="
                                                    f"{p.target_epsilon:g}: raise the noise, or lower the rounds")
    else:
        lo, hi = epsilon(releases, SIGMA_HIGH, rounds), epsilon(releases, SIGMA_LOW, rounds)
        if not lo <= p.target_epsilon <= hi:  # type: ignore[operator]  # checked non-null by check_privacy
            fail("privacy.target_epsilon", p.target_epsilon,
                 f"must lie between {lo:.4g} and {hi:.4g} for training.rounds={rounds} at delta {delta:.3g} (the "
                 f"spend of noise multipliers {SIGMA_HIGH:g} and {SIGMA_LOW:g}); give privacy.noise_multiplier "
                 "instead, or change the rounds")
        sigma_eff = calibrate(releases, float(p.target_epsilon), rounds)  # type: ignore[arg-type]
        planned = epsilon(releases, sigma_eff, rounds)
        got = update_multiplier(sigma_eff, count_sigma, replace_one)
        if got is None:
            fail("privacy.count_noise", count_sigma, f"the clipped count's noise alone spends more than "
                                                     f"privacy.target_epsilon={p.target_epsilon:g} allows (it needs a "
                                                     f"one-Gaussian multiplier of {sigma_eff:.4g}): raise count_noise")
        sigma = got
    scale = cohort / p.noise_cohort_size if p.noise_cohort_size is not None else 1.0
    return Noise(sigma=sigma, count_sigma=count_sigma, sigma_eff=sigma_eff, releases=releases,
                 cohort=cohort, noise_scale=scale, planned_epsilon=planned)


def check_privacy(cfg: ExperimentConfig) -> None:
    """The checks across sections: fields read only when private, the combinations with no analysis here (each
    refused by name with the reason), the strategy's support (``Strategy.privacy_support``), then the budget
    (:func:`resolve`)."""
    p = cfg.privacy
    if p.mode == "off":
        default = PrivacyConfig()
        for f in dataclasses.fields(PrivacyConfig):
            if getattr(p, f.name) != getattr(default, f.name):
                fail(f"privacy.{f.name}", getattr(p, f.name), "read only with privacy.mode=central or local; set the "
                                                              "mode or leave it out")
        return
    if p.noise_multiplier is None and p.target_epsilon is None:
        fail("privacy.noise_multiplier", None, f"privacy.mode={p.mode} needs privacy.noise_multiplier, "
                                               "privacy.target_epsilon or both")
    asynchronous = cfg.devices.mode == "async"
    local = p.mode == "local"
    _refuse(p.accountant == "pld" and p.sampling == "fixed" and not (local or asynchronous), "privacy.accountant",
            p.accountant, "has no analysis of sampling without replacement in dp-accounting: use privacy.accountant=rdp, "
                          "or privacy.sampling=poisson")
    _refuse(p.denominator == "coverage" and p.sampling == "poisson" and not local, "privacy.denominator", p.denominator,
            "needs privacy.sampling=fixed: under Poisson sampling a coordinate's count of clients reveals whether "
            "one more client joined (docs/readings.md#privacy)")
    _refuse(local and p.clipping == "adaptive", "privacy.clipping", p.clipping,
            "is central only (the server adapts C from a noised count of the updates it sums): use fixed with "
            "privacy.mode=local")
    _refuse(local and p.noise_cohort_size is not None, "privacy.noise_cohort_size", p.noise_cohort_size,
            "scales the server's noise on the sum: central only")
    _refuse(asynchronous and p.sampling != "fixed", "privacy.sampling", p.sampling,
            "is not read with devices.mode=async (a server step's updates are whoever the clock brings: no sampling "
            "to amplify privacy, each step counts in full): leave it out")
    _refuse(asynchronous and p.noise_cohort_size is not None, "privacy.noise_cohort_size", p.noise_cohort_size,
            "is synchronous only (devices.mode=async has no sampled cohort)")
    _refuse(asynchronous and cfg.asynchronous.server_lr > 1, "asynchronous.server_lr", cfg.asynchronous.server_lr,
            "must be <= 1 with privacy (a larger server step scales a client's clipped update past C)")
    # the accountant's sampling probability is cohort / N: over-selection samples more clients than it aggregates
    # and availability (or a trace's) draws from fewer than N, both raising a client's chance of being in a release
    _refuse(cfg.devices.policy == "over_select", "devices.policy", cfg.devices.policy,
            "samples more clients than a round aggregates, which the privacy accountant (cohort / N) does not count: "
            "use wait_all or deadline with privacy")
    _refuse(cfg.devices.availability < 1 or cfg.devices.trace is not None, "devices.availability",
            cfg.devices.availability, "with privacy must be 1 and devices.trace unset (a round drawn from fewer "
                                      "clients than N raises each one's chance of a release beyond cohort / N)")
    cohort = _cohort(cfg)
    if p.noise_cohort_size is not None:
        _refuse(p.noise_cohort_size < cohort, "privacy.noise_cohort_size", p.noise_cohort_size,
                f"must be at least the run's cohort ({cohort} clients a round)")
        population = p.population if p.population is not None else cfg.data.num_clients
        _refuse(p.noise_cohort_size > population, "privacy.noise_cohort_size", p.noise_cohort_size,
                f"must be at most privacy.population={population}: set privacy.population to the population "
                "the simulated cohort is drawn from")
    check_supported(cfg.algorithm.name, cfg.algorithm.opts, "privacy_support", f"privacy.mode={p.mode}")
    resolve(cfg)


def _refuse(cond: bool, name: str, value: Any, why: str) -> None:
    if cond:
        fail(name, value, why)
