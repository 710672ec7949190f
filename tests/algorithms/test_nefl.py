"""NeFL: depth-and-width nested sub-models at the width-only budget; skipped blocks are exact identities."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import (assert_finite_global_accuracy, assert_options_rejected, assert_same_tables, e2e_overrides,
                      federation_fixture, make_strategy, run_rounds, run_twice, tiny_overrides)
from fedsap_ray.algorithms.aggregation import scatter
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.experiment import build_context
from fedsap_ray.models.masks import nested_channel_masks, param_mask, params_in_mask, trainable_mask
from fedsap_ray.models import build_model, model_macs

TINY = tiny_overrides("nefl", "model.name=resnet18", "data.num_clients=6")
# ResNet18 at width 1/16: streams of 4/8/16/32 channels; 6 clients with capacities 1, .8, .6, .4, .2, 1
ALL_FIVE = ("layer4.1", "layer3.1", "layer2.1", "layer1.1", "layer1.0")

fed = federation_fixture(TINY)


def _cfg(*extra: str):
    return build_config(preset="smoke", overrides=[*TINY, *extra])


def _branch(ctx, block: str) -> np.ndarray:
    out = np.zeros(ctx.layout.size, dtype=bool)
    for name in ctx.layout.names:
        if name.startswith(f"{block}."):
            ctx.layout.slice(name, out)[...] = True
    return out


def test_skippable_blocks_come_from_the_module_structure(fed):
    _, s18 = make_strategy(_cfg(), fed)
    assert [b.name for b in s18.skippable()] == ["layer1.0", "layer1.1", "layer2.1", "layer3.1", "layer4.1"]
    assert s18.skippable()[-1].inner == "layer4.1.conv1"
    _, s10 = make_strategy(_cfg("model.name=resnet10"), fed)
    assert [b.name for b in s10.skippable()] == ["layer1.0"]
    _, cnn = make_strategy(_cfg("model.name=cnn_small"), fed)
    assert cnn.skippable() == ()


def test_depth_scaled_masks_skip_the_deepest_blocks_within_the_budget(fed):
    """ResNet18 at width 1/16. Removing layer4.1 / layer3.1 / layer2.1 leaves 58.4% / 47.9% / 45.3% of the
    trainable parameters. kappa = .5: budget gamma = 0.256, sqrt = 0.506 -> skip layer4.1 only; kappa = .2:
    gamma = 0.057 -> every identity block; kappa = .8: gamma = 0.68, sqrt = 0.82 -> width only."""
    ctx, s = make_strategy(_cfg("algorithm.depth=true"), fed)
    full = {layer.name: layer.channels for layer in ctx.space.layers}
    total = s.trainable_count(full, ())
    assert s.trainable_count(full, ("layer4.1",)) / total == pytest.approx(0.584, abs=1e-3)
    assert s.trainable_count(full, ("layer4.1", "layer3.1")) / total == pytest.approx(0.479, abs=1e-3)
    assert s.budget(0.5) / total == pytest.approx(0.256, abs=1e-3)
    trainable = trainable_mask(ctx.layout, ctx.model)
    for kappa, skip in ((0.5, ("layer4.1",)), (0.2, ALL_FIVE), (0.8, ())):
        got_skip, p = s.scaling(kappa)
        assert got_skip == skip
        cm = s.nefl_masks(kappa)
        mask = s.coverage(cm)
        n, budget = params_in_mask(ctx.layout, mask), s.budget(kappa)
        assert n == s.trainable_count(s._nested_counts(p), skip) <= budget
        width_only = param_mask(ctx.space, ctx.layout, nested_channel_masks(ctx.space, kappa))
        assert budget == params_in_mask(ctx.layout, width_only)
        for blk in s.skippable():
            branch = _branch(ctx, blk.name)
            if blk.name in skip:
                assert not mask[branch].any() and not cm[blk.inner].any()
            else:
                assert mask[branch & trainable].any()
        if skip:  # the widest width under the budget: the next wider nested width goes over it
            assert p > kappa
            wider = min(k / la.channels for la in ctx.space.layers for k in range(1, la.channels + 1)
                        if k / la.channels > p + 1e-12)
            assert s.trainable_count(s._nested_counts(wider), skip) > budget
        else:  # width-only: exactly the nested sub-model
            np.testing.assert_array_equal(mask, param_mask(ctx.space, ctx.layout, nested_channel_masks(ctx.space, kappa)))
        # MACs of the sub-model: model_macs of its channel masks (an empty inner layer drops conv1 and conv2)
        assert s.compute.mask_macs(mask) == model_macs(ctx.model, fed.input_shape, cm)
    # depth_share = 0 is width-only nesting (NeFL-W)
    _, w = make_strategy(_cfg("algorithm.depth=true", "algorithm.depth_share=0"), fed)
    assert w.scaling(0.2) == ((), 0.2)


def test_default_is_width_only_and_depth_is_an_option(fed):
    """Issue 13: by default every client runs the nested width-only sub-model at kappa (DapperFL's NeFL setting,
    never a skipped block); depth=true restores the NeFL-WD rule, which skips all five blocks at kappa 0.2."""
    ctx, s = make_strategy(_cfg(), fed)
    _, d = make_strategy(_cfg("algorithm.depth=true"), fed)
    state = s.init_state()
    for cid in range(len(fed.clients)):
        kappa = float(fed.clients[cid].capacity)
        want = None if kappa >= 1 else param_mask(ctx.space, ctx.layout, nested_channel_masks(ctx.space, kappa))
        got = s.client_mask(state, cid, 1)
        assert (got is None and want is None) or np.array_equal(got, want)
        assert s.scaling(kappa)[0] == ()
    assert d.scaling(0.2)[0] == ALL_FIVE
    assert not np.array_equal(s.coverage(s.nefl_masks(0.2)), d.coverage(d.nefl_masks(0.2)))


def test_non_resnet_models_fall_back_to_width_only(fed):
    ctx, s = make_strategy(_cfg("model.name=cnn_small"), fed)
    state = s.init_state()
    cm = s.channel_masks(state, 3, 1)
    np.testing.assert_array_equal(s.client_mask(state, 3, 1),
                                  param_mask(ctx.space, ctx.layout, nested_channel_masks(ctx.space, 0.4)))
    assert all(np.array_equal(cm[k], v) for k, v in nested_channel_masks(ctx.space, 0.4).items())


@pytest.mark.parametrize("train", [True, False])
def test_a_skipped_block_is_an_exact_identity(fed, train):  # (depth=true)
    """The client's model holds the server's values on the covered coordinates and 0 elsewhere: every skipped
    block then maps any post-ReLU input to itself bit for bit, in train mode (batch statistics) and eval mode.
    With the same values and no mask the blocks are not the identity."""
    ctx, s = make_strategy(_cfg("algorithm.depth=true"), fed)
    mask = s.coverage(s.nefl_masks(0.2))
    rng = np.random.default_rng(0)
    params = ctx.layout.flatten(ctx.model) + rng.normal(0, 0.5, ctx.layout.size).astype(np.float32)
    buffers = ~ctx.layout.param_coords()
    params[buffers] = np.abs(params[buffers]) + 0.1  # valid running statistics, no accidental zeros
    masked = build_model("resnet18", num_classes=fed.num_classes, input_shape=fed.input_shape, width_mult=0.0625)
    unmasked = build_model("resnet18", num_classes=fed.num_classes, input_shape=fed.input_shape, width_mult=0.0625)
    ctx.layout.load_into(masked, scatter(params[mask], mask, ctx.layout.size))
    ctx.layout.load_into(unmasked, params)
    masked.train(train)
    unmasked.train(train)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for blk in s.skippable():
            c_in = masked.get_submodule(blk.name).conv1.in_channels
            x = torch.relu(torch.randn(4, c_in, 8, 8, generator=gen))
            assert torch.equal(masked.get_submodule(blk.name)(x), x), blk.name
            assert not torch.equal(unmasked.get_submodule(blk.name)(x), x), blk.name


def test_skipped_branches_stay_bit_identical_after_a_round(fed):
    """Every client at kappa = 0.2 skips all five identity blocks: their branches (parameters and BN statistics)
    come back bit-identical, the rest of the covered model trains."""
    cfg = _cfg("algorithm.depth=true", "data.num_clients=4", "capacity.scheme=explicit", "capacity.keep_ratios=[0.2, 0.2, 0.2, 0.2]",
               "training.rounds=1")
    ctx, s, states = run_rounds(cfg, build_federation(cfg), 1)
    assert s.scaling(0.2)[0] == ALL_FIVE
    skipped = np.zeros(ctx.layout.size, dtype=bool)
    for blk in ALL_FIVE:
        skipped |= _branch(ctx, blk)
    assert states[1].params[skipped].tobytes() == states[0].params[skipped].tobytes()
    covered = s.client_mask(states[0], 0, 1) & trainable_mask(ctx.layout, ctx.model)
    assert not (covered & skipped).any()
    assert (states[1].params[covered] != states[0].params[covered]).mean() > 0.9


def test_depth_share_is_validated():
    assert_options_rejected(TINY, "algorithm.depth_share=1.5", "algorithm.depth=2")


def test_runs_finish_and_are_deterministic(tmp_path, fed):
    # five clients: one of each smoke capacity
    e2e = e2e_overrides("nefl", "model.name=resnet18", "algorithm.depth=true", "data.num_clients=5")
    cfg = build_config(preset="smoke", overrides=e2e)
    f = build_federation(cfg)
    a, b = run_twice(e2e, tmp_path, f)
    assert_finite_global_accuracy(a, 2)
    cl = a.clients
    assert cl["macs_per_sample"].gt(0).all()
    ctx = build_context(cfg, f)
    small = cl[np.isclose(cl["capacity_max"], 0.2)]  # skips every identity block: fewer MACs than width-only at 0.2
    width_only = model_macs(ctx.model, f.input_shape, nested_channel_masks(ctx.space, 0.2))
    assert len(small) and (small["macs_per_sample"] < width_only).all()
    assert_same_tables(a, b)
