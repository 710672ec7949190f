"""The accountant (fedsap_ray/config/accountant.py) against independent numbers (issue 57, item 3): dp-accounting
composed directly from its public API, Opacus' RDP and PRV accountants (Poisson sampling), autodp's analysis of
sampling without replacement (recorded below: Wang, Balle, Kasiviswanathan 2019 Theorem 27, by an author of it), the
limits any accountant must respect, the Andrew et al. 2021 combined multiplier, calibration, the ledger, and the
privacy config's refusals.

What each comparison can promise, and so its tolerance:

- dp-accounting composed directly: the same library on the same orders, so equal to 1e-12 relative.
- Opacus' RDP (``compute_rdp`` + ``get_privacy_spent``, on dp-accounting's orders): both compute the Poisson
  subsampled Gaussian's RDP exactly at integer orders (the same binomial sum), equal to 1e-9 relative. At fractional
  orders dp-accounting 0.6 gives an upper bound (or leaves the order out when its series does not converge), Opacus
  the exact value (checked offline against quadrature of E[(mu/mu0)^alpha] with mpmath: Opacus to 1e-9, dp-accounting
  up to 17% above, at order 1.1 for sigma 5, q 0.01). So our epsilon lies between Opacus' over all the orders and
  Opacus' over the integer ones, and equals Opacus' where Opacus' best order is an integer; below both only where
  dp-accounting's KL bound (delta >= sqrt(1 - exp(-rdp)): epsilon 0) applies, which Opacus does not use.
- Opacus' PRV against our PLD: two numerical methods for the same exact epsilon; the PRV's stated guarantee is an
  upper bound within ``eps_error`` of epsilon at delta - delta_error (its docs), so ours lies in
  [upper - 2 eps_error - 1e-3, upper + 1e-3] (1e-3: the PLD's own pessimistic discretisation, interval 1e-4).
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config import build_config
from fedsap_ray.config.accountant import Ledger, Releases, _rdp_curve, calibrate, effective_multiplier, epsilon, update_multiplier

dpa = pytest.importorskip("dp_accounting")
ordp = pytest.importorskip("opacus.accountants.analysis.rdp")

SIGMAS = (0.7, 1.0, 2.0, 5.0)
RATES = (0.01, 0.1, 0.5, 1.0)
STEPS = (1, 10, 100, 1000)
DELTAS = (1e-5, 1 / 500)
POPULATION = 1000  # q x 1000 clients: every rate above is a whole cohort


def _poisson(q: float, delta: float, accountant: str = "rdp") -> Releases:
    return Releases(accountant, "poisson", POPULATION, round(q * POPULATION), delta)


def _opacus_epsilon(orders, rdp, delta: float) -> tuple[float, float]:
    """Opacus' epsilon and best order (its warning that the best order is an end of the list is not ours to heed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps, order = ordp.get_privacy_spent(orders=list(orders), rdp=list(rdp), delta=delta)
    return float(eps), float(order)


# one fresh curve each: every rate, sigma and step count at least once
DIRECT = ((0.7, 0.01, 1000), (1.0, 0.1, 10), (2.0, 0.5, 100), (5.0, 1.0, 1), (0.7, 0.5, 10), (5.0, 0.1, 1000),
          (1.0, 1.0, 100), (2.0, 0.01, 1))


@pytest.mark.parametrize("sigma, q, steps", DIRECT)
def test_poisson_rdp_equals_dp_accounting_composed_directly(sigma, q, steps) -> None:
    """Our epsilon (one curve, scaled by the steps) is dp-accounting's own accountant composing the
    ``SelfComposedDpEvent`` of ``PoissonSampledDpEvent`` itself (no amplification at q = 1: the plain Gaussian)."""
    acc = dpa.rdp.RdpAccountant()
    one = dpa.GaussianDpEvent(sigma) if q == 1 else dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
    acc.compose(dpa.SelfComposedDpEvent(one, steps))
    for delta in DELTAS:
        assert epsilon(_poisson(q, delta), sigma, steps) == pytest.approx(acc.get_epsilon(delta), rel=1e-12, abs=0)


