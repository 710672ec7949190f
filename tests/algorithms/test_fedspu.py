"""FedSPU (Niu, Dong, Qin, AAAI 2025): random frozen neurons that never move, personalised models,
aggregation of trained coordinates only, and end-to-end runs with a 'personal' eval mode."""
from __future__ import annotations

import copy
import math

import numpy as np

from conftest import (aggregate, assert_same_tables, federation_fixture, global_rows, make_strategy, run_rounds_with_plans,
                      run_twice, tiny_overrides)
from fedsap_ray.algorithms.fedspu import FrozenNeurons
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.models.masks import param_mask

TINY = tiny_overrides("fedspu", "data.num_clients=4", "training.rounds=2", "capacity.scheme=explicit",
                      "capacity.keep_ratios=[0.5, 0.5, 0.25, 0.75]")

tiny_fed = federation_fixture(TINY, "tiny_fed")


def _cfg(*extra: str):
    return build_config(preset="smoke", overrides=[*TINY, *extra])


def test_masks_keep_ceil_kappa_channels_per_layer_and_change_across_rounds(tiny_fed):
    ctx, strat = make_strategy(_cfg(), tiny_fed)
    for cid, spec in enumerate(tiny_fed.clients):
        m1, m1b, m2 = strat.channel_masks(1, cid), strat.channel_masks(1, cid), strat.channel_masks(2, cid)
        for layer in ctx.space.layers:
            want = max(1, math.ceil(round(spec.capacity * layer.channels, 9)))
            assert int(m1[layer.name].sum()) == int(m2[layer.name].sum()) == want
            np.testing.assert_array_equal(m1[layer.name], m1b[layer.name])  # pure in (seed, round, client)
        assert any(not np.array_equal(m1[n], m2[n]) for n in m1)  # a new random draw every round
        mask, active = strat.trained_mask(1, cid)
        np.testing.assert_array_equal(mask, param_mask(ctx.space, ctx.layout, m1))
        assert active == sum(int(v.sum()) for v in m1.values())
    assert any(not np.array_equal(strat.channel_masks(1, 0)[n], strat.channel_masks(1, 1)[n])
               for n in strat.channel_masks(1, 0))  # clients of equal kappa draw different neurons
    state = strat.init_state()
    plan = strat.configure_round(state, 1)[2]
    counts = strat.client_columns(state, plan, None)  # the clients row: trained channels shared, frozen private
    assert counts["n_global"] == strat.trained_mask(1, 2)[1]
    assert counts["n_private"] == ctx.space.total_channels - counts["n_global"] and counts["n_dropped"] == 0


def _output_channel_active(ctx, cm) -> np.ndarray:
    """bool over the layout: the coordinate's output channel (if it has one) is active."""
    out = np.ones(ctx.layout.size, dtype=bool)
    for layer in ctx.space.layers:
        for ax in layer.out:
            view = ctx.layout.slice(ax.name, out)  # a view: writes go through
            shape = [1] * view.ndim
            shape[ax.axis] = -1
            view &= ax.expand(cm[layer.name]).reshape(shape)
    return out


