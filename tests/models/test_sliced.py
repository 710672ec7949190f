"""Sliced sub-model training (issue 17; fedsap_ray/models/sliced.py, fedsap_ray/engine/client.py): the dense smaller network
a client trains by default agrees with the masked full-size reference to float rounding, on every strategy,
really is smaller, and masks no channel set describes (or plans with a hook that does not declare
``supports_sliced``) fall back to masked training bit for bit."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from conftest import federation_fixture, make_strategy, run_rounds_with_plans, tiny_overrides
from fedsap_ray import algorithms
from fedsap_ray.algorithms.fedprox import ProximalTerm
from fedsap_ray.algorithms.fedsap.hooks import ChannelStatsHook
from fedsap_ray.algorithms.hooks import (ClientHook, NoPayload, call, register_hook, supports_sliced,
                                         unregister_hook)
from fedsap_ray.algorithms.representation import RepresentationNorm
from fedsap_ray.algorithms.scaffold import ControlCorrection
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import ConfigError, build_config
from fedsap_ray.data.base import DomainData
from fedsap_ray.models.masks import ParamLayout, covering_channel_masks, param_mask, params_in_mask, trainable_mask
from fedsap_ray.common.messages import ClientPlan, HookCall
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.models import build_model, model_macs
from fedsap_ray.models.sliced import sliced_model

# Sliced and masked sum in different orders (smaller convolutions, no zero channels), so they agree to
# float rounding: relative L2 difference of a client's uploaded values (and of its statistics, which are
# means of small gradients) below these.
VALUES_RTOL = 1e-5
STATS_RTOL = 1e-4
# Some tiny clients are chaotic: their MASKED training alone jumps by ~1e-3 relative when its input moves by
# 1e-6 (a discrete flip, e.g. a ReLU kink at a sub-model of one or two channels; seen on FjORD and FedProx
# width=capacity at seed 0). For those the bar is the masked path's own
# sensitivity to input noise of a few ulps, times this factor (a real bug differs by O(1)).
CHAOS_FACTOR = 10.0

# options that give the full-model baselines sub-models to slice
EXTRA = {"fedavg": ["algorithm.width=capacity"], "fedprox": ["algorithm.width=capacity"]}

# five clients, one of each capacity of the smoke preset's cyclic capacities (1, 0.8, 0.6, 0.4, 0.2): every
# strategy still plans the same sub-model widths as with ten clients (each of which repeated a ratio); two local steps
# (the second with the first's momentum) instead of three: a quarter of the time of ten clients and three steps
FIVE = "data.num_clients=5", "training.max_steps_per_epoch=2"
fed = federation_fixture(tiny_overrides("fedavg", *FIVE))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))


def sensitivity(plan: ClientPlan, model, layout, data) -> tuple[float, dict[str, float]]:
    """Largest relative change of the masked result when the plan's values move by 1e-6 relative (a few float32
    ulps; three seeded draws): of the uploaded values, and of each statistic on its own (a statistic of a
    chaotic client can move more than its values do: FedSAP-fixed's ``dga_gradient`` moved ~10x its values'
    change on an AMD EPYC host, where the values' bar alone failed it)."""
    ref = train_client(dataclasses.replace(plan, submodel="masked"), copy.deepcopy(model), layout, data)
    worst, worst_stats = 0.0, dict.fromkeys(ref.stats, 0.0)
    for seed in range(3):
        noise = np.random.default_rng(seed).standard_normal(plan.params.shape)
        moved = dataclasses.replace(plan, submodel="masked",
                                    params=(plan.params * (1 + 1e-6 * noise)).astype(np.float32))
        out = train_client(moved, copy.deepcopy(model), layout, data)
        worst = max(worst, rel(ref.values, out.values))
        for k in ref.stats:
            worst_stats[k] = max(worst_stats[k], rel(ref.stats[k], out.stats[k]))
    return worst, worst_stats


@pytest.mark.parametrize("name", algorithms.names())
def test_sliced_matches_masked_on_every_strategy(name, fed):
    """Two masked rounds; every plan replayed sliced on one scratch model (its caches in use): same values and
    statistics to float tolerance, same steps and samples. Plans with a hook that does not support sliced
    models (or a mask no channel set describes) fall back to masked training and give the masked result bit
    for bit. Round 1 end to end: the
    results of a sliced run (its own backend and scratch models) equal the replayed sliced results bit for bit.
    A plan's first round is the same in both modes, so this also checks the option reaches the client."""
    masked_cfg = build_config(preset="smoke", overrides=tiny_overrides(name, *FIVE, "training.submodel=masked", *EXTRA.get(name, [])))
    ctx, _, states, plans, outs = run_rounds_with_plans(masked_cfg, fed, 2)
    scratch = copy.deepcopy(ctx.model)
    n_sliced = 0
    replayed: dict[int, np.ndarray] = {}
    for t in range(2):
        for ref in outs[t]:
            plan = plans[t][ref.client_id]
            assert plan.submodel == "masked"
            data = fed.client_data(plan.client_id)
            got = train_client(dataclasses.replace(plan, submodel="sliced"), scratch, ctx.layout, data)
            if t == 0:
                replayed[plan.client_id] = got.values
            assert (got.steps, got.samples_seen, got.n_samples) == (ref.steps, ref.samples_seen, ref.n_samples)
            assert sorted(got.stats) == sorted(ref.stats)
            sliced = plan.mask is not None and supports_sliced(plan)
            if not sliced or sliced_model(scratch, ctx.layout, plan.mask) is None:
                # full model, a hook that needs the full model, or no channel set: the masked loop itself
                np.testing.assert_array_equal(got.values, ref.values)
                for k in ref.stats:
                    np.testing.assert_array_equal(got.stats[k], ref.stats[k])
                continue
            n_sliced += 1
            err = rel(ref.values, got.values)
            bar, stat_bars = VALUES_RTOL, {}
            if err > bar:
                sens, stat_sens = sensitivity(plan, ctx.model, ctx.layout, data)
                bar = max(bar, CHAOS_FACTOR * sens)
                stat_bars = {k: CHAOS_FACTOR * v for k, v in stat_sens.items()}
            assert err <= bar, f"round {t + 1} client {plan.client_id}: sliced values differ by {err:.2e} (bar {bar:.2e})"
            assert abs(got.train_loss - ref.train_loss) <= 1e-4 * max(1.0, abs(ref.train_loss)) or bar > VALUES_RTOL
            for k in ref.stats:
                assert got.stats[k].shape == ref.stats[k].shape and got.stats[k].dtype == ref.stats[k].dtype, k
                if k in ("channel_activation", "channel_gradient"):
                    zero = np.asarray(ref.stats[k]) == 0  # inactive channels: exactly 0 in both
                    np.testing.assert_array_equal(np.asarray(got.stats[k])[zero], 0)
                stat_bar = max(STATS_RTOL, bar * 10, stat_bars.get(k, 0.0))  # a chaotic client: also its own sensitivity
                assert rel(ref.stats[k], got.stats[k]) <= stat_bar, (k, rel(ref.stats[k], got.stats[k]), stat_bar)
    has_masks = any(p.mask is not None and supports_sliced(p) for r in plans for p in r.values())
    assert (n_sliced > 0) == has_masks, f"{name}: {n_sliced} plans sliced"

    sliced_cfg = build_config(preset="smoke", overrides=tiny_overrides(name, *FIVE, *EXTRA.get(name, [])))
    assert sliced_cfg.training.submodel == "sliced"  # the default
    _, _, _, s_plans, s_outs = run_rounds_with_plans(sliced_cfg, fed, 1)
    assert all(p.submodel == "sliced" for p in s_plans[0].values())
    for r in s_outs[0]:
        np.testing.assert_array_equal(r.values, replayed[r.client_id])


def test_sliced_client_runs_the_smaller_network(fed):
    """A capacity < 1 HeteroFL client: the full-size scratch model never runs a forward pass; the cached
    sub-network runs one per step, holds exactly the covered parameters and costs fewer MACs."""
    cfg = build_config(preset="smoke", overrides=tiny_overrides("heterofl", *FIVE))
    ctx, strat = make_strategy(cfg, fed)
    plans = strat.configure_round(strat.init_state(), 1)
    plan = min((p for p in plans.values() if p.mask is not None), key=lambda p: int(p.mask.sum()))
    scratch = copy.deepcopy(ctx.model)
    sub = sliced_model(scratch, ctx.layout, plan.mask)
    assert sub is not None
    assert sub.index.size == int(plan.mask.sum())
    np.testing.assert_array_equal(sub.index, np.flatnonzero(plan.mask))  # ordered like the payload
    n_sub = sum(p.numel() for p in sub.model.parameters())
    assert n_sub == params_in_mask(ctx.layout, plan.mask) < sum(p.numel() for p in ctx.model.parameters())
    shape = fed.input_shape
    assert model_macs(sub.model, shape) == model_macs(ctx.model, shape, sub.channel_masks) < model_macs(ctx.model, shape)
    calls = {"full": 0, "sub": 0}
    h1 = scratch.register_forward_pre_hook(lambda *_: calls.__setitem__("full", calls["full"] + 1))
    h2 = sub.model.register_forward_pre_hook(lambda *_: calls.__setitem__("sub", calls["sub"] + 1))
    try:
        res = train_client(plan, scratch, ctx.layout, fed.client_data(plan.client_id))
    finally:
        h1.remove()
        h2.remove()
    assert calls == {"full": 0, "sub": res.steps}
    assert sliced_model(scratch, ctx.layout, plan.mask).model is sub.model  # cached, not rebuilt


def test_non_channel_mask_falls_back_to_masked(fed):
    """A mask no channel set describes (one covered weight entry taken away) trains masked: bit-identical to
    submodel=masked. So does NeFL's depth=true (skipped residual branches) where it skips one."""
    cfg = build_config(preset="smoke", overrides=tiny_overrides("heterofl", *FIVE))
    ctx, strat = make_strategy(cfg, fed)
    plan = next(p for p in strat.configure_round(strat.init_state(), 1).values() if p.mask is not None)
    mask = plan.mask.copy()
    mask[np.flatnonzero(mask)[3]] = False
    odd = dataclasses.replace(plan, mask=mask)
    assert sliced_model(copy.deepcopy(ctx.model), ctx.layout, mask) is None
    data = fed.client_data(plan.client_id)
    a = train_client(odd, copy.deepcopy(ctx.model), ctx.layout, data)
    b = train_client(dataclasses.replace(odd, submodel="masked"), copy.deepcopy(ctx.model), ctx.layout, data)
    np.testing.assert_array_equal(a.values, b.values)

    cfg = build_config(preset="smoke", overrides=tiny_overrides("nefl", *FIVE, "algorithm.depth=true"))
    ctx, strat = make_strategy(cfg, fed)
    plans = strat.configure_round(strat.init_state(), 1)
    skipped = [p for p in plans.values() if p.mask is not None and sliced_model(copy.deepcopy(ctx.model), ctx.layout, p.mask) is None]
    if not skipped:
        pytest.skip("no NeFL depth=true client skips a block in the tiny config")
    p = skipped[0]
    a = train_client(p, copy.deepcopy(ctx.model), ctx.layout, fed.client_data(p.client_id))
    b = train_client(dataclasses.replace(p, submodel="masked"), copy.deepcopy(ctx.model), ctx.layout, fed.client_data(p.client_id))
    np.testing.assert_array_equal(a.values, b.values)


MODELS = {"cnn_small": ((3, 8, 8), None), "cnn_cifar": ((3, 32, 32), None), "mlp": ((12,), None),
          "char_lstm": ((6,), 11), "resnet10": ((3, 16, 16), None)}


def _model(name: str, seed: int = 0):
    shape, vocab = MODELS[name]
    torch.manual_seed(seed)
    m = build_model(name, num_classes=4, input_shape=shape, width_mult=0.125, vocab_size=vocab)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (20, *shape), generator=g) if vocab else torch.randn(20, *shape, generator=g)
    return m, ParamLayout.from_model(m), DomainData(x, torch.randint(0, 4, (20,), generator=g))


