"""Client-level DP of the updates (issue 57; fedsap_ray/engine/privacy.py, fedsap_ray/algorithms/dpnoise.py) in
motion: clipping bounds every update and leaves the unclipped ones bit for bit; the noise's measured std matches
sigma C / D per coordinate, under both denominators (per coverage count); a zero-noise run equals the non-private
run exactly; adaptive clipping moves C both ways; Poisson samples vary and an empty one still releases noise; a
private run resumed from its checkpoint equals the run never stopped, and without the checkpoint's privacy state it
does not; the asynchronous engine clips against each update's downloaded version and composes one release per
step; local DP noises each client's update. The accountant's epsilons: tests/config/test_accountant.py."""
from __future__ import annotations

import dataclasses
import math
import shutil

import numpy as np
import pandas as pd
import pytest

from fedsap_ray import results
from fedsap_ray.algorithms.aggregation import masked_weighted_average
from fedsap_ray.algorithms.dpnoise import NoisySum, noisy_sums
from fedsap_ray.common.messages import ClientResult
from fedsap_ray.config import build_config
from fedsap_ray.engine.privacy import PrivateRounds
from fedsap_ray.experiment import run_experiment
from fedsap_ray.persist import checkpoint
from tests.conftest import federation_fixture, steady, tiny_overrides

HETERO = tiny_overrides("heterofl", "data.num_clients=8", "training.eval_deployed=false", "training.rounds=4",
                        "algorithm.weighting=count")
CENTRAL = ["privacy.mode=central"]
fed = federation_fixture(HETERO)

DP_COLUMNS = ["dp_epsilon", "dp_clip_norm", "dp_noise_std", "dp_snr_shared", "dp_snr_partial", "dp_unclipped_noised",
              "dp_update_norm", "dp_clipped"]


def _run(tmp_path, fed, *extra, name="r"):
    cfg = build_config(preset="smoke", overrides=[*HETERO, *extra])
    outcome = run_experiment(cfg, tmp_path / name, run_id="r", federation=fed)
    assert outcome.status == "finished", outcome
    return cfg, results.load(tmp_path / name)


def _result(cid: int, values: np.ndarray, mask: np.ndarray | None = None) -> ClientResult:
    return ClientResult(client_id=cid, round=1, values=values.astype(np.float32), mask=mask, n_samples=10,
                        train_loss=0.0, samples_seen=10)


def _rounds(cfg) -> PrivateRounds:
    mech = PrivateRounds.for_config(cfg)
    assert mech is not None
    return mech


def test_clipping_bounds_every_update_and_leaves_the_others_bit_for_bit():
    cfg = build_config(preset="smoke", overrides=[*HETERO, *CENTRAL, "privacy.noise_multiplier=1",
                                                  "privacy.clip_norm=2.0"])
    mech = _rounds(cfg)
    rng = np.random.default_rng(0)
    down = rng.standard_normal(50).astype(np.float32)
    mask = np.zeros(50, dtype=bool)
    mask[::3] = True
    results_ = [_result(i, down[mask] + rng.standard_normal(int(mask.sum())) * s, mask)
                for i, s in enumerate([0.01, 0.2, 1.0, 5.0, 50.0])]
    clipped, cols = mech.clip(1, results_, lambda r: down[mask])
    for before, after in zip(results_, clipped):
        norm = float(np.linalg.norm(before.values.astype(np.float64) - down[mask]))
        assert cols[before.client_id]["dp_update_norm"] == pytest.approx(norm, rel=1e-9)
        assert cols[before.client_id]["dp_clipped"] == (norm > 2.0)
        moved = np.linalg.norm(after.values.astype(np.float64) - down[mask])
        if norm > 2.0:
            assert moved == pytest.approx(2.0, rel=1e-5)  # scaled onto the ball, its direction kept
            cos = np.dot(after.values - down[mask], before.values - down[mask]) / (moved * norm)
            assert cos == pytest.approx(1.0, abs=1e-5)
        else:
            assert after is before  # the trained values themselves
    assert sum(c["dp_clipped"] for c in cols.values()) == 3
    with pytest.raises(RuntimeError, match="uploaded"):  # anything besides the update is refused by name
        mech.clip(1, [dataclasses.replace(results_[0], stats={"classes": np.ones(3, bool)})], lambda r: down[mask])


