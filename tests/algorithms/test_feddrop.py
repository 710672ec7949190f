"""FedDrop: random channel subsets at the capacity, coordinate-wise aggregation, AFD's score map, runs."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import (aggregate, assert_finite_global_accuracy, assert_options_rejected, assert_same_tables, e2e_overrides,
                      federation_fixture, make_strategy, run_rounds_with_plans, run_twice, tiny_overrides)
from fedsap_ray.algorithms import parse_options
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.models.masks import nested_count, trainable_mask
from fedsap_ray.common.messages import ClientResult
from fedsap_ray.models import model_macs
from fedsap_ray.common.seeding import rng_for

TINY = tiny_overrides("feddrop", "data.num_clients=6")
# 6 clients with capacities 1, .8, .6, .4, .2, 1 (smoke's cyclic capacities)

fed = federation_fixture(TINY)


def _cfg(*extra: str):
    return build_config(preset="smoke", overrides=[*TINY, *extra])


def _flat(cm, space) -> np.ndarray:
    return np.concatenate([np.asarray(cm[layer.name]) for layer in space.layers])


def test_masks_keep_the_ratio_change_every_round_and_are_seeded(fed):
    ctx, s = make_strategy(_cfg(), fed)
    state = s.init_state()
    assert s.channel_masks(state, 0, 1) is None  # kappa = 1: the full model
    for cid in (1, 2, 3, 4):
        kappa = fed.clients[cid].capacity
        m1, m2 = s.channel_masks(state, cid, 1), s.channel_masks(state, cid, 2)
        for layer in ctx.space.layers:
            assert m1[layer.name].dtype == bool
            assert int(m1[layer.name].sum()) == int(m2[layer.name].sum()) == nested_count(kappa, layer.channels)
        assert not np.array_equal(_flat(m1, ctx.space), _flat(m2, ctx.space))  # redrawn every round
        # not the nested (leading-channel) sub-model
        assert any(not m1[layer.name][:int(m1[layer.name].sum())].all() for layer in ctx.space.layers)
    # the same seed gives the same masks from a fresh strategy; another seed does not
    _, again = make_strategy(_cfg(), fed)
    _, other = make_strategy(_cfg("seed=7"), fed)
    for cid in (1, 4):
        a = _flat(s.channel_masks(state, cid, 3), ctx.space)
        assert np.array_equal(a, _flat(again.channel_masks(again.init_state(), cid, 3), ctx.space))
        assert not np.array_equal(a, _flat(other.channel_masks(other.init_state(), cid, 3), ctx.space))


def test_coordinates_outside_every_mask_stay_bit_identical(fed):
    """Four clients at kappa = 0.25: what no client's random subset covered keeps its value bit for bit,
    and the plans' masks are the ones aggregation recomputes."""
    cfg = _cfg("data.num_clients=4", "capacity.scheme=explicit", "capacity.keep_ratios=[0.25, 0.25, 0.25, 0.25]",
               "training.rounds=1")
    f = build_federation(cfg)
    ctx, s, states, (plans,), _ = run_rounds_with_plans(cfg, f, 1)
    assert set(plans) == {0, 1, 2, 3}
    union = np.zeros(ctx.layout.size, dtype=bool)
    for cid, plan in plans.items():
        assert np.array_equal(plan.mask, s.client_mask(states[0], cid, 1))
        active = sum(int(m.sum()) for m in s.channel_masks(states[0], cid, 1).values())
        assert s.client_columns(states[0], plan, None) == {"n_global": active, "n_private": 0,
                                                            "n_dropped": ctx.space.total_channels - active}
        assert plan.capacity_used == pytest.approx(active / ctx.space.total_channels)
        union |= plan.mask
    outside, trainable = ~union, trainable_mask(ctx.layout, ctx.model)
    assert (outside & trainable).sum() > 0
    assert states[1].params[outside].tobytes() == states[0].params[outside].tobytes()
    assert (states[1].params[union & trainable] != states[0].params[union & trainable]).mean() > 0.9


