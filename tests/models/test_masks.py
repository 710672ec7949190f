"""masks.py: flat layout, nested/tri-state masks, and masked == physically sliced sub-model."""
from __future__ import annotations

import copy
from fractions import Fraction
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedsap_ray.algorithms.fedsap.tristate import DROPPED, GLOBAL, PRIVATE, active_channel_masks, tristate_param_masks
from fedsap_ray.models.masks import (ParamLayout, TorchMask, apply_mask_, channel_mask_counts, covered_params, extract_substate,
                              full_channel_masks, mask_grads_, nested_channel_masks, nested_count, param_mask,
                              params_in_mask)
from fedsap_ray.models import build_model, example_input

SPECS = {  # name -> (input_shape, num_classes, vocab, width_mult)
    "resnet10": ((3, 16, 16), 5, None, 0.25),
    "resnet18": ((3, 8, 8), 5, None, 0.125),
    "cnn_small": ((3, 32, 32), 10, None, 0.25),
    "cnn_cifar": ((3, 32, 32), 10, None, 0.125),
    "cnn_emnist": ((1, 28, 28), 62, None, 0.125),
    "mlp": ((40,), 6, None, 0.125),
    "char_lstm": ((9,), 20, 20, 0.125),
}


pytestmark = pytest.mark.usefixtures("single_thread")


def make(name: str, seed: int = 0, channels: dict[str, int] | None = None) -> nn.Module:
    shape, nc, vocab, w = SPECS[name]
    torch.manual_seed(seed)
    return build_model(name, num_classes=nc, input_shape=shape, width_mult=w, vocab_size=vocab, channels=channels)


def randomize_bn_stats(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial running statistics and affine parameters, so eval mode is a real test."""
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g))
            mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
            with torch.no_grad():
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g))
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=g))


def random_channel_masks(space, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Arbitrary (non-nested) subsets with at least one active channel per layer."""
    out = {}
    for lay in space.layers:
        m = rng.random(lay.channels) < 0.6
        m[rng.integers(lay.channels)] = True
        out[lay.name] = m
    return out


def classifier_columns(model: nn.Module, space, cm: dict[str, np.ndarray]) -> np.ndarray:
    """bool per classifier input column: active iff the channel feeding it is active."""
    name = f"{model.classifier}.weight"
    (lay, ax), = [(lay, ax) for lay in space.layers for ax in lay.inp if ax.name == name]
    return ax.expand(cm[lay.name])


# ---------------------------------------------------------------------------------------------- layout

def test_layout_order_contents_and_bit_exact_round_trip() -> None:
    model = make("resnet10")
    randomize_bn_stats(model)
    layout = ParamLayout.from_model(model)
    sd = model.state_dict()
    assert list(layout.names) == [k for k in sd if "num_batches_tracked" not in k]
    assert "bn1.running_mean" in layout.names and "layer2.0.shortcut.1.running_var" in layout.names
    assert layout.size == sum(v.numel() for k, v in sd.items() if "num_batches_tracked" not in k)
    assert layout.offsets[0] == 0 and all(
        layout.offsets[i + 1] == layout.offsets[i] + layout.sizes[i] for i in range(len(layout.names) - 1))
    assert not layout.is_param[layout.index("bn1.running_var")] and layout.is_param[layout.index("bn1.weight")]

    vec = layout.flatten(model)
    assert vec.dtype == np.float32 and vec.shape == (layout.size,)
    np.testing.assert_array_equal(layout.slice("fc.weight", vec), model.fc.weight.detach().numpy())

    other = make("resnet10", seed=1)
    ptrs = {k: v.data_ptr() for k, v in other.state_dict(keep_vars=True).items()}
    layout.load_into(other, vec)
    assert {k: v.data_ptr() for k, v in other.state_dict(keep_vars=True).items()} == ptrs  # in place
    assert isinstance(other.fc.weight, nn.Parameter)
    assert layout.flatten(other).tobytes() == vec.tobytes()  # bit-exact
    for k, v in other.state_dict().items():
        if "num_batches_tracked" not in k:
            assert torch.equal(v, sd[k]), k
    assert layout.flatten(sd).tobytes() == vec.tobytes()  # a state_dict works as well as a module

    view = layout.slice("bn1.bias", vec)
    view[:] = 7.0
    assert (vec[slice(*layout.span("bn1.bias"))] == 7.0).all()
    with pytest.raises(ValueError, match="layout size"):
        layout.load_into(other, vec[:-1])


# ---------------------------------------------------------------------------------------------- nested

def test_nested_count_ceil_is_robust_to_float_noise() -> None:
    assert 0.07 * 100 > 7 and 0.56 * 100 > 56  # the float products really are noisy
    assert nested_count(0.07, 100) == 7 and nested_count(0.56, 100) == 56
    assert nested_count(0.6, 10) == 6
    assert nested_count(0.61, 10) == 7
    assert nested_count(0.001, 10) == 1
    assert nested_count(1.0, 7) == 7
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="in \\(0, 1\\]"):
            nested_count(bad, 10)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("p", [0.25, 0.4, 0.5, 0.6, 0.75, 1.0])