def test_frozen_neurons_stay_bit_identical_under_momentum_and_weight_decay(tiny_fed, monkeypatch):
    """Client 2 (kappa 0.25) starts from its personal model with the trained coordinates set to the global
    ones; after local SGD with momentum 0.9 and weight decay every frozen coordinate (including input
    connections of active output channels and BN statistics) equals its personal value bit for bit, while
    the trained parameters moved; the server rebuilds exactly the client's final model as its new personal
    model. Without the restore step weight decay and momentum move the frozen coordinates."""
    cfg = _cfg("training.momentum=0.9", "training.weight_decay=0.01")
    ctx, strat = make_strategy(cfg, tiny_fed)
    state = strat.init_state()
    rng = np.random.default_rng(0)
    pc = ctx.layout.param_coords()
    personal = state.params.copy()
    personal[pc] += (0.05 * rng.standard_normal(int(pc.sum()))).astype(np.float32)
    state.params = state.params.copy()
    state.params[pc] += (0.05 * rng.standard_normal(int(pc.sum()))).astype(np.float32)  # a "global" != personal
    state.strategy_state["personal"][2] = personal
    plan = strat.configure_round(state, 1)[2]
    assert plan.momentum == 0.9 and plan.weight_decay == 0.01
    mask = plan.mask
    frozen = ~mask
    assert frozen.sum() > 0 and (frozen & ~pc).sum() > 0  # frozen BN statistics too
    # frozen input connections of active output channels exist (a weight needs BOTH channels active)
    assert (_output_channel_active(ctx, strat.channel_masks(1, 2)) & frozen & pc).sum() > 0
    data = tiny_fed.client_data(2)

    scratch = copy.deepcopy(ctx.model)
    res = train_client(plan, scratch, ctx.layout, data)
    final = ctx.layout.flatten(scratch)
    assert final[frozen].tobytes() == personal[frozen].tobytes()
    trained = mask & pc
    assert (final[trained] != state.params[trained]).mean() > 0.9
    np.testing.assert_array_equal(res.values, final[mask])
    new = aggregate(strat, state, [res], 1).state
    assert new.strategy_state["personal"][2].tobytes() == final.tobytes()

    monkeypatch.setattr(FrozenNeurons, "after_step", lambda self, model: None)
    scratch = copy.deepcopy(ctx.model)
    train_client(plan, scratch, ctx.layout, data)
    moved = ctx.layout.flatten(scratch)[frozen & pc] != personal[frozen & pc]
    assert moved.mean() > 0.5


def test_global_model_changes_only_where_some_client_trained(tiny_fed):
    """Round by round with half of the clients sampled: coordinates outside the union of the sampled
    clients' trained masks keep the previous global value bit for bit; inside it they move."""
    cfg = _cfg("training.participation=0.5", "training.rounds=3")
    ctx, strat, states, round_plans, _ = run_rounds_with_plans(cfg, tiny_fed, 3)
    pc = ctx.layout.param_coords()
    seen: set[int] = set()
    for t in (1, 2, 3):
        state, plans, new = states[t - 1], round_plans[t - 1], states[t]
        assert len(plans) == 2
        union = np.zeros(ctx.layout.size, dtype=bool)
        for cid, p in plans.items():
            union |= p.mask
            if cid not in seen:  # never trained: frozen part of its start is w^0
                np.testing.assert_array_equal(p.payload("fedspu").frozen_values, state.strategy_state["init"][~p.mask])
        assert not union.all()
        assert new.params[~union].tobytes() == state.params[~union].tobytes()
        assert (new.params[union & pc] != state.params[union & pc]).mean() > 0.9
        assert set(new.strategy_state["personal"]) == seen | set(plans)
        seen |= set(plans)
    state = states[-1]
    # 'personal' evaluation: each domain's largest client's personal model, the global model if unseen
    domains = tiny_fed.eval_domains()  # evaluation-only ground truth
    sets = strat.eval_sets(state, domains)
    assert list(sets) == ["global", "personal"]
    for d, vec in sets["personal"].items():
        members = [c for c in tiny_fed.clients if c.domain == d]
        cid = min(members, key=lambda c: (-c.n_samples, c.client_id)).client_id
        assert strat.domain_representative(domains.members[d]) == cid
        want = state.strategy_state["personal"].get(cid, state.params)
        assert vec is want


def test_run_finishes_and_is_deterministic(tmp_path, tiny_fed):
    a, b = run_twice(TINY, tmp_path, tiny_fed)
    g = global_rows(a)
    assert set(g["eval_mode"]) == {"global", "personal"} and len(g) == 4
    assert np.isfinite(g["accuracy"].to_numpy(dtype=float)).all()
    c = a.clients[a.clients["round"] == 1].set_index("client_id")
    assert c.loc[2, "params_trained"] < c.loc[3, "params_trained"]  # kappa 0.25 trains fewer than 0.75
    assert c.loc[2, "bytes_up"] < c.loc[3, "bytes_up"]
    assert (c["n_dropped"] == 0).all() and (c["macs_per_sample"] == c["macs_per_sample"].iloc[0]).all()
    assert_same_tables(a, b)