def test_mask_macs_equal_model_macs_of_the_channel_masks(fed):
    ctx, s = make_strategy(_cfg(), fed)
    state = s.init_state()
    for cid in (1, 4):
        cm = s.channel_masks(state, cid, 1)
        want = model_macs(ctx.model, fed.input_shape, cm)
        assert s.compute.mask_macs(s.coverage(cm)) == want
        assert 0 < want < s.compute.mask_macs(None)


def test_afd_score_map_keeps_improving_submodels_and_weights_the_next_draw(fed):
    """selection=afd, driven by hand-set losses for client 3 (kappa 0.4): no previous loss -> redraw;
    loss 2 -> 1 -> scores 0.5 on the kept channels and the same sub-model again; loss rises -> redraw
    with weights 1 + score."""
    ctx, s = make_strategy(_cfg("algorithm.selection=afd"), fed)
    state = s.init_state()
    space = ctx.space

    def step(state, t, loss):
        mask = s.client_mask(state, 3, t)
        r = ClientResult(client_id=3, round=t, values=state.params[mask].copy(), n_samples=10, train_loss=loss, mask=mask)
        return aggregate(s, state, [r], t).state, _flat(s.channel_masks(state, 3, t), space)

    s1, m1 = step(state, 1, 2.0)
    assert not s1.strategy_state["afd"]["reuse"][3] and 3 not in s1.strategy_state["afd"]["score"]
    s2, m2 = step(s1, 2, 1.0)
    assert not np.array_equal(m1, m2)  # round 1 gave no improvement: a fresh draw
    score = s2.strategy_state["afd"]["score"][3]
    np.testing.assert_allclose(score, np.where(m2, 0.5, 0.0))  # (l_prev - l) / l_prev on the kept channels
    s3, m3 = step(s2, 3, 1.5)
    assert np.array_equal(m3, m2)  # improved: the same sub-model is kept
    assert not s3.strategy_state["afd"]["reuse"][3] and np.array_equal(s3.strategy_state["afd"]["score"][3], score)
    m4 = _flat(s.channel_masks(s3, 3, 4), space)
    assert np.array_equal(m4, _flat(s._weighted_draw(score, 0.4, rng_for(s.cfg.seed, 4, 3, "feddrop")), space))
    for layer_start, layer in zip(np.cumsum([0] + [la.channels for la in space.layers]), space.layers):
        assert m4[layer_start:layer_start + layer.channels].sum() == nested_count(0.4, layer.channels)
    # weighted draws favour scored channels: over many draws they are kept more often
    rng = np.random.default_rng(0)
    freq = np.mean([_flat(s._weighted_draw(score, 0.4, rng), space) for _ in range(300)], axis=0)
    assert freq[score > 0].mean() > freq[score == 0].mean()


def test_selection_is_validated():
    assert_options_rejected(TINY, "algorithm.selection=best")


def test_runs_finish_and_are_deterministic(tmp_path, fed):
    a, b = run_twice(e2e_overrides("feddrop", "data.num_clients=5"), tmp_path)  # five clients: one of each smoke capacity
    assert_finite_global_accuracy(a, 2)
    cl = a.clients
    assert cl["macs_per_sample"].gt(0).all()
    low = cl[cl["capacity_max"] < 1]
    assert (low["capacity_used"] < 1).all() and (low["n_dropped"] > 0).all()
    assert_same_tables(a, b)


def test_the_row_is_labelled_for_what_it_runs():
    """Issue 13: papers/000's "FedDrop" row is AFD; ours runs plain FD by default, and the analysis says so."""
    from analysis.comparison import method_of

    assert parse_options("feddrop", {}).selection == "random"
    assert method_of({"algorithm": {"name": "feddrop", "options": {}}}) == "FedDrop (FD)"
    assert method_of({"algorithm": {"name": "feddrop", "options": {"selection": "afd"}}}) == "FedDrop (AFD)"
