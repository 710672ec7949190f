"""stats.py + client wiring: the per-channel statistics FedSAP clients upload (papers/000 Eq. 4-6)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedsap_ray.algorithms.fedsap.hooks as fedsap_hooks
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.engine.client import ClientError, train_client
from fedsap_ray.data.base import DomainData, as_input
from fedsap_ray.models.masks import ParamLayout, TorchMask, mask_grads_, nested_channel_masks, param_mask
from fedsap_ray.common.messages import ClientPlan
from fedsap_ray.models import build_model
from fedsap_ray.algorithms.fedsap.stats import ChannelStats

pytestmark = pytest.mark.usefixtures("single_thread")

ALL = ("channel_activation", "channel_gradient", "dga_gradient")
SPECS = {  # name -> (input_shape, num_classes, vocab, width_mult)
    "cnn_small": ((3, 8, 8), 3, None, 0.125),  # conv1: 4 channels, conv2: 8
    "resnet10": ((3, 16, 16), 4, None, 0.125),
    "cnn_cifar": ((3, 16, 16), 4, None, 0.0625),
    "mlp": ((12,), 3, None, 0.03125),
    "char_lstm": ((6,), 7, 7, 0.0625),  # 16 hidden units per layer
}


def make(name: str, seed: int = 0) -> nn.Module:
    shape, nc, vocab, w = SPECS[name]
    torch.manual_seed(seed)
    return build_model(name, num_classes=nc, input_shape=shape, width_mult=w, vocab_size=vocab)


def make_data(name: str, n: int, seed: int = 1) -> DomainData:
    shape, nc, vocab, _ = SPECS[name]
    g = torch.Generator().manual_seed(seed)
    if vocab is not None:
        x = torch.randint(0, vocab, (n, *shape), generator=g)
    elif len(shape) == 3:
        x = torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8)
    else:
        x = torch.randn((n, *shape), generator=g)
    return DomainData(x, torch.randint(0, nc, (n,), generator=g))


def make_plan(model: nn.Module, layout: ParamLayout, mask: np.ndarray | None = None, **kw) -> ClientPlan:
    flat = layout.flatten(model)
    if mask is not None:
        flat = np.where(mask, flat, 0).astype(np.float32)  # what the server sends: zeros outside the mask
    stats = kw.pop("stats", ())
    dga_layer = kw.pop("dga_layer", "conv1")
    # FedSAP's channel_stats client hook (fedsap_ray.algorithms.fedsap.hooks)
    hooks = (call(fedsap_hooks.ChannelStatsHook, keys=tuple(stats), dga_layer=dga_layer),) if stats else ()
    args = dict(client_id=3, round=7, params=np.ascontiguousarray(flat), mask=mask, local_epochs=1,
                batch_size=4, lr=0.05, momentum=0.9, weight_decay=1e-3, seed=11, hooks=hooks)
    args.update(kw)
    return ClientPlan(**args)


def manual_run(plan: ClientPlan, model: nn.Module, layout: ParamLayout, data: DomainData):
    """The client's loop written out: per-step gradients (after masking, before clipping) of the last epoch,
    the batches it used and the trained flat vector."""
    from fedsap_ray.algorithms.aggregation import scatter
    layout.load_into(model, scatter(plan.values, plan.mask, layout.size))
    params = list(model.parameters())
    named = dict(model.named_parameters())
    grad_mask = None if plan.mask is None else TorchMask.build(model, layout, plan.mask)
    opt = torch.optim.SGD(params, lr=plan.lr, momentum=plan.momentum, weight_decay=plan.weight_decay)
    x_all, y_all, n = as_input(data.x), data.y, len(data)
    gen = torch.Generator().manual_seed(plan.seed)
    model.train()
    grads, batches = [], []
    for _ in range(plan.local_epochs):
        order = torch.randperm(n, generator=gen)
        grads, batches = [], []
        for s in range(0, n, plan.batch_size):
            idx = order[s:s + plan.batch_size]
            if len(idx) < 2:
                continue
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            if grad_mask is not None:
                mask_grads_(model, layout, grad_mask)
            grads.append({k: p.grad.detach().clone() for k, p in named.items()})
            batches.append(idx)
            if plan.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, plan.grad_clip)
            opt.step()
    return grads, batches, layout.flatten(model)


def mean_grad(grads: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    return torch.stack([g[name] for g in grads]).mean(0)


def direct_channel_gradient(space, grads) -> np.ndarray:
    """sqrt of the sum of squared mean-gradient entries owned by each channel, via ParamAxis.indices."""
    out = []
    for layer in space.layers:
        for c in range(layer.channels):
            sq = 0.0
            for ax in layer.out:
                if ax.name not in grads[0]:
                    continue
                g = mean_grad(grads, ax.name).double()
                idx = torch.as_tensor(ax.indices(np.array([c]), layer.channels))
                sq += float(g.index_select(ax.axis, idx).pow(2).sum())
            out.append(np.sqrt(sq))
    return np.array(out)


# ------------------------------------------------------------------------------------------- cnn_small

def test_cnn_small_activation_equals_direct_conv_outputs_for_one_step() -> None:
    model = make("cnn_small")
    layout = ParamLayout.from_model(model)
    data = make_data("cnn_small", 4)
    plan = make_plan(model, layout, stats=("channel_activation",), batch_size=4)
    w = {k: v.detach().clone() for k, v in model.state_dict().items()}
    res = train_client(plan, make("cnn_small", seed=5), layout, data)
    assert set(res.stats) == {"channel_activation"}

    x = as_input(data.x)
    a1 = F.conv2d(x, w["conv1.weight"], w["conv1.bias"], padding=1)
    a2 = F.conv2d(F.max_pool2d(F.relu(a1), 2), w["conv2.weight"], w["conv2.bias"], padding=1)
    want = torch.cat([a1.abs().mean((2, 3)).mean(0), a2.abs().mean((2, 3)).mean(0)]).numpy()
    got = res.stats["channel_activation"]
    assert got.dtype == np.float32 and got.shape == (4 + 8,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_cnn_small_gradient_and_dga_equal_mean_of_per_step_gradients_before_clipping() -> None:
    model = make("cnn_small")
    layout = ParamLayout.from_model(model)
    space = model.channel_space()
    data = make_data("cnn_small", 10)
    # 2 epochs (statistics of the last one only), 3 steps per epoch (the batch of 2 counts, size-1 ones don't
    # arise), clipping active so that reading before clipping matters
    plan = make_plan(model, layout, stats=ALL, batch_size=4, local_epochs=2, grad_clip=0.05)
    res = train_client(plan, make("cnn_small", seed=5), layout, data)
    grads, _, flat = manual_run(plan, make("cnn_small", seed=6), layout, data)
    assert len(grads) == 3
    np.testing.assert_array_equal(res.values, flat)  # the manual loop is the client's loop

    np.testing.assert_allclose(res.stats["channel_gradient"], direct_channel_gradient(space, grads), rtol=1e-5)
    # conv1 channel c by hand: its filter and its bias
    g_w, g_b = mean_grad(grads, "conv1.weight"), mean_grad(grads, "conv1.bias")
    by_hand = (g_w.pow(2).sum((1, 2, 3)) + g_b.pow(2)).sqrt().numpy()
    np.testing.assert_allclose(res.stats["channel_gradient"][:4], by_hand, rtol=1e-5)

    dga = res.stats["dga_gradient"]
    assert dga.dtype == np.float32 and dga.shape == (model.conv1.weight.numel() + model.conv1.bias.numel(),)
    np.testing.assert_allclose(dga, torch.cat([g_w.reshape(-1), g_b]).numpy(), rtol=1e-5, atol=1e-8)


def test_dropped_channels_have_exactly_zero_statistics() -> None:
    model = make("cnn_small")
    layout = ParamLayout.from_model(model)
    space = model.channel_space()
    cm = {"conv1": np.array([1, 0, 1, 0], bool), "conv2": np.array([0, 1, 1, 0, 1, 0, 0, 1], bool)}
    plan = make_plan(model, layout, mask=param_mask(space, layout, cm), stats=ALL, local_epochs=2)
    res = train_client(plan, make("cnn_small", seed=5), layout, make_data("cnn_small", 8))
    active = np.concatenate([cm["conv1"], cm["conv2"]])
    for key in ("channel_activation", "channel_gradient"):
        v = res.stats[key]
        assert (v[~active] == 0).all(), key
        assert (v[active] > 0).all(), key
    dga = res.stats["dga_gradient"]
    w_rows = dga[:model.conv1.weight.numel()].reshape(4, -1)
    assert (w_rows[~cm["conv1"]] == 0).all() and (w_rows[cm["conv1"]] != 0).any()


# ------------------------------------------------------------------------------------------- ResNet10

def test_resnet10_activation_averages_stem_and_block_outputs() -> None:
    model = make("resnet10")
    layout = ParamLayout.from_model(model)
    space = model.channel_space()
    assert set(model.activation_modules()) == set(space.names)
    assert model.activation_modules()["layer1"] == ["bn1", "layer1.0"]
    assert model.activation_modules()["layer2.0.conv1"] == ["layer2.0.bn1"]
    data = make_data("resnet10", 6)
    plan = make_plan(model, layout, stats=("channel_activation",), batch_size=6)

    ref = make("resnet10", seed=9)
    layout.load_into(ref, plan.values)
    ref.train()
    outs: dict[str, torch.Tensor] = {}
    mods = dict(ref.named_modules())
    for names in ref.activation_modules().values():
        for m in names:
            mods[m].register_forward_hook(lambda _m, _i, o, m=m: outs.__setitem__(m, o.detach()))
    ref(as_input(data.x))  # same samples, same (batch) statistics as the client's single step
    want = []
    for layer in space.layers:
        per_mod = [outs[m].abs().mean((2, 3)).mean(0) for m in ref.activation_modules()[layer.name]]
        want.append(torch.stack(per_mod).mean(0))
    res = train_client(plan, make("resnet10", seed=5), layout, data)
    np.testing.assert_allclose(res.stats["channel_activation"], torch.cat(want).numpy(), rtol=1e-4, atol=1e-6)


def test_resnet10_all_layers_positive_when_active_zero_when_dropped_and_dga_layers() -> None:
    model = make("resnet10")
    layout = ParamLayout.from_model(model)
    space = model.channel_space()
    cm = nested_channel_masks(space, 0.5)
    plan = make_plan(model, layout, mask=param_mask(space, layout, cm), stats=ALL, batch_size=4)
    res = train_client(plan, make("resnet10", seed=5), layout, make_data("resnet10", 8))
    active = np.concatenate([cm[lay.name] for lay in space.layers])
    act, grad = res.stats["channel_activation"], res.stats["channel_gradient"]
    assert act.shape == grad.shape == (space.total_channels,)
    off = 0
    for lay in space.layers:
        a = act[off:off + lay.channels]
        assert (a[cm[lay.name]] > 0).all() and (a[~cm[lay.name]] == 0).all(), lay.name
        off += lay.channels
    assert (grad[active] > 0).all() and (grad[~active] == 0).all()
    assert res.stats["dga_gradient"].shape == (model.conv1.weight.numel(),)  # the stem conv has no bias

    plan = make_plan(model, layout, stats=("dga_gradient",), dga_layer="layer1")
    res = train_client(plan, make("resnet10", seed=5), layout, make_data("resnet10", 8))
    n = sum(p.numel() for k, p in model.named_parameters() if k.startswith("layer1."))
    assert set(res.stats) == {"dga_gradient"} and res.stats["dga_gradient"].shape == (n,)


# ------------------------------------------------------------------------------------------- LSTM, others

def test_char_lstm_statistics_gate_blocks_and_masks() -> None:
    model = make("char_lstm")
    layout = ParamLayout.from_model(model)
    space = model.channel_space()
    data = make_data("char_lstm", 6)
    plan = make_plan(model, layout, stats=ALL, batch_size=6, dga_layer="lstm0", momentum=0.0)
    res = train_client(plan, make("char_lstm", seed=5), layout, data)
    grads, batches, _ = manual_run(plan, make("char_lstm", seed=6), layout, data)
    np.testing.assert_allclose(res.stats["channel_gradient"], direct_channel_gradient(space, grads), rtol=1e-5)
    n_dga = sum(p.numel() for k, p in model.named_parameters() if k.startswith("lstm0."))
    assert res.stats["dga_gradient"].shape == (n_dga,)

    ref = make("char_lstm", seed=9)
    layout.load_into(ref, plan.values)
    h0, _ = ref.lstm0(ref.embedding(data.x[batches[0]]))
    h1, _ = ref.lstm1(h0)
    want = torch.cat([h0.detach().abs().mean(1).mean(0), h1.detach().abs().mean(1).mean(0)]).numpy()
    np.testing.assert_allclose(res.stats["channel_activation"], want, rtol=1e-5, atol=1e-7)

    cm = nested_channel_masks(space, 0.5)
    plan = make_plan(model, layout, mask=param_mask(space, layout, cm), stats=ALL, dga_layer="lstm0")
    res = train_client(plan, make("char_lstm", seed=5), layout, data)
    active = np.concatenate([cm[lay.name] for lay in space.layers])
    for key in ("channel_activation", "channel_gradient"):
        assert (res.stats[key][~active] == 0).all() and (res.stats[key][active] > 0).all(), key


@pytest.mark.parametrize("name", ["cnn_cifar", "mlp"])
def test_other_models_activation_modules_match_channel_counts(name: str) -> None:
    model = make(name)
    layout = ParamLayout.from_model(model)
    plan = make_plan(model, layout, stats=ALL, dga_layer="conv1" if name == "cnn_cifar" else "fc1")
    res = train_client(plan, make(name, seed=5), layout, make_data(name, 8))
    total = model.channel_space().total_channels
    assert res.stats["channel_activation"].shape == res.stats["channel_gradient"].shape == (total,)
    assert (res.stats["channel_activation"] > 0).all()


# ------------------------------------------------------------------------------------------- client wiring

@pytest.mark.parametrize("name", ["cnn_small", "resnet10"])
def test_training_numbers_bit_identical_with_and_without_statistics_and_hooks_removed(name: str) -> None:
    model = make(name)
    layout = ParamLayout.from_model(model)
    space = model.channel_space()
    cm = nested_channel_masks(space, 0.75)
    data = make_data(name, 10)
    results = []
    for stats in ((), ALL):
        plan = make_plan(model, layout, mask=param_mask(space, layout, cm), stats=stats, local_epochs=2,
                         grad_clip=0.5)
        scratch = make(name, seed=5)
        results.append(train_client(plan, scratch, layout, data))
        assert all(not m._forward_hooks for m in scratch.modules())
    plain, with_stats = results
    assert plain.stats == {} and set(with_stats.stats) == set(ALL)
    np.testing.assert_array_equal(plain.values, with_stats.values)
    assert plain.train_loss == with_stats.train_loss


def test_no_collector_when_no_statistics_requested(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a, **k):
        raise AssertionError("ChannelStats built without statistics requested")
    monkeypatch.setattr(fedsap_hooks, "ChannelStats", boom)
    model = make("cnn_small")
    layout = ParamLayout.from_model(model)
    res = train_client(make_plan(model, layout), make("cnn_small", seed=5), layout, make_data("cnn_small", 4))
    assert res.stats == {}


def test_unknown_statistic_raises_client_error_naming_client_and_round() -> None:
    model = make("cnn_small")
    layout = ParamLayout.from_model(model)
    plan = make_plan(model, layout, stats=("channel_activation", "fisher"))
    with pytest.raises(ClientError, match=r"client 3 failed in round 7.*fisher"):
        train_client(plan, make("cnn_small", seed=5), layout, make_data("cnn_small", 4))


def test_bad_dga_layer_fails_and_hooks_are_removed_on_error() -> None:
    model = make("cnn_small")
    layout = ParamLayout.from_model(model)
    plan = make_plan(model, layout, stats=ALL, dga_layer="layer9")
    with pytest.raises(ClientError, match="layer9"):
        train_client(plan, make("cnn_small", seed=5), layout, make_data("cnn_small", 4))
    # a failure mid-epoch leaves no hooks behind on the reused scratch model
    scratch = make("cnn_small", seed=5)
    with pytest.raises(ValueError):
        with ChannelStats(scratch, scratch.channel_space(), layout, ("channel_activation",)):
            raise ValueError("boom")
    assert all(not m._forward_hooks for m in scratch.modules())
