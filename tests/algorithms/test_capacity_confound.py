"""papers/003 on hand-built cases: Proposition 3 and frozen_params, the coverage guarantee, Eqs. 4-6,
the matched-budget random control, FjORD/Uniform/HeteroFL widths, and the records a user reads."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import aggregate, run_rounds
from faultkit import stepped_run
from fedsap_ray import results
from fedsap_ray.algorithms.hasfl import allocation_rule
from fedsap_ray.algorithms.random_budget import match_budget
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.experiment import build_context, run_experiment
from fedsap_ray.models.masks import nested_channel_masks, param_mask, trainable_mask
from fedsap_ray.common.messages import ClientResult

TINY = ["data.num_clients=6", "data.max_test_per_domain=40", "model.width_mult=0.125", "training.local_epochs=1",
        "training.batch_size=16", "training.max_steps_per_epoch=3"]
# 6 clients with p_max 1, .8, .6, .4, .2, 1 (smoke's cyclic capacities)


@pytest.fixture(scope="module")
def fed():
    return build_federation(build_config(preset="smoke", overrides=TINY))


def _cfg(*extra: str):
    return build_config(preset="smoke", overrides=[*TINY, *extra])


def _outside(ctx, p: float) -> np.ndarray:
    """Trainable coordinates outside the leading p-slice of every layer (Algorithm 2)."""
    inside = param_mask(ctx.space, ctx.layout, nested_channel_masks(ctx.space, p))
    return trainable_mask(ctx.layout, ctx.model) & ~inside


# --- Proposition 3 -----------------------------------------------------------------------------
def test_prop3_capped_clients_leave_outer_coordinates_at_init_and_frozen_params_counts_them(tmp_path, fed):
    cfg = _cfg("capacity.scheme=full", "algorithm.name=uniform", "training.rounds=3")  # every p_i = 0.5 < 1
    fed = build_federation(cfg)
    states, _ = stepped_run(tmp_path, cfg, fed)  # one run: its states and its tables
    ctx = build_context(cfg, fed)
    outside = _outside(ctx, 0.5)
    assert outside.sum() > 0
    assert states[3].params[outside].tobytes() == states[0].params[outside].tobytes()  # bit-identical
    inside = trainable_mask(ctx.layout, ctx.model) & ~outside
    assert (states[3].params[inside] != states[0].params[inside]).mean() > 0.9  # the rest trained
    rounds = results.load(tmp_path).rounds
    assert set(rounds["frozen_params"]) == {int(outside.sum())}


def test_coverage_guarantee_leaves_no_coordinate_frozen_and_its_absence_does(fed):
    common = ["algorithm.name=hasfl", "algorithm.warmup=1", "algorithm.t_adapt=1", "algorithm.p_min=0.3",
              "algorithm.gamma=0.05", "training.rounds=4", "capacity.scheme=explicit",
              "capacity.keep_ratios=[1.0, 1.0, 0.5, 0.5, 0.25, 0.25]"]
    f = build_federation(_cfg(*common))  # capacities come from the federation
    ctx, _, on = run_rounds(_cfg(*common), f, 4)
    _, _, off = run_rounds(_cfg(*common, "algorithm.coverage=false"), f, 4)
    # after the first adaptation step (end of round 1) the widest clients keep p_max = 1 only with the guarantee
    assert on[1].strategy_state.alloc[:2].tolist() == [1.0, 1.0]
    top = float(off[1].strategy_state.alloc.max())
    assert top < 0.5
    outside = _outside(ctx, top)
    for t in (2, 3, 4):  # without the guarantee nobody trains the outer slice any more
        assert off[t].params[outside].tobytes() == off[1].params[outside].tobytes()
    assert (on[4].params[outside] != on[1].params[outside]).mean() > 0.9  # with it they keep training


@pytest.fixture(scope="module")
def hasfl_run(tmp_path_factory, fed) -> results.Results:
    """HAS-FL on the smoke preset (warm-up 2, T_adapt 1, T_norm 2, 4 rounds), run end to end: its tables."""
    out = tmp_path_factory.mktemp("hasfl")
    run_experiment(_cfg("algorithm.name=hasfl"), out, run_id="s", federation=fed)
    return results.load(out)


def test_frozen_params_is_zero_under_full_coverage(hasfl_run):
    assert (hasfl_run.rounds["frozen_params"] == 0).all()


# --- Eqs. 4-6 ----------------------------------------------------------------------------------
def test_allocation_rule_and_coverage_on_hand_computed_inputs():
    h = np.array([1.0, 2.0, 3.0, 2.0])  # mean 2
    p_max = np.array([0.25, 0.5, 1.0, 1.0])
    # p_min + gamma * h / mean = 0.4 + 0.25 * [0.5, 1, 1.5, 1] = [0.525, 0.65, 0.775, 0.65]
    np.testing.assert_allclose(allocation_rule(h, p_max, 0.4, 0.25, 0.0, coverage=False), [0.25, 0.5, 0.775, 0.65])
    np.testing.assert_allclose(allocation_rule(h, p_max, 0.4, 0.25, 0.0, coverage=True), [0.25, 0.5, 1.0, 1.0])
    # gamma = 0 is uniform allocation at p_min (section 3.3)
    np.testing.assert_allclose(allocation_rule(h, p_max, 0.4, 0.0, 0.0, coverage=False), [0.25, 0.4, 0.4, 0.4])


def test_h_hat_is_restricted_to_the_clients_own_mask(fed):
    cfg = _cfg("algorithm.name=hasfl", "capacity.scheme=explicit", "capacity.keep_ratios=[1.0, 0.5, 1, 1, 1, 1]")
    ctx, strat, states = run_rounds(cfg, build_federation(cfg), 0)
    state = states[0]
    rng = np.random.default_rng(0)
    full, half = None, strat.nested_mask(0.5)[0]
    res = []
    for cid, mask, n in ((0, full, 30), (1, half, 10)):
        start = state.params if mask is None else state.params[mask]
        res.append(ClientResult(client_id=cid, round=1, values=(start + rng.normal(0, 0.1, start.size)).astype(np.float32),
                                n_samples=n, train_loss=1.0, mask=mask))
    new = aggregate(strat, state, res, 1).state
    trainable = trainable_mask(ctx.layout, ctx.model)
    dbar = new.params.astype(np.float64) - state.params
    for r, mask in zip(res, (np.ones_like(half), half)):
        sel = mask & trainable
        d_i = np.zeros(ctx.layout.size)
        d_i[mask] = r.values.astype(np.float64) - state.params[mask]
        want = np.sum((d_i[sel] - dbar[sel]) ** 2) / (np.sum(dbar[sel] ** 2) + 1e-8)
        assert new.strategy_state.h_hat[r.client_id] == pytest.approx(want, rel=1e-9)
    # the half-width client's estimate ignores coordinates it did not train: change client 0's update
    # outside the half-width slice only, and client 1's H_hat stays bit-identical
    moved = res[0].values.copy()
    moved[~half] += 1.0
    again = aggregate(strat, state, [ClientResult(client_id=0, round=1, values=moved, n_samples=30, train_loss=1.0, mask=None), res[1]],
                      1).state
    assert again.strategy_state.h_hat[1] == new.strategy_state.h_hat[1]
    assert again.strategy_state.h_hat[0] != new.strategy_state.h_hat[0]
    # round 1 is no adaptation step under the defaults (warm-up 10): the EMA did not move
    assert new.strategy_state.h_tilde.tolist() == [1.0] * 6 and not strat.width.adapted(strat, 1)


def test_smoke_preset_hasfl_adapts_after_warmup_and_normalises(fed, hasfl_run):
    cfg = _cfg("algorithm.name=hasfl")  # smoke: warm-up 2, T_adapt 1, T_norm 2, 4 rounds (hasfl_run's config)
    ctx, strat, states = run_rounds(cfg, fed, 4)
    assert [strat.width.adapted(strat, t) for t in range(1, 5)] == [False, True, True, True]
    assert states[1].strategy_state.h_tilde.tolist() == [1.0] * 6  # before warm-up ends: initial estimates
    for t in (2, 4):  # normalised: H~ divided by its mean
        assert states[t].strategy_state.h_tilde.mean() == pytest.approx(1.0)
    assert states[3].strategy_state.h_tilde.mean() != pytest.approx(1.0)
    p_max = strat.capacities()
    st2 = states[2].strategy_state
    np.testing.assert_allclose(st2.alloc, allocation_rule(st2.h_tilde, p_max, 0.4, 0.25, 1e-8, True))
    assert not np.allclose(states[2].strategy_state.alloc, p_max)  # the rule really changed some widths
    res = hasfl_run  # the same run end to end
    alloc = res.allocations
    assert len(alloc) == 4 * 6 and alloc["adapted"].tolist() == [False] * 6 + [True] * 18
    np.testing.assert_allclose(alloc[alloc["round"] == 4].sort_values("client_id")["h_tilde"], states[4].strategy_state.h_tilde)
    # the widths a client trained are the allocations in force (round 3 uses round 2's adaptation)
    np.testing.assert_allclose(alloc[alloc["round"] == 3].sort_values("client_id")["p"], states[2].strategy_state.alloc)
    cl = res.clients[res.clients["round"] == 3].sort_values("client_id")
    np.testing.assert_allclose(cl["capacity_used"], states[2].strategy_state.alloc[cl["client_id"]])
    assert cl["h_hat"].notna().all() and cl["macs_per_sample"].gt(0).all()


# --- matched-budget random control -------------------------------------------------------------
def test_match_budget_hits_the_total_exactly_and_respects_caps():
    p_max = np.array([0.5, 0.5, 0.75, 0.75, 1.0, 1.0])
    draws = np.array([0.25, 0.25, 0.3, 0.74, 0.9, 0.4])
    fixed = p_max == 1.0
    p = match_budget(draws, p_max, fixed, total=0.6 * 6)
    assert p.sum() == pytest.approx(3.6) and (p <= p_max + 1e-12).all() and (p[fixed] == 1.0).all()
    # 1.6 left for the 4 free clients: scaling by 1.6 / 1.54 would push client 3 over its cap (0.769 > 0.75),
    # so it is capped and the other three share 0.85 in proportion 0.25 : 0.25 : 0.3 (factor 1.0625)
    np.testing.assert_allclose(p[:4], [0.265625, 0.265625, 0.31875, 0.75])
    assert match_budget(draws, p_max, fixed, total=10.0).tolist() == p_max.tolist()  # unreachable: all at p_max


def test_random_budget_matches_hasfl_budget_at_every_adaptation_step(fed):
    # smoke: adaptation at rounds 2, 3, 4; p_min 0.1 leaves HAS-FL's widths below most caps
    cfg = _cfg("algorithm.name=random_budget", "algorithm.p_min=0.1", "training.rounds=4")
    _, strat, states = run_rounds(cfg, fed, 4)
    p_max = strat.capacities()
    steps = [s for t, s in enumerate(states[1:], 1) if strat.width.adapted(strat, t)]
    assert len(steps) == 3
    for s in steps:
        target = allocation_rule(s.strategy_state.h_tilde, p_max, 0.1, 0.25, 1e-8, True)
        assert s.strategy_state.alloc.mean() == pytest.approx(target.mean(), abs=1e-12)
        assert (s.strategy_state.alloc <= p_max + 1e-12).all() and (s.strategy_state.alloc > 0).all()
        assert (s.strategy_state.alloc[p_max == p_max.max()] == p_max.max()).all()  # coverage as for HAS-FL
        assert not np.allclose(s.strategy_state.alloc, target)  # ... but not HAS-FL's allocation
    assert not np.allclose(steps[0].strategy_state.alloc, steps[1].strategy_state.alloc)  # redrawn at every step


# --- static rules ------------------------------------------------------------------------------
def test_heterofl_equals_heterogeneous_fedavg_exactly(fed):
    _, _, a = run_rounds(_cfg("algorithm.name=heterofl", "training.rounds=2"), fed, 2)
    _, _, b = run_rounds(_cfg("algorithm.name=fedavg", "algorithm.width=capacity", "training.rounds=2"), fed, 2)
    assert a[2].params.tobytes() == b[2].params.tobytes()


def test_fjord_draws_tiers_at_or_below_p_max_and_changes_across_rounds(fed):
    _, strat, states = run_rounds(_cfg("algorithm.name=fjord"), fed, 0)
    tiers = {0.2, 0.4, 0.6, 0.8, 1.0}
    widths = np.array([[strat.width_for(states[0], c, t) for c in range(6)] for t in range(1, 41)])
    p_max = np.array([c.capacity for c in fed.clients])
    assert set(np.round(widths.ravel(), 6)) <= tiers
    assert (widths <= p_max + 1e-12).all()
    assert np.allclose(widths[:, 4], 0.2)  # the weakest tier has one option
    assert len(set(widths[:, 0])) == 5  # the strongest client sees every tier over 40 rounds
    again = [strat.width_for(states[0], 0, t) for t in range(1, 41)]
    assert again == widths[:, 0].tolist()  # seeded: a pure function of (seed, round, client)


def test_uniform_caps_every_client_at_half_width(fed):
    _, strat, states = run_rounds(_cfg("algorithm.name=uniform"), fed, 0)
    np.testing.assert_allclose([strat.width_for(states[0], c, 1) for c in range(6)], [0.5, 0.5, 0.5, 0.4, 0.2, 0.5])


@pytest.mark.parametrize("bad", ["algorithm.beta=1.0", "algorithm.t_adapt=0", "algorithm.p_min=0",
                                 "algorithm.coverage=maybe"])
def test_hasfl_rejects_bad_options_naming_the_field(bad):
    from fedsap_ray.config import ConfigError

    with pytest.raises(ConfigError, match=bad.split("=")[0]):
        _cfg("algorithm.name=hasfl", bad)


# --- the study's variants come from the registry ------------------------------------------------------------
PAPER_ROWS = {  # the rows sweeps/capacity_confound.py listed by hand before issue 55, in its order
    "hasfl": ["algorithm.name=hasfl"],
    "hasfl-nocov": ["algorithm.name=hasfl", "algorithm.coverage=false"],
    "random_budget": ["algorithm.name=random_budget"],
    "heterofl": ["algorithm.name=heterofl"],
    "fjord": ["algorithm.name=fjord"],
    "uniform": ["algorithm.name=uniform"],
    "fedavg": ["algorithm.name=fedavg"],
    "fedprox": ["algorithm.name=fedprox", "algorithm.mu=1.0"],
    "scaffold": ["algorithm.name=scaffold"],
}


def test_the_confound_variants_are_the_rows_the_registered_methods_declare_paper_rows_first_unchanged():
    from conftest import load_study
    from fedsap_ray.algorithms import registry
    from fedsap_ray.algorithms.fedrolex import FedRolex

    study = load_study("capacity_confound")
    rows = study.variants()
    assert list(rows)[:len(PAPER_ROWS)] == list(PAPER_ROWS)
    assert {k: sorted(rows[k]) for k in PAPER_ROWS} == {k: sorted(v) for k, v in PAPER_ROWS.items()}
    assert rows["fedrolex"] == ["algorithm.name=fedrolex"]

    @registry.register("rolex_later")  # a sub-model method added later joins by its declaration alone
    class Later(FedRolex):
        confound_variants = {"rolex_later": ("algorithm.direction=forward",)}

    try:
        later = study.variants()
        assert later["rolex_later"] == ["algorithm.name=rolex_later", "algorithm.direction=forward"]
        assert list(later)[:len(rows)] == list(rows)  # after the rows already there
        assert len(later) == len(rows) + 1  # its own row, and FedRolex's once (read from each class body)
    finally:
        registry._REGISTRY.pop("rolex_later", None)