@pytest.mark.parametrize("sigma", SIGMAS)
@pytest.mark.parametrize("q", RATES)
def test_poisson_rdp_agrees_with_opacus_on_the_same_orders(sigma, q) -> None:
    orders, ours_one = _rdp_curve(_poisson(q, DELTAS[0]), sigma)
    theirs_one = np.asarray(ordp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders)))
    integer = np.array([float(a).is_integer() for a in orders])
    np.testing.assert_allclose(ours_one[integer], theirs_one[integer], rtol=1e-9, atol=0)
    assert np.all(ours_one[~integer] >= theirs_one[~integer] * (1 - 1e-9))  # an upper bound (or inf) at fractional orders
    for steps in STEPS:
        theirs = theirs_one * steps  # what compute_rdp(steps=...) does: RDP composes by addition
        for delta in DELTAS:
            ours = epsilon(_poisson(q, delta), sigma, steps)
            best, order = _opacus_epsilon(orders, theirs, delta)
            on_integers, _ = _opacus_epsilon(orders[integer], theirs[integer], delta)
            assert ours <= on_integers * (1 + 1e-9)
            if ours == 0.0:  # dp-accounting's KL bound: (0, delta)-DP once delta >= sqrt(1 - exp(-rdp)) at some order
                assert any(delta ** 2 + math.expm1(-r) > 0 for r in theirs), (sigma, q, steps, delta)
            else:
                assert ours >= best * (1 - 1e-9)
                if float(order).is_integer():
                    assert ours == pytest.approx(best, rel=1e-9, abs=0)


@pytest.mark.integration  # each PLD epsilon takes 1 to 3 s on 2 cores
@pytest.mark.parametrize("sigma, q, steps, delta", [(1.0, 0.01, 1000, 1e-5), (2.0, 0.1, 100, 1 / 500)])
def test_poisson_pld_equals_dp_accounting_and_lies_in_opacus_prv_bracket(sigma, q, steps, delta) -> None:
    from opacus.accountants import PRVAccountant

    ours = epsilon(_poisson(q, delta, "pld"), sigma, steps)
    acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps))
    assert ours == pytest.approx(acc.get_epsilon(delta), rel=1e-12, abs=0)
    prv = PRVAccountant()
    for _ in range(steps):
        prv.step(noise_multiplier=sigma, sample_rate=q)
    eps_error = 0.01
    upper = prv.get_epsilon(delta, eps_error=eps_error)
    assert upper - 2 * eps_error - 1e-3 <= ours <= upper + 1e-3, (ours, upper)


# Sampling without replacement (k of n, replace-one): no Opacus analysis exists. autodp 0.2.3.1 (Yu-Xiang Wang's,
# pip install --no-deps --target /tmp/autodp autodp) computes Theorem 27 of Wang, Balle, Kasiviswanathan 2019 with its
# own code; it is not a test dependency (no wheel, only an sdist; it appends '..' to sys.path on import; 0.9 s a curve),
# so its numbers are recorded here: ``PYTHONPATH=/tmp/autodp python tests/config/test_accountant.py`` prints them.
# Conventions: the update's noise has std sigma x C, a replace-one neighbour moves the clipped sum by up to 2C, so the
# Gaussian autodp subsamples has multiplier (std / sensitivity) sigma x C / 2C = sigma / 2; the curve is autodp's
# ``anaRDPacct(m=256).compose_subsampled_mechanism(RDP_gaussian(sigma / 2), k / n, improved_bound_flag=True)`` at
# dp-accounting's orders, converted by Opacus' ``get_privacy_spent`` (Canonne, Kamath, Steinke 2020 Prop. 12).
# At fractional orders autodp also takes the unsampled Gaussian's RDP when smaller; dp-accounting does not, which can
# only make ours larger (safe), and does not move these epsilons.
# (sigma, n, k, steps, delta, autodp's epsilon); two deltas for n = 1000 only
AUTODP_WOR = (
    (1.0, 100, 10, 1, 1e-05, 7.7009126589079395),
    (1.0, 100, 10, 100, 1e-05, 83.93691709771713),
    (1.0, 100, 10, 1000, 1e-05, 748.2294910425184),
    (2.0, 500, 50, 1, 1e-05, 2.2750614967090397),
    (2.0, 500, 50, 100, 1e-05, 14.053750225346516),
    (2.0, 500, 50, 1000, 1e-05, 63.06592483164795),
    (5.0, 1000, 10, 1, 1e-05, 0.11801768738880336),
    (5.0, 1000, 10, 100, 1e-05, 0.3280709125260802),
    (5.0, 1000, 10, 1000, 1e-05, 1.098814150580366),
    (5.0, 1000, 10, 1, 0.001, 0.035782505496158856),
    (5.0, 1000, 10, 100, 0.001, 0.20016434041333925),
    (5.0, 1000, 10, 1000, 0.001, 0.7452892943709838),
)


def _fixed(n: int, k: int, delta: float = 1e-5) -> Releases:
    return Releases("rdp", "fixed", n, k, delta)


def test_sampling_without_replacement_equals_autodp_recorded() -> None:
    """Recorded independent numbers (above): equal to 1e-9 relative (they agreed to 1e-12 when recorded)."""
    for sigma, n, k, steps, delta, theirs in AUTODP_WOR:
        sigma_eff = effective_multiplier(sigma, None, replace_one=True)
        assert epsilon(_fixed(n, k, delta), sigma_eff, steps) == pytest.approx(theirs, rel=1e-9, abs=0), (sigma, n, k, steps)


