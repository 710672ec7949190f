"""Models: registry, forward passes, exact ChannelSpaces, parameter and MAC counts (papers/003 Table 1)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedsap_ray import config
from fedsap_ray.config import registry
from fedsap_ray.models.masks import ParamLayout, nested_channel_masks, param_mask, params_in_mask
from fedsap_ray.models import MODEL_REGISTRY, build_model, example_input, model_macs, weight_uses
from fedsap_ray.models.space import ChannelLayer, ChannelSpace, ParamAxis

# name -> (input_shape, num_classes, vocab_size, module reading the raw input)
SPECS = {
    "resnet10": ((3, 32, 32), 10, None, "conv1"),
    "resnet18": ((3, 16, 16), 7, None, "conv1"),
    "cnn_small": ((3, 32, 32), 10, None, "conv1"),
    "cnn_cifar": ((3, 32, 32), 10, None, "conv1"),
    "cnn_emnist": ((1, 28, 28), 62, None, "conv1"),
    "mlp": ((800,), 10, None, "fc1"),
    "char_lstm": ((12,), 95, 95, "lstm0"),
}


pytestmark = pytest.mark.usefixtures("single_thread")


def small(name: str, width: float = 0.25) -> nn.Module:
    shape, nc, vocab, _ = SPECS[name]
    torch.manual_seed(0)
    return build_model(name, num_classes=nc, input_shape=shape, width_mult=width, vocab_size=vocab)


def test_registry_has_every_config_model_and_rejects_unknown() -> None:
    assert set(registry.MODELS.names()) == set(MODEL_REGISTRY) == set(SPECS)  # the config asks the same registry
    with pytest.raises(config.ConfigError, match=r"invalid model\.name='vgg99': allowed values are resnet10, resnet18, cnn_small"):
        config.ModelConfig(name="vgg99")
    with pytest.raises(ValueError, match="resnet10.*resnet18|valid models are"):
        build_model("vgg99", num_classes=10, input_shape=(3, 32, 32))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_forward_backward_and_features(name: str) -> None:
    model = small(name)
    shape, nc, _, _ = SPECS[name]
    x = example_input(model, shape, batch_size=3, generator=torch.Generator().manual_seed(1))
    out = model(x)
    assert out.shape == (3, nc)
    assert torch.isfinite(out).all()
    feats = model.forward_features(x)
    assert feats.shape == (3, model.feature_dim)
    torch.testing.assert_close(getattr(model, model.classifier)(feats), out)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_channel_space_claims_exactly_the_channel_axes(name: str) -> None:
    """Every hidden output axis is in exactly one layer's ``out`` (with the right C), every input
    axis reading a channel is in exactly one ``inp``; the classifier's output units never are."""
    model = small(name)
    space = model.channel_space()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    space.validate(shapes)
    raw_input = SPECS[name][3]
    exp_out: set[tuple[str, int]] = set()
    exp_in: set[tuple[str, int]] = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            if mname != model.classifier:
                exp_out.add((f"{mname}.weight", 0))
                if mod.bias is not None:
                    exp_out.add((f"{mname}.bias", 0))
            if mname != raw_input:
                exp_in.add((f"{mname}.weight", 1))
        elif isinstance(mod, nn.BatchNorm2d):
            exp_out |= {(f"{mname}.{t}", 0) for t in ("weight", "bias", "running_mean", "running_var")}
        elif isinstance(mod, nn.LSTM):
            exp_out |= {(f"{mname}.{t}_l0", 0) for t in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
            exp_in.add((f"{mname}.weight_hh_l0", 1))
            if mname != raw_input:
                exp_in.add((f"{mname}.weight_ih_l0", 1))
    got_out = [(ax.name, ax.axis) for lay in space.layers for ax in lay.out]
    got_in = [(ax.name, ax.axis) for lay in space.layers for ax in lay.inp]
    assert len(got_out) == len(set(got_out)) and set(got_out) == exp_out
    assert len(got_in) == len(set(got_in)) and set(got_in) == exp_in
    # channel counts agree with the modules, and the model reports the same counts
    assert space.channel_counts == model.channel_counts()
    for lay in space.layers:
        for ax in lay.out:
            assert shapes[ax.name][0] == ax.blocks * lay.channels
    assert not any(ax.name.startswith(model.classifier + ".") for lay in space.layers for ax in lay.out)


def test_resnet_streams_tie_stem_blocks_and_shortcuts() -> None:
    space = small("resnet18").channel_space()
    assert space.names == ("layer1", "layer1.0.conv1", "layer1.1.conv1", "layer2.0.conv1", "layer2",
                           "layer2.1.conv1", "layer3.0.conv1", "layer3", "layer3.1.conv1", "layer4.0.conv1",
                           "layer4", "layer4.1.conv1")
    out = {lay.name: {ax.name for ax in lay.out} for lay in space.layers}
    inp = {lay.name: {ax.name for ax in lay.inp} for lay in space.layers}
    assert {"conv1.weight", "bn1.weight", "layer1.0.conv2.weight", "layer1.1.bn2.running_var"} <= out["layer1"]
    assert {"layer2.0.shortcut.0.weight", "layer2.0.shortcut.1.bias", "layer2.1.conv2.weight"} <= out["layer2"]
    assert inp["layer1"] == {"layer1.0.conv1.weight", "layer1.1.conv1.weight", "layer2.0.conv1.weight",
                             "layer2.0.shortcut.0.weight"}
    assert inp["layer4"] == {"layer4.1.conv1.weight", "fc.weight"}
    assert inp["layer2.1.conv1"] == {"layer2.1.conv2.weight"}
    assert [space.layer(f"layer{s}").channels for s in range(1, 5)] == [16, 32, 64, 128]
    assert space.total_channels == (16 + 32 + 64 + 128) * 3  # 4 streams + 2 inner convs per stage


def test_resnet10_parameter_count_by_hand() -> None:
    m = build_model("resnet10", num_classes=10, input_shape=(3, 32, 32))
    bn = lambda c: 2 * c  # noqa: E731  (affine weight + bias; running stats are buffers)
    stem = 3 * 64 * 9 + bn(64)
    s1 = 2 * (64 * 64 * 9 + bn(64))
    s2 = 64 * 128 * 9 + 128 * 128 * 9 + 64 * 128 + 3 * bn(128)
    s3 = 128 * 256 * 9 + 256 * 256 * 9 + 128 * 256 + 3 * bn(256)
    s4 = 256 * 512 * 9 + 512 * 512 * 9 + 256 * 512 + 3 * bn(512)
    fc = 512 * 10 + 10
    expected = stem + s1 + s2 + s3 + s4 + fc
    assert expected == 4_903_242
    assert sum(p.numel() for p in m.parameters()) == expected
    m18 = build_model("resnet18", num_classes=10, input_shape=(3, 32, 32))
    assert sum(p.numel() for p in m18.parameters()) == 11_173_962  # the standard CIFAR ResNet18


def test_cnn_small_exact_architecture() -> None:
    m = build_model("cnn_small", num_classes=10, input_shape=(3, 32, 32))
    assert sum(p.numel() for p in m.parameters()) == 3 * 32 * 9 + 32 + 32 * 64 * 9 + 64 + 4096 * 10 + 10
    assert model_macs(m, (3, 32, 32)) == 3 * 32 * 9 * 32 * 32 + 32 * 64 * 9 * 16 * 16 + 4096 * 10
    assert m.channel_space().layer("conv2").inp[0] == ParamAxis("fc.weight", 1, group=64)


def test_width_mult_rounds_and_keeps_one_channel() -> None:
    assert build_model("cnn_small", num_classes=3, input_shape=(3, 32, 32), width_mult=0.3).channel_counts() == \
        {"conv1": 10, "conv2": 19}
    assert set(build_model("mlp", num_classes=3, input_shape=(20,), width_mult=0.001).channel_counts().values()) == {1}
    with pytest.raises(ValueError, match="unknown channel layers"):
        build_model("mlp", num_classes=3, input_shape=(20,), channels={"fc9": 3})


def test_channels_override_builds_a_sliced_submodel() -> None:
    m = build_model("resnet10", num_classes=4, input_shape=(3, 16, 16), width_mult=0.25,
                    channels={"layer2": 5, "layer2.0.conv1": 3})
    assert m.layer2[0].conv1.out_channels == 3 and m.layer2[0].conv2.out_channels == 5
    assert m.layer3[0].conv1.in_channels == 5 and m.layer2[0].shortcut[0].out_channels == 5
    assert m(torch.randn(2, 3, 16, 16)).shape == (2, 4)


# papers/003 Table 1: p -> (Params (M), MACs/sample (M), Upload (MB))
TABLE1 = {
    ("cnn_cifar", (3, 32, 32), 10): {0.25: (0.21, 10.0, 0.82), 0.5: (0.82, 39.2, 3.26),
                                     0.75: (1.83, 87.4, 7.32), 1.0: (3.25, 154.9, 13.00)},
    ("cnn_emnist", (1, 28, 28), 62): {0.25: (0.21, 7.5, 0.85), 0.5: (0.83, 29.7, 3.31),
                                      0.75: (1.85, 66.6, 7.40), 1.0: (3.28, 118.2, 13.10)},
    ("char_lstm", (80,), 95): {0.25: (0.06, 4.1, 0.24), 0.5: (0.22, 16.1, 0.86),
                               0.75: (0.47, 35.9, 1.88), 1.0: (0.82, 63.6, 3.30)},
}


@pytest.mark.parametrize("key", list(TABLE1), ids=[k[0] for k in TABLE1])
def test_papers003_table1_costs_reproduced(key: tuple) -> None:
    name, shape, nc = key
    m = build_model(name, num_classes=nc, input_shape=shape, vocab_size=95 if name == "char_lstm" else None)
    space, layout = m.channel_space(), ParamLayout.from_model(m)
    for p, (params_m, macs_m, upload_mb) in TABLE1[key].items():
        cm = nested_channel_masks(space, p)
        n = params_in_mask(layout, param_mask(space, layout, cm))
        assert round(n / 1e6, 2) == pytest.approx(params_m), (name, p, n)
        assert round(model_macs(m, shape, cm) / 1e6, 1) == pytest.approx(macs_m), (name, p)
        assert round(4 * n / 1e6, 2) == pytest.approx(upload_mb), (name, p)


def test_model_macs_counts_lstm_steps_and_masked_weights() -> None:
    m = build_model("char_lstm", num_classes=5, input_shape=(7,), width_mult=0.05, vocab_size=5)  # H = 13
    h = 13
    full = 7 * (4 * h * (8 + h) + 4 * h * (h + h)) + h * 5
    assert model_macs(m, (7,)) == full
    cm = {"lstm0": np.arange(h) < 3, "lstm1": np.arange(h) < 2}
    assert model_macs(m, (7,), cm) == 7 * (4 * 3 * (8 + 3) + 4 * 2 * (3 + 2)) + 2 * 5
    assert m.training  # restored
    with pytest.raises(ValueError, match="no entry for channel layer 'lstm1'"):
        model_macs(m, (7,), {"lstm0": cm["lstm0"]})
    assert weight_uses(m, (7,)) == {"lstm0.weight_ih_l0": 7, "lstm0.weight_hh_l0": 7, "lstm1.weight_ih_l0": 7,
                                    "lstm1.weight_hh_l0": 7, "fc.weight": 1}


@pytest.mark.parametrize("name", ["resnet18", "cnn_small", "char_lstm"])
def test_model_macs_at_random_masks_matches_the_flat_param_mask(name: str) -> None:
    """The analytic per-axis product in model_macs agrees with masks.param_mask, coordinate by coordinate."""
    m = small(name)
    space, layout = m.channel_space(), ParamLayout.from_model(m)
    rng = np.random.default_rng(0)
    cm = {lay.name: rng.random(lay.channels) < 0.5 for lay in space.layers}
    pm = param_mask(space, layout, cm)
    shape = SPECS[name][0]
    expected = sum(n * int(pm[slice(*layout.span(w))].sum()) for w, n in weight_uses(m, shape).items())
    assert model_macs(m, shape, cm) == expected
    assert model_macs(m, shape, cm) < model_macs(m, shape)


def test_param_axis_expansion_with_blocks_and_groups() -> None:
    ax = ParamAxis("w", 0, blocks=2, group=2)
    mask = np.array([True, False, True])
    assert ax.expand(mask).tolist() == [1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1]
    assert ax.indices(np.array([0, 2]), 3).tolist() == [0, 1, 4, 5, 6, 7, 10, 11]
    assert ax.length(3) == 12


def test_channel_space_rejects_inconsistent_descriptions() -> None:
    a = ChannelLayer("a", 2, out=(ParamAxis("x.weight", 0),))
    with pytest.raises(ValueError, match="duplicate layer"):
        ChannelSpace((a, a))
    with pytest.raises(ValueError, match="claimed by both"):
        ChannelSpace((a, ChannelLayer("b", 2, out=(ParamAxis("y.weight", 0),), inp=(ParamAxis("x.weight", 0),))))
    space = ChannelSpace((a,))
    with pytest.raises(ValueError, match="expected 2 entries"):
        space.validate({"x.weight": (3, 4)})
    with pytest.raises(ValueError, match="not in the model state"):
        space.validate({})
    with pytest.raises(KeyError, match="layers are a"):
        space.layer("zzz")