@pytest.mark.parametrize("denominator", ["cohort", "coverage"])
def test_the_noise_std_is_sigma_c_over_the_denominator_per_coordinate(denominator):
    """Zero updates of four clients over three coverage levels (4, 2, 1 clients and an uncovered block), 3000
    seeded releases: the measured std per coordinate group is std / D (cohort) or std / c_j (coverage)."""
    n, draws, std = 40, 3000, 0.7
    masks = [np.arange(n) < 30, np.arange(n) < 20, np.arange(n) < 10, np.arange(n) < 10]  # c_j = 4, 2, 1 by block
    old = np.zeros(n, dtype=np.float32)
    contribs = [(m, old[m], 5.0) for m in masks]
    rel = NoisySum(std=std, denominator=denominator, cohort=4.0, rng=np.random.default_rng(1))
    with noisy_sums(rel):
        out = np.stack([masked_weighted_average(old, contribs) for _ in range(draws)])
    blocks = {4: slice(0, 10), 2: slice(10, 20), 1: slice(20, 30), 0: slice(30, 40)}
    for c, sl in blocks.items():
        measured = out[:, sl].std()
        if denominator == "cohort":
            expected = std / 4.0  # every coordinate, covered or not
        else:
            expected = std / c if c else 0.0  # only where some client trained it
        tol = 4 * expected / math.sqrt(2 * draws * 10) + 1e-12  # 4 standard errors of a std estimate
        assert abs(measured - expected) <= tol, (c, measured, expected)
        assert abs(out[:, sl].mean()) <= 4 * expected / math.sqrt(draws * 10) + 1e-12


def test_a_zero_noise_run_equals_the_non_private_run_exactly(tmp_path, fed):
    """sigma = 0, C above every update, denominator=coverage: the unweighted mean of HeteroFL weighting=count."""
    short = "training.rounds=2"
    _, plain = _run(tmp_path, fed, short, name="plain")
    _, quiet = _run(tmp_path, fed, short, *CENTRAL, "privacy.noise_multiplier=0", "privacy.clip_norm=1e9",
                    "privacy.denominator=coverage", name="quiet")
    for table in ("rounds", "clients"):
        a, b = steady(getattr(plain, table)), steady(getattr(quiet, table)).drop(columns=DP_COLUMNS, errors="ignore")
        pd.testing.assert_frame_equal(a.drop(columns=DP_COLUMNS, errors="ignore"), b)
    assert (quiet.rounds["dp_epsilon"] == math.inf).all()
    assert not quiet.clients["dp_clipped"].any() and plain.rounds["dp_epsilon"].isna().all()
    # and noise moves it: the same run with noise gives other numbers
    _, noisy = _run(tmp_path, fed, short, *CENTRAL, "privacy.noise_multiplier=1e-11", "privacy.clip_norm=1e9",
                    "privacy.denominator=coverage", name="noisy")
    assert not np.allclose(noisy.rounds["loss"].to_numpy(), quiet.rounds["loss"].to_numpy())


def test_adaptive_clipping_moves_c_towards_the_target_quantile_both_ways(fed):
    def run(clip: float) -> list[float]:
        cfg = build_config(preset="smoke", overrides=[*HETERO, *CENTRAL, "privacy.noise_multiplier=1",
                                                      "privacy.clipping=adaptive", f"privacy.clip_norm={clip}",
                                                      "privacy.count_noise=0.01", "privacy.clip_lr=0.5"])
        mech = _rounds(cfg)
        down = np.zeros(20, dtype=np.float32)
        trace = []
        for t in range(1, 9):
            rs = [_result(i, np.full(20, 1.0 + 0.01 * i)) for i in range(4)]  # norms ~4.47, all alike
            _, cols = mech.clip(t, rs, lambda r: down)
            with mech.release(t):
                pass
            from fedsap_ray.common.messages import RoundOutput, ServerState
            mech.record(t, RoundOutput.unchanged(ServerState(0, down), t), cols)
            trace.append(mech.clip_norm)
        return trace

    up, down_ = run(0.5), run(50.0)
    assert all(b > a for a, b in zip(up, up[1:]))  # every update clipped: C grows
    assert all(b < a for a, b in zip(down_, down_[1:]))  # none clipped: C shrinks