def test_nested_masks_keep_leading_ceil_channels_and_all_classifier_outputs(name: str, p: float) -> None:
    model = make(name)
    space, layout = model.channel_space(), ParamLayout.from_model(model)
    cm = nested_channel_masks(space, p)
    for lay in space.layers:
        k = max(1, math.ceil(Fraction(str(p)) * lay.channels))  # exact rational ceil
        assert cm[lay.name].tolist() == [True] * k + [False] * (lay.channels - k), lay.name
    pm = param_mask(space, layout, cm)
    w = layout.slice(f"{model.classifier}.weight", pm)
    assert layout.slice(f"{model.classifier}.bias", pm).all()
    assert w.any(axis=1).all()  # every class output unit is present
    # its input columns follow the channels feeding it exactly
    assert (w == classifier_columns(model, space, cm)[None, :]).all()
    if p == 1.0:
        assert pm.all()
    # nestedness: p <= p' implies mask inclusion (papers/003 Algorithm 2)
    bigger = param_mask(space, layout, nested_channel_masks(space, min(1.0, p + 0.2)))
    assert not (pm & ~bigger).any()


def test_param_mask_follows_out_and_in_channels_and_bn_stats() -> None:
    model = make("resnet10")
    space, layout = model.channel_space(), ParamLayout.from_model(model)
    rng = np.random.default_rng(0)
    cm = random_channel_masks(space, rng)
    pm = param_mask(space, layout, cm)
    inner, stream1 = cm["layer1.0.conv1"], cm["layer1"]
    w = layout.slice("layer1.0.conv1.weight", pm)  # [inner, stream1, 3, 3]
    assert (w == (inner[:, None] & stream1[None, :])[:, :, None, None]).all()
    for t in ("weight", "bias", "running_mean", "running_var"):
        # running stats of dropped channels are excluded: they never leave the client
        assert (layout.slice(f"layer1.0.bn1.{t}", pm) == inner).all()
        assert (layout.slice(f"layer2.0.shortcut.1.{t}", pm) == cm["layer2"]).all()
    sc = layout.slice("layer2.0.shortcut.0.weight", pm)[:, :, 0, 0]
    assert (sc == (cm["layer2"][:, None] & stream1[None, :])).all()
    assert (layout.slice("conv1.weight", pm) == stream1[:, None, None, None]).all()
    n_cov = covered_params(pm)
    assert n_cov == pm.sum() and params_in_mask(layout, pm) < n_cov
    assert params_in_mask(layout, pm, include_buffers=True) == n_cov