def _random_channels(space, rng, keep=0.5):
    return {layer.name: rng.permutation(np.arange(layer.channels) < max(1, round(keep * layer.channels)))
            for layer in space.layers}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_channel_masks_recovered_and_index_is_the_payload_order(name):
    """covering_channel_masks inverts param_mask for arbitrary (non-prefix) channel sets, also through LSTM gate
    blocks and flatten groups; the index map lists the covered coordinates in flat order."""
    model, layout, _ = _model(name)
    space = model.channel_space()
    for seed in range(3):
        cm = _random_channels(space, np.random.default_rng(seed), keep=0.3 + 0.2 * seed)
        pm = param_mask(space, layout, cm)
        got = covering_channel_masks(space, layout, pm)
        assert all(np.array_equal(got[k], cm[k]) for k in cm)
        sub = sliced_model(model, layout, pm)
        assert sub is not None
        np.testing.assert_array_equal(sub.index, np.flatnonzero(pm))


STATS = ("channel_activation", "channel_gradient", "dga_gradient")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sliced_client_matches_masked_with_every_term(name, single_thread):
    """One client on an arbitrary channel subset with momentum, weight decay, gradient clipping and the hooks
    that map between the layouts (Eq. 7's rep_norm, fedprox, SCAFFOLD's control, FedSAP's channel_stats with
    all three statistics): sliced equals masked to float tolerance, inactive channels' statistics are 0 in both."""
    model, layout, data = _model(name)
    space = model.channel_space()
    cm = _random_channels(space, np.random.default_rng(1))
    mask = param_mask(space, layout, cm)
    full = layout.flatten(model)
    rng = np.random.default_rng(2)
    dga = "conv1" if name.startswith(("cnn", "resnet")) else ("fc1" if name == "mlp" else "lstm0")
    plan = ClientPlan(client_id=0, round=1, params=full, mask=mask, local_epochs=2, batch_size=8, lr=0.05,
                      momentum=0.9, weight_decay=5e-4, grad_clip=1.0, seed=3,
                      hooks=(call(RepresentationNorm, gamma=0.01), call(ProximalTerm, mu=0.1),
                             call(ControlCorrection, control=(0.01 * rng.standard_normal(layout.size)).astype(np.float32)),
                             call(ChannelStatsHook, keys=tuple(STATS), dga_layer=dga)))
    assert supports_sliced(plan) and sliced_model(model, layout, mask) is not None
    a = train_client(dataclasses.replace(plan, submodel="masked"), copy.deepcopy(model), layout, data)
    b = train_client(plan, copy.deepcopy(model), layout, data)
    assert rel(a.values, b.values) <= VALUES_RTOL
    assert abs(a.train_loss - b.train_loss) <= 1e-5 * max(1.0, abs(a.train_loss))
    inactive = np.concatenate([~cm[layer.name] for layer in space.layers])
    assert sorted(a.stats) == sorted(b.stats) == sorted(STATS)
    for k in STATS:
        assert a.stats[k].shape == b.stats[k].shape
        assert rel(a.stats[k], b.stats[k]) <= STATS_RTOL, (k, rel(a.stats[k], b.stats[k]))
        if k != "dga_gradient":
            np.testing.assert_array_equal(a.stats[k][inactive], 0)
            np.testing.assert_array_equal(b.stats[k][inactive], 0)