def test_poisson_samples_vary_and_an_empty_one_still_releases_noise(tmp_path, fed):
    cfg, res = _run(tmp_path, fed, *CENTRAL, "privacy.noise_multiplier=1", "privacy.sampling=poisson",
                    "training.participation=0.15", "training.rounds=6")
    sizes = res.clients.groupby("round").size().reindex(range(1, 7), fill_value=0)
    assert sizes.nunique() > 1  # each client on its own coin
    empty = [t for t in range(1, 7) if sizes[t] == 0]
    assert empty, sizes.to_dict()  # seed 0's coins leave a round without clients at q = 1/8
    eps = res.rounds.drop_duplicates("round").set_index("round")["dp_epsilon"]
    assert eps.is_monotonic_increasing and eps[empty[0]] > eps.get(empty[0] - 1, 0.0)  # a release all the same


@pytest.mark.integration  # 4 + 2 + 2 rounds: ~9 s
def test_a_resumed_private_run_equals_the_run_never_stopped(tmp_path, fed):
    """Adaptive clipping: C after round 2 is state; the checkpoint holds it with the releases composed."""
    extra = [*CENTRAL, "privacy.target_epsilon=20", "privacy.clipping=adaptive", "privacy.clip_norm=0.3",
             "privacy.count_noise=5"]
    cfg, whole = _run(tmp_path, fed, *extra, name="whole")
    assert whole.rounds["dp_clip_norm"].nunique() > 1

    def stop(summary):
        if summary.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", run_id="r", federation=fed, progress=stop)
    ck = checkpoint.load(tmp_path / "cut", "r")
    assert ck["privacy"]["releases"] == 2 and ck["privacy"]["clip_norm"] != 0.3
    aside = tmp_path / "cut-without-privacy"
    shutil.copytree(tmp_path / "cut", aside)
    run_experiment(cfg, tmp_path / "cut", run_id="r", federation=fed, resume=True)
    resumed = results.load(tmp_path / "cut")
    for table in ("rounds", "clients"):
        pd.testing.assert_frame_equal(steady(getattr(resumed, table)), steady(getattr(whole, table)))
    # the privacy state is what makes it exact: a checkpoint without it is refused by name, and restoring a fresh
    # mechanism instead (C back at 0.3, no release counted) gives other numbers
    st = ck["state"]
    checkpoint.save(aside, "r", st, ck["server"], tables=ck["tables"], rows=ck.get("rows"))
    with pytest.raises(Exception, match="privacy state"):
        run_experiment(cfg, aside, run_id="r", federation=fed, resume=True)
    checkpoint.save(aside, "r", st, ck["server"], tables=ck["tables"], rows=ck.get("rows"),
                    privacy={"clip_norm": 0.3, "releases": 0, "participations": ck["privacy"]["participations"]})
    run_experiment(cfg, aside, run_id="r", federation=fed, resume=True)
    fresh = results.load(aside).rounds.drop_duplicates("round").set_index("round")
    assert fresh.loc[3, "dp_clip_norm"] == 0.3 and fresh.loc[4, "dp_epsilon"] < whole.rounds["dp_epsilon"].max()