def test_param_mask_lstm_gate_blocks_and_cnn_flatten_groups() -> None:
    lstm = make("char_lstm")
    space, layout = lstm.channel_space(), ParamLayout.from_model(lstm)
    h = space.layer("lstm0").channels
    cm = {"lstm0": np.arange(h) % 3 == 0, "lstm1": np.arange(h) < 5}
    pm = param_mask(space, layout, cm)
    whh = layout.slice("lstm0.weight_hh_l0", pm).reshape(4, h, h)  # gate blocks i, f, g, o
    for b in range(4):
        assert (whh[b] == (cm["lstm0"][:, None] & cm["lstm0"][None, :])).all()
    assert (layout.slice("lstm1.bias_ih_l0", pm).reshape(4, h) == cm["lstm1"][None, :]).all()
    assert layout.slice("embedding.weight", pm).all()

    cnn = make("cnn_small")
    space, layout = cnn.channel_space(), ParamLayout.from_model(cnn)
    c2 = space.layer("conv2").channels
    cm = {"conv1": np.ones(space.layer("conv1").channels, bool), "conv2": np.arange(c2) == 1}
    fc = layout.slice("fc.weight", param_mask(space, layout, cm)).reshape(10, c2, 8, 8)
    assert fc[:, 1].all() and not fc[:, 0].any() and not fc[:, 2:].any()


def test_param_mask_rejects_bad_channel_masks() -> None:
    model = make("cnn_small")
    space, layout = model.channel_space(), ParamLayout.from_model(model)
    cm = full_channel_masks(space)
    with pytest.raises(ValueError, match="no entry for channel layer 'conv2'"):
        param_mask(space, layout, {"conv1": cm["conv1"]})
    with pytest.raises(ValueError, match="needs shape"):
        param_mask(space, layout, {**cm, "conv2": cm["conv2"][:-1]})
    with pytest.raises(ValueError, match="unknown channel layers"):
        param_mask(space, layout, {**cm, "conv9": cm["conv2"]})
    wrong = ParamLayout.from_model(make("cnn_small", channels={"conv2": 3}))
    with pytest.raises(ValueError, match="expected"):
        param_mask(space, wrong, cm)


# ---------------------------------------------------------------------------------------------- tri-state

@pytest.mark.parametrize("name", ["resnet10", "char_lstm", "cnn_cifar", "mlp"])
def test_tristate_masks_disjoint_union_and_roles(name: str) -> None:
    model = make(name)
    space, layout = model.channel_space(), ParamLayout.from_model(model)
    rng = np.random.default_rng(3)
    states = {lay.name: rng.integers(0, 3, lay.channels).astype(np.int8) for lay in space.layers}
    g, p = tristate_param_masks(space, layout, states)
    assert not (g & p).any()
    np.testing.assert_array_equal(g | p, param_mask(space, layout, active_channel_masks(states)))
    assert p.any() and g.any()
    cls = model.classifier
    assert layout.slice(f"{cls}.bias", g).all()  # shared in full -> Global
    # classifier columns take the role of the channel feeding them
    (last, ax), = [(lay, ax) for lay in space.layers for ax in lay.inp if ax.name == f"{cls}.weight"]
    assert (layout.slice(f"{cls}.weight", p) == ax.expand(states[last.name] == PRIVATE)[None, :]).all()
    assert (layout.slice(f"{cls}.weight", g) == ax.expand(states[last.name] == GLOBAL)[None, :]).all()
    # a hidden layer's weight: role of its OUTPUT channel, dropped if either side is Dropped
    first = space.layers[0]
    wname = first.out[0].name
    w_p, w_g = layout.slice(wname, p), layout.slice(wname, g)
    rows = first.out[0].expand(states[first.name])
    in_dep = [(lay, ax) for lay in space.layers for ax in lay.inp if ax.name == wname]
    in_ok = (np.ones(w_p.shape[1], bool) if not in_dep
             else in_dep[0][1].expand(states[in_dep[0][0].name]) != DROPPED)
    shape = (-1, w_p.shape[1]) + (1,) * (w_p.ndim - 2)
    assert (w_p == ((rows == PRIVATE)[:, None] & in_ok[None, :]).reshape(shape)).all()
    assert (w_g == ((rows == GLOBAL)[:, None] & in_ok[None, :]).reshape(shape)).all()