def test_sampling_without_replacement_limits() -> None:
    """Every client in every release (q = 1) is the plain Gaussian (= Opacus at q = 1, std / 2C); sampling never
    costs more than it; epsilon falls with the noise and grows with the steps and the cohort."""
    orders = dpa.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS
    for sigma in (1.0, 2.0):
        sigma_eff = effective_multiplier(sigma, None, replace_one=True)
        assert sigma_eff == sigma / 2
        for steps in (1, 100):
            full = epsilon(_fixed(100, 100), sigma_eff, steps)
            gaussian = ordp.compute_rdp(q=1.0, noise_multiplier=sigma / 2, steps=steps, orders=list(orders))
            assert full == pytest.approx(_opacus_epsilon(orders, gaussian, 1e-5)[0], rel=1e-9, abs=0)
            assert epsilon(_fixed(100, 10), sigma_eff, steps) < full
    for steps in (1, 10, 100):
        assert epsilon(_fixed(100, 10), 0.5, steps) > epsilon(_fixed(100, 10), 1.0, steps)
    by_steps = [epsilon(_fixed(100, 10), 1.0, steps) for steps in STEPS]
    by_cohort = [epsilon(_fixed(100, k), 1.0, 10) for k in (5, 10, 20, 100)]
    assert by_steps == sorted(set(by_steps)) and by_cohort == sorted(set(by_cohort))


def test_poisson_epsilon_is_monotone_on_the_grid() -> None:
    for q in RATES:
        for steps in STEPS:
            by_sigma = [epsilon(_poisson(q, 1e-5), s, steps) for s in SIGMAS]
            assert by_sigma == sorted(by_sigma, reverse=True) and by_sigma[0] > by_sigma[-1]
    for sigma in SIGMAS:
        by_rate = [epsilon(_poisson(q, 1e-5), sigma, 100) for q in RATES]
        assert by_rate == sorted(set(by_rate))


@pytest.mark.parametrize("replace_one", [False, True])
def test_effective_and_update_multipliers_are_andrew_et_al_and_inverse(replace_one) -> None:
    s = 2.0 if replace_one else 1.0
    for sigma in (0.5, 1.0, 3.0):
        assert effective_multiplier(sigma, None, replace_one) == pytest.approx(sigma / s, rel=1e-15)
        assert update_multiplier(sigma / s, None, replace_one) == pytest.approx(sigma, rel=1e-15)
        for count_sigma in (0.5, 5.0, 50.0):
            got = effective_multiplier(sigma, count_sigma, replace_one)
            # Andrew et al. 2021 section 3.1 (add/remove): sigma_eff = (sigma^-2 + (2 sigma_b)^-2)^-1/2; replace-one
            # doubles both sensitivities, halving it
            assert got == pytest.approx((sigma ** -2 + (2 * count_sigma) ** -2) ** -0.5 / s, rel=1e-12)
            assert got < sigma / s  # the count always spends some
            assert update_multiplier(got, count_sigma, replace_one) == pytest.approx(sigma, rel=1e-12)
            assert effective_multiplier(update_multiplier(got, count_sigma, replace_one), count_sigma, replace_one) == \
                pytest.approx(got, rel=1e-12)
        # the count's noise alone at or past the budget: no update noise reaches it
        assert update_multiplier(2.0 / s, 1.0, replace_one) is None
    assert effective_multiplier(0.0, 5.0, replace_one) == 0.0 and effective_multiplier(1.0, 0.0, replace_one) == 0.0


@pytest.mark.parametrize("r, target, steps", [
    # sampling without replacement: about ten 0.2 s curves (over 5 s on 2 loaded cores), so in the integration tier
    pytest.param(Releases("rdp", "fixed", 100, 10, 1e-5), 4.0, 20, marks=pytest.mark.integration),
    (Releases("rdp", "poisson", 1000, 50, 1e-3), 2.0, 100),
    (Releases("rdp", "none", 100, 100, 1e-5), 8.0, 10),
])
def test_calibrate_spends_at_most_the_target_and_nearly_all_of_it(r, target, steps) -> None:
    sigma = calibrate(r, target, steps)
    assert target * (1 - 1e-3) <= epsilon(r, sigma, steps) <= target


def _ledger_matches_fresh(r: Releases, sigma: float, steps: int, rel: float) -> None:
    ledger = Ledger(r, sigma)
    for t in range(1, steps + 1):
        ledger.advance()
        assert ledger.steps == t
        assert ledger.epsilon() == pytest.approx(epsilon(r, sigma, t), rel=rel, abs=0)
    resumed = Ledger(r, sigma, steps)
    resumed.advance()
    ledger.advance()
    assert resumed.steps == ledger.steps and resumed.epsilon() == ledger.epsilon()  # exactly, as a resumed run records


