"""FedMP: server-side largest-L1 filter pruning at the capacity, R2SP aggregation, runs."""
from __future__ import annotations

import numpy as np

from conftest import (aggregate, assert_finite_global_accuracy, assert_options_rejected, assert_same_tables, e2e_overrides,
                      federation_fixture, make_strategy, run_rounds_with_plans, run_twice, tiny_overrides)
from fedsap_ray.algorithms.aggregation import masked_weighted_average
from fedsap_ray.algorithms.pruning import l1_channel_masks
from fedsap_ray.config import build_config
from fedsap_ray.models.masks import nested_count, param_mask
from fedsap_ray.common.messages import ClientResult, ServerState

TINY = tiny_overrides("fedmp", "data.num_clients=6")
# 6 clients with capacities 1, .8, .6, .4, .2, 1 (smoke's cyclic capacities)

fed = federation_fixture(TINY)


def _cfg(*extra: str):
    return build_config(preset="smoke", overrides=[*TINY, *extra])


def _hand_built(ctx, ranks: dict[str, np.ndarray]) -> np.ndarray:
    """Every filter of channel c of layer l is the constant ranks[l][c] (so its L1 norm is proportional to it);
    BN scales get the opposite order and are large, so using them would pick the other channels."""
    params = np.zeros(ctx.layout.size, dtype=np.float32)
    for layer in ctx.space.layers:
        v = ranks[layer.name].astype(np.float32)
        for ax in layer.out:
            if not ax.name.endswith("weight"):
                continue
            w = ctx.layout.slice(ax.name, params)  # a view: writes go into params
            moved = np.moveaxis(w, ax.axis, 0)
            fill = v if w.ndim > 1 else 1000.0 - v  # conv filter or BN scale
            moved[...] = fill.reshape(-1, *([1] * (w.ndim - 1)))
    return params


def _top(v: np.ndarray, kappa: float) -> np.ndarray:
    m = np.zeros(v.size, dtype=bool)
    m[np.argsort(-v)[:nested_count(kappa, v.size)]] = True
    return m


def test_kept_channels_are_the_largest_l1_filters_and_follow_the_global_model(fed):
    ctx, s = make_strategy(_cfg(), fed)
    rng = np.random.default_rng(3)
    ranks = {layer.name: rng.permutation(layer.channels) + 1.0 for layer in ctx.space.layers}
    state = ServerState(round=0, params=_hand_built(ctx, ranks))
    assert s.channel_masks(state, 0, 1) is None  # kappa = 1: the full model
    for cid in (1, 2, 3, 4):
        kappa = fed.clients[cid].capacity
        got = s.channel_masks(state, cid, 1)
        for layer in ctx.space.layers:
            np.testing.assert_array_equal(got[layer.name], _top(ranks[layer.name], kappa), err_msg=layer.name)
        np.testing.assert_array_equal(s.client_mask(state, cid, 1), param_mask(ctx.space, ctx.layout, got))
    # the global model changes: the order of the filter norms reverses, and the masks follow it
    flipped = {k: v.max() + 1.0 - v for k, v in ranks.items()}
    moved = ServerState(round=1, params=_hand_built(ctx, flipped))
    for cid in (2, 4):
        got = s.channel_masks(moved, cid, 2)
        for layer in ctx.space.layers:
            np.testing.assert_array_equal(got[layer.name], _top(flipped[layer.name], fed.clients[cid].capacity))
    assert any(not np.array_equal(s.channel_masks(state, 4, 1)[la.name], s.channel_masks(moved, 4, 2)[la.name])
               for la in ctx.space.layers)


def test_r2sp_recovers_pruned_models_with_the_residual_before_averaging(fed):
    """Two clients (kappa .8 and .2, 30 and 10 samples): every coordinate is the sample-weighted mean over BOTH,
    a client that pruned it contributing the old global value; ``aggregation=coordinate`` averages only
    over the clients that trained it."""
    ctx, s = make_strategy(_cfg(), fed)
    state = s.init_state()
    rng = np.random.default_rng(0)
    res, full = [], []
    for cid, n in ((1, 30.0), (4, 10.0)):
        mask = s.client_mask(state, cid, 1)
        vals = (state.params[mask] + rng.normal(0, 0.1, int(mask.sum()))).astype(np.float32)
        res.append(ClientResult(client_id=cid, round=1, values=vals, n_samples=int(n), train_loss=1.0, mask=mask))
        x = state.params.astype(np.float64).copy()
        x[mask] = vals
        full.append((n, x, mask))
    want = sum(n * x for n, x, _ in full) / 40.0
    got = aggregate(s, state, res, 1).state.params
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    only_big = full[0][2] & ~full[1][2]  # trained by client 1 only: 3/4 of its value, 1/4 the old one
    assert only_big.sum() > 0
    np.testing.assert_allclose(got[only_big], 0.75 * full[0][1][only_big] + 0.25 * state.params[only_big], rtol=1e-6)
    _, coord = make_strategy(_cfg("algorithm.aggregation=coordinate"), fed)
    want_c = masked_weighted_average(state.params, [(m, r.values, float(r.n_samples)) for r, (_, _, m) in zip(res, full)])
    np.testing.assert_array_equal(aggregate(coord, state, res, 1).state.params, want_c)
    assert not np.allclose(want_c[only_big], got[only_big])


def test_round_masks_are_the_l1_masks_of_the_state_the_round_starts_from(fed):
    """In a real run the round-2 plans prune the model round 1 produced (the hand-built test above shows
    that a changed ranking changes the masks)."""
    cfg = _cfg("training.rounds=2")
    ctx, _, states, (_, plans), _ = run_rounds_with_plans(cfg, fed, 2)
    for cid in (1, 2, 3, 4):
        want = l1_channel_masks(ctx.space, ctx.layout, states[1].params, fed.clients[cid].capacity)
        np.testing.assert_array_equal(plans[cid].mask, param_mask(ctx.space, ctx.layout, want))
    assert plans[0].mask is None and plans[5].mask is None


def test_aggregation_is_validated():
    assert_options_rejected(TINY, "algorithm.aggregation=mean")


def test_runs_finish_and_are_deterministic(tmp_path, fed):
    a, b = run_twice(e2e_overrides("fedmp", "data.num_clients=5"), tmp_path)  # five clients: one of each smoke capacity
    assert_finite_global_accuracy(a, 2)
    assert a.clients["macs_per_sample"].gt(0).all()
    assert_same_tables(a, b)