@pytest.mark.integration  # three asynchronous runs: ~6 s
def test_the_asynchronous_engine_clips_each_update_and_composes_one_release_per_step(tmp_path, fed):
    mode = ["devices.mode=async", "asynchronous.concurrency=4", "asynchronous.buffer_size=2", "training.rounds=5",
            "devices.jitter=0.5"]
    _, res = _run(tmp_path, fed, *mode, *CENTRAL, "privacy.noise_multiplier=2", "privacy.clip_norm=0.5")
    steps = res.rounds.drop_duplicates("round")
    assert steps["dp_epsilon"].is_monotonic_increasing and steps["dp_epsilon"].nunique() == 5
    applied = res.clients[res.clients["version_applied"].notna()]
    assert applied["dp_update_norm"].notna().all() and applied["dp_clipped"].any()
    assert (applied["staleness"] > 0).any()  # some updates were stale: clipped against their own version
    _, plain = _run(tmp_path, fed, *mode, name="plain-async")
    _, quiet = _run(tmp_path, fed, *mode, *CENTRAL, "privacy.noise_multiplier=0", "privacy.clip_norm=1e9",
                    "privacy.denominator=coverage", name="quiet-async")
    pd.testing.assert_frame_equal(steady(plain.rounds).drop(columns=DP_COLUMNS, errors="ignore"),
                                  steady(quiet.rounds).drop(columns=DP_COLUMNS, errors="ignore"))


def test_local_dp_noises_each_update_on_its_client(tmp_path, fed):
    cfg = build_config(preset="smoke", overrides=[*HETERO, "privacy.mode=local", "privacy.noise_multiplier=0.5",
                                                  "privacy.clip_norm=0.5"])
    mech = _rounds(cfg)
    down = np.zeros(4000, dtype=np.float32)
    noised, cols = mech.clip(1, [_result(i, down) for i in range(3)], lambda r: down)
    for r in noised:  # a zero update leaves its client as N(0, (sigma C)^2) per coordinate, each client its own draw
        assert r.values.std() == pytest.approx(0.25, rel=0.05) and not cols[r.client_id]["dp_clipped"]
    assert not np.array_equal(noised[0].values, noised[1].values)
    _, res = _run(tmp_path, fed, "privacy.mode=local", "privacy.noise_multiplier=0.5", "privacy.clip_norm=0.5")
    steps = res.rounds.drop_duplicates("round")
    assert steps["dp_noise_std"].isna().all()  # no server noise
    # epsilon follows the most-released client's count: fixed sampling of 3 in 8 repeats some client
    assert steps["dp_epsilon"].is_monotonic_increasing and (steps["dp_epsilon"] > 0).all()


SUPPORTED = ["fedavg", "fedprox", "fedrolex", "fjord", "heterofl", "uniform"]


def test_the_supported_methods_are_exactly_those_declared_and_the_others_refused_by_name():
    """privacy_support says yes for exactly these; every other method is refused by name (the config check reads
    the same declaration)."""
    from fedsap_ray.config import ConfigError, registry

    declared = [n for n in registry.STRATEGIES.names()
                if registry.STRATEGIES.get(n).privacy_support(registry.STRATEGIES.get(n).Options()) is None]
    assert declared == SUPPORTED
    for name in sorted(set(registry.STRATEGIES.names()) - set(SUPPORTED)):
        with pytest.raises(ConfigError, match=f"does not support {name}"):
            build_config(preset="smoke", overrides=[f"algorithm.name={name}", "privacy.mode=central",
                                                    "privacy.noise_multiplier=1"])


@pytest.mark.integration  # twelve runs: ~15 s
@pytest.mark.parametrize("name", SUPPORTED)
def test_every_supported_method_runs_private_synchronous_and_asynchronous(tmp_path, fed, name):
    short = ["training.rounds=2", "privacy.mode=central", "privacy.target_epsilon=8", "privacy.clip_norm=0.5",
             "training.max_steps_per_epoch=1"]
    base = [o for o in HETERO if o != "algorithm.weighting=count"]
    for mode in ([], ["devices.mode=async", "asynchronous.concurrency=3", "asynchronous.buffer_size=2"]):
        cfg = build_config(preset="smoke", overrides=[*base, f"algorithm.name={name}", *short, *mode])
        run_experiment(cfg, tmp_path / f"run{len(mode)}", run_id="r", federation=fed)
        res = results.load(tmp_path / f"run{len(mode)}")
        eps = res.rounds.drop_duplicates("round")["dp_epsilon"]
        assert len(eps) == 2 and eps.is_monotonic_increasing and eps.iloc[-1] <= 8, mode
        assert res.clients["dp_update_norm"].notna().all() and res.clients["dp_clipped"].any(), mode