def test_submodel_option_is_validated_and_hashed():
    cfg = build_config(preset="smoke")
    assert cfg.training.submodel == "sliced"
    masked = build_config(preset="smoke", overrides=["training.submodel=masked"])
    assert masked.config_hash() != cfg.config_hash()  # the two agree only to float rounding
    with pytest.raises(ConfigError, match="training.submodel"):
        build_config(preset="smoke", overrides=["training.submodel=dense"])
    with pytest.raises(ValueError, match="submodel"):
        ClientPlan(client_id=0, round=1, params=np.zeros(1, np.float32), mask=None, local_epochs=1, batch_size=1,
                   lr=0.1, submodel="dense")


def test_model_without_build_spec_trains_masked():
    """A module not built by build_model cannot be rebuilt at other widths: masked training, same numbers."""
    model, layout, data = _model("mlp")
    del model.build_spec
    space = model.channel_space()
    mask = param_mask(space, layout, _random_channels(space, np.random.default_rng(0)))
    assert sliced_model(model, layout, mask) is None
    plan = ClientPlan(client_id=0, round=1, params=layout.flatten(model), mask=mask, local_epochs=1,
                      batch_size=8, lr=0.1)
    a = train_client(plan, copy.deepcopy(model), layout, data)
    b = train_client(dataclasses.replace(plan, submodel="masked"), copy.deepcopy(model), layout, data)
    np.testing.assert_array_equal(a.values, b.values)
    assert trainable_mask(layout, model).sum() > 0