def test_tristate_global_output_reading_private_input_is_global() -> None:
    model = make("cnn_small")
    space, layout = model.channel_space(), ParamLayout.from_model(model)
    c1, c2 = space.layer("conv1").channels, space.layer("conv2").channels
    states = {"conv1": np.full(c1, PRIVATE, np.int8), "conv2": np.full(c2, GLOBAL, np.int8)}
    states["conv2"][0] = DROPPED
    g, p = tristate_param_masks(space, layout, states)
    w2g = layout.slice("conv2.weight", g)
    assert w2g[1:].all() and not w2g[0].any() and not layout.slice("conv2.weight", p).any()
    assert layout.slice("conv1.weight", p).all() and layout.slice("conv1.bias", p).all()
    with pytest.raises(ValueError, match="outside"):
        tristate_param_masks(space, layout, {**states, "conv1": np.full(c1, 5, np.int8)})


# ---------------------------------------------------------------------------------------------- masked == sliced

def _masked_and_sliced(name: str, cm: dict[str, np.ndarray]) -> tuple[nn.Module, nn.Module, object]:
    full = make(name)
    randomize_bn_stats(full)
    space, layout = full.channel_space(), ParamLayout.from_model(full)
    sub = make(name, seed=5, channels=channel_mask_counts(cm))
    sub.load_state_dict(extract_substate(space, full.state_dict(), cm))
    masked = copy.deepcopy(full)
    apply_mask_(masked, layout, param_mask(space, layout, cm))
    return masked, sub, (space, layout)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("kind", ["nested", "random"])
def test_masked_forward_equals_sliced_submodel_train_and_eval(name: str, kind: str) -> None:
    space = make(name).channel_space()
    cm = (nested_channel_masks(space, 0.5) if kind == "nested"
          else random_channel_masks(space, np.random.default_rng(11)))
    masked, sub, (space, layout) = _masked_and_sliced(name, cm)
    x = example_input(masked, SPECS[name][0], batch_size=4, generator=torch.Generator().manual_seed(2))
    for train in (True, False):
        masked.train(train)
        sub.train(train)
        torch.testing.assert_close(masked(x), sub(x), atol=1e-5, rtol=1e-5)
        cols = classifier_columns(masked, space, cm)
        feats = masked.forward_features(x)
        torch.testing.assert_close(feats[:, cols], sub.forward_features(x), atol=1e-5, rtol=1e-5)
        assert (feats[:, ~cols] == 0).all()
    # train-mode forwards updated BN running stats: the active channels' stats agree too
    got = extract_substate(space, masked.state_dict(), cm)
    for k, v in sub.state_dict().items():
        torch.testing.assert_close(got[k].to(v.dtype), v, atol=1e-5, rtol=1e-5, msg=k)


def test_cnn_small_masked_equals_hand_sliced_leading_channels() -> None:
    """Independent of extract_substate: slice the leading channels by hand (p = 0.5)."""
    full = make("cnn_small")
    space, layout = full.channel_space(), ParamLayout.from_model(full)
    c1, c2 = space.layer("conv1").channels // 2, space.layer("conv2").channels // 2
    sub = make("cnn_small", seed=3, channels={"conv1": c1, "conv2": c2})
    with torch.no_grad():
        sub.conv1.weight.copy_(full.conv1.weight[:c1])
        sub.conv1.bias.copy_(full.conv1.bias[:c1])
        sub.conv2.weight.copy_(full.conv2.weight[:c2, :c1])
        sub.conv2.bias.copy_(full.conv2.bias[:c2])
        sub.fc.weight.copy_(full.fc.weight.view(10, -1, 8 * 8)[:, :c2].reshape(10, -1))  # [C, H, W] flatten
        sub.fc.bias.copy_(full.fc.bias)
    apply_mask_(full, layout, param_mask(space, layout, nested_channel_masks(space, 0.5)))
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(full(x), sub(x), atol=1e-5, rtol=1e-5)