def test_noise_never_leaves_a_batchnorm_variance_negative(fed):
    """Post-processing: a running variance the noise pushed below 0 is set to 0, nothing else is touched."""
    from fedsap_ray.experiment import build_context

    cfg = build_config(preset="smoke", overrides=[*HETERO, *CENTRAL, "privacy.noise_multiplier=1"])
    layout = build_context(cfg, fed).layout
    mech = PrivateRounds.for_config(cfg, layout)
    assert mech is not None and mech.variances is not None and mech.variances.any()
    params = np.random.default_rng(0).standard_normal(layout.size).astype(np.float32)
    fixed = mech.post_process(params)
    assert (fixed[mech.variances] >= 0).all() and (params[mech.variances] < 0).any()
    assert np.array_equal(fixed[~mech.variances], params[~mech.variances])
    assert np.array_equal(fixed[mech.variances], np.maximum(params[mech.variances], 0))
    ok = np.abs(params)
    assert mech.post_process(ok) is ok


def test_noise_cohort_size_noises_as_for_the_larger_cohort_and_accounts_for_it():
    """pfl-research's option: the sum's noise std is sigma C x cohort / noise_cohort_size, and epsilon is that of
    noise_cohort_size clients sampled from privacy.population."""
    from fedsap_ray.config.accountant import Releases, epsilon
    from fedsap_ray.config.privacy_config import resolve

    base = [*HETERO, *CENTRAL, "privacy.noise_multiplier=1.5", "privacy.clip_norm=2",
            "training.participation=0.25"]  # cohort: round(0.25 * 8) = 2
    cfg = build_config(preset="smoke", overrides=[*base, "privacy.noise_cohort_size=100",
                                                  "privacy.population=10000"])
    noise = resolve(cfg)
    assert noise is not None and noise.cohort == 2 and noise.noise_scale == pytest.approx(2 / 100)
    mech = _rounds(cfg)
    with mech.release(1):
        assert mech._open is not None and mech._open.std == pytest.approx(1.5 * 2 * 2 / 100)
    r = Releases("rdp", "fixed", 10000, 100, 1 / 10000)
    assert noise.planned_epsilon == pytest.approx(epsilon(r, 1.5 / 2, cfg.training.rounds))
    own = resolve(build_config(preset="smoke", overrides=base))
    assert own is not None and own.releases == Releases("rdp", "fixed", 8, 2, 1 / 8) and own.noise_scale == 1.0


def test_every_client_weighs_one_in_the_private_sum():
    """A sample count is the client's data and unbounded: the private merge ignores the strategy's weights."""
    old = np.zeros(4, dtype=np.float32)
    contribs = [(None, np.full(4, 1.0, dtype=np.float32), 100.0), (None, np.full(4, 3.0, dtype=np.float32), 1.0)]
    for denominator in ("coverage", "cohort"):
        with noisy_sums(NoisySum(std=0.0, denominator=denominator, cohort=2.0, rng=np.random.default_rng(0))):
            assert np.array_equal(masked_weighted_average(old, contribs), np.full(4, 2.0, dtype=np.float32))
    assert masked_weighted_average(old, contribs)[0] == pytest.approx(103 / 101)  # outside: the weighted mean


@pytest.mark.parametrize("extra, field", [(["devices.policy=over_select"], "devices.policy"),
                                          (["devices.availability=0.5"], "devices.availability")])
def test_a_sample_the_accountant_would_undercount_is_refused(extra, field):
    """The accountant's sampling probability is cohort / N: over-selection (more clients sampled than aggregated) and
    availability (a round drawn from fewer than N) would each raise a client's real chance above it."""
    from fedsap_ray.config import ConfigError

    with pytest.raises(ConfigError, match=f"invalid {field}=.*cohort / N"):
        build_config(preset="smoke", overrides=[*HETERO, *CENTRAL, "privacy.noise_multiplier=1", *extra])