def test_ledger_rdp_advanced_one_at_a_time_equals_fresh_and_resumed() -> None:
    _ledger_matches_fresh(Releases("rdp", "fixed", 100, 10, 1e-5), 1.0, 5, rel=1e-12)
    _ledger_matches_fresh(Releases("rdp", "poisson", 1000, 100, 1e-3), 1.0, 5, rel=1e-12)


@pytest.mark.integration  # PLD compositions, seconds each
def test_ledger_pld_advanced_one_at_a_time_equals_fresh_and_resumed() -> None:
    _ledger_matches_fresh(Releases("pld", "poisson", 1000, 100, 1e-3), 2.0, 4, rel=1e-6)


PRIVATE = ("privacy.mode=central",)


@pytest.mark.parametrize("overrides, needles", [
    (("algorithm.name=fedavg", "privacy.noise_multiplier=0.5", "privacy.target_epsilon=1", "privacy.delta=1e-5"),
     ("privacy.noise_multiplier=0.5", "spends epsilon", "privacy.target_epsilon=1", "training.rounds=4")),
    (("algorithm.name=heterofl", "privacy.target_epsilon=0.001", "privacy.delta=1e-5"),
     ("privacy.target_epsilon=0.001", "must lie between", "1000", "0.3")),
    (("algorithm.name=fedavg", "privacy.accountant=pld", "privacy.noise_multiplier=1"),
     ("privacy.accountant='pld'", "sampling without replacement")),
    (("algorithm.name=heterofl", "privacy.sampling=poisson", "privacy.denominator=coverage", "privacy.noise_multiplier=1"),
     ("privacy.denominator='coverage'", "privacy.sampling=fixed")),
    (("algorithm.name=fedavg", "privacy.noise_cohort_size=5", "privacy.noise_multiplier=1"),
     ("privacy.noise_cohort_size=5", "cohort (10 clients")),
    (("algorithm.name=fedavg", "privacy.clipping=adaptive", "privacy.count_noise=0.01", "privacy.target_epsilon=8"),
     ("privacy.count_noise=0.01", "privacy.target_epsilon=8")),
    (("algorithm.name=fedavg",), ("privacy.noise_multiplier=None", "needs privacy.noise_multiplier")),
    (("privacy.noise_multiplier=1",), ("algorithm.name='fedsap'", "does not support fedsap", "supported: fedavg")),
])
def test_privacy_refusals_name_the_field_and_numbers(overrides, needles) -> None:
    with pytest.raises(ConfigError) as e:
        build_config(preset="smoke", overrides=[*PRIVATE, *overrides])
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_a_field_set_with_privacy_off_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"privacy.noise_multiplier=1.0: read only with privacy.mode=central"):
        build_config(preset="smoke", overrides=["algorithm.name=fedavg", "privacy.noise_multiplier=1"])


def test_an_over_budget_run_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys) -> None:
    """The command's own exit path, in process (the console script's exit codes as a subprocess:
    tests/test_cli_subprocess.py, which this refusal takes like every ConfigError)."""
    from fedsap_ray import cli

    code = cli.main(["run", "--preset", "smoke", "--out", str(tmp_path), "--set", "algorithm.name=fedavg", "--set",
                     "privacy.mode=central", "--set", "privacy.noise_multiplier=0.5", "--set", "privacy.target_epsilon=1"])
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "privacy.noise_multiplier=0.5" in lines[0] and "privacy.target_epsilon=1" in lines[0]
    assert not (tmp_path / "runs").exists()


if __name__ == "__main__":  # print AUTODP_WOR from autodp (see above): PYTHONPATH=/tmp/autodp python tests/config/test_accountant.py
    from autodp import rdp_acct, rdp_bank

    orders = list(dpa.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    for sigma, n, k in [(1.0, 100, 10), (2.0, 500, 50), (5.0, 1000, 10)]:
        acct = rdp_acct.anaRDPacct(m=256)
        s = sigma * 1.0 / (2 * 1.0)  # std sigma x C over the replace-one sensitivity 2C
        acct.compose_subsampled_mechanism(lambda a, s=s: rdp_bank.RDP_gaussian({"sigma": s}, a), k / n, improved_bound_flag=True)
        one = [acct.RDPs[0](a) for a in orders]
        for delta in (1e-5, 1 / n) if n == 1000 else (1e-5,):  # each delta a curve of ours (its cache holds r)
            for steps in (1, 100, 1000):
                print(f"    ({sigma}, {n}, {k}, {steps}, {delta!r}, {_opacus_epsilon(orders, [x * steps for x in one], delta)[0]!r}),")