class FullOnly(ClientHook):
    """Records the model every hook point receives; declares nothing, so its plans train masked."""

    seen: list[tuple[str, int, object]] = []

    def start(self, model: MaskableModel) -> None:
        self.seen.append((type(self).__name__, sum(p.numel() for p in model.parameters()), self.sliced))


class SlicedOk(FullOnly):
    supports_sliced = True


@pytest.fixture
def probe_hooks():
    register_hook("test_full_only")(FullOnly)
    register_hook("test_sliced_ok")(SlicedOk)
    FullOnly.seen = []
    yield
    unregister_hook("test_full_only")
    unregister_hook("test_sliced_ok")


def test_supports_sliced_decides_which_model_the_hooks_get(probe_hooks):
    """A plan whose hooks all declare supports_sliced trains the sub-network and its hooks get it (and the map,
    ``self.sliced``); one hook without the declaration makes the whole plan train masked on the full model,
    bit for bit what submodel=masked gives."""
    model, layout, data = _model("cnn_small")
    space = model.channel_space()
    mask = param_mask(space, layout, _random_channels(space, np.random.default_rng(4)))
    n_full = sum(p.numel() for p in model.parameters())
    n_sub = params_in_mask(layout, mask)
    assert n_sub < n_full

    def plan(*hooks: str, submodel: str = "sliced") -> ClientPlan:
        return ClientPlan(client_id=0, round=1, params=layout.flatten(model), mask=mask, local_epochs=1,
                          batch_size=8, lr=0.1, seed=1, submodel=submodel,
                          hooks=tuple(HookCall(h, NoPayload()) for h in hooks))

    train_client(plan("test_sliced_ok"), copy.deepcopy(model), layout, data)
    (name, n, sliced), = FullOnly.seen
    assert (name, n) == ("SlicedOk", n_sub) and sliced is not None
    np.testing.assert_array_equal(sliced.index, np.flatnonzero(mask))

    FullOnly.seen = []
    a = train_client(plan("test_sliced_ok", "test_full_only"), copy.deepcopy(model), layout, data)
    assert [(s[0], s[1], s[2]) for s in FullOnly.seen] == [("SlicedOk", n_full, None), ("FullOnly", n_full, None)]
    b = train_client(plan("test_sliced_ok", "test_full_only", submodel="masked"), copy.deepcopy(model), layout, data)
    np.testing.assert_array_equal(a.values, b.values)
    with pytest.raises(TypeError, match="does not support sliced"):
        FullOnly(plan("test_full_only"), model, layout, torch.device("cpu"), sliced=sliced)