def test_lstm_extract_slices_within_each_gate_block() -> None:
    full = make("char_lstm")
    space = full.channel_space()
    h = space.layer("lstm0").channels
    cm = nested_channel_masks(space, 0.5)
    k = int(cm["lstm0"].sum())
    sub = extract_substate(space, full.state_dict(), cm)
    w = full.state_dict()["lstm0.weight_hh_l0"].view(4, h, h)
    torch.testing.assert_close(sub["lstm0.weight_hh_l0"], w[:, :k, :k].reshape(4 * k, k))
    torch.testing.assert_close(sub["embedding.weight"], full.embedding.weight.detach())


def test_dropped_channels_have_exactly_zero_activations() -> None:
    cm = random_channel_masks(make("resnet10").channel_space(), np.random.default_rng(4))
    masked, _, _ = _masked_and_sliced("resnet10", cm)
    acts: dict[str, torch.Tensor] = {}
    for s in range(1, 5):
        getattr(masked, f"layer{s}").register_forward_hook(
            lambda m, i, o, s=s: acts.__setitem__(f"layer{s}", o.detach()))
    for train in (True, False):
        masked.train(train)
        masked(torch.randn(3, 3, 16, 16))
        for s in range(1, 5):
            a = acts[f"layer{s}"]
            assert (a[:, ~cm[f"layer{s}"]] == 0).all()
            assert (a[:, cm[f"layer{s}"]] != 0).any()


@pytest.mark.parametrize("name", ["resnet10", "char_lstm"])
def test_masked_sgd_step_equals_sliced_step_and_keeps_uncovered_zero(name: str) -> None:
    cm = random_channel_masks(make(name).channel_space(), np.random.default_rng(7))
    masked, sub, (space, layout) = _masked_and_sliced(name, cm)
    pm = param_mask(space, layout, cm)
    tm = TorchMask.build(masked, layout, pm)
    x = example_input(masked, SPECS[name][0], batch_size=4, generator=torch.Generator().manual_seed(9))
    y = torch.randint(0, SPECS[name][1], (4,), generator=torch.Generator().manual_seed(9))
    for model, is_masked in ((masked, True), (sub, False)):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if is_masked:
                mask_grads_(model, layout, tm)
            opt.step()
    vec = layout.flatten(masked)
    assert (vec[~pm] == 0).all()  # uncovered coordinates never moved off zero
    got = extract_substate(space, masked.state_dict(), cm)
    for k, v in sub.state_dict().items():
        torch.testing.assert_close(got[k].to(v.dtype), v, atol=2e-5, rtol=1e-4, msg=k)


def test_apply_mask_zeroes_exactly_the_uncovered_coordinates() -> None:
    model = make("cnn_cifar")
    space, layout = model.channel_space(), ParamLayout.from_model(model)
    randomize_bn_stats(model)
    before = layout.flatten(model)
    pm = param_mask(space, layout, nested_channel_masks(space, 0.4))
    apply_mask_(model, layout, pm)
    after = layout.flatten(model)
    assert (after[~pm] == 0).all()
    np.testing.assert_array_equal(after[pm], before[pm])
    with pytest.raises(ValueError, match="bool of shape"):
        apply_mask_(model, layout, pm[:-1])


def test_mask_grads_zeroes_uncovered_gradients_of_a_non_zeroed_model() -> None:
    """Freezing without zeroing (e.g. FedSPU) leaves non-zero gradients that must be masked."""
    model = make("resnet10")
    space, layout = model.channel_space(), ParamLayout.from_model(model)
    pm = param_mask(space, layout, random_channel_masks(space, np.random.default_rng(1)))
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    zeros = {n: torch.zeros_like(b) for n, b in model.named_buffers() if b.is_floating_point()}
    g_before = layout.flatten({**grads, **zeros})
    params = layout.param_coords()
    assert np.abs(g_before[~pm & params]).max() > 0
    mask_grads_(model, layout, pm)
    g_after = layout.flatten({**{n: p.grad for n, p in model.named_parameters()}, **zeros})
    assert (g_after[~pm] == 0).all()
    np.testing.assert_array_equal(g_after[pm], g_before[pm])
