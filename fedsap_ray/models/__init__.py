"""Maskable networks, registered by name: their channel spaces, channel -> parameter masks, dense sliced sub-networks.

May import: common, config.

Importing this package registers every model module it imports (``@register_model("name")``,
:data:`fedsap_ray.config.registry.MODELS`); a new model is one module plus one import line here.

Every model exposes ``channel_space() -> ChannelSpace``, ``channel_counts()``,
``forward_features(x)`` (encoder output), ``classifier`` (name of the never-sliced
output layer), ``feature_dim`` and ``input_dtype``. :func:`model_macs` counts
multiply-accumulates per sample at any channel mask (papers/003 Table 1).
"""
from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsap_ray.models import cnn, lstm, resnet  # noqa: F401  (registers every model: one import line per module)
from fedsap_ray.models.cnn import CNN6, MLP, CNNSmall
from fedsap_ray.models.lstm import CharLSTM
from fedsap_ray.models.resnet import ResNet, resnet10, resnet18
from fedsap_ray.models.space import ChannelLayer, ChannelSpace, MaskableModel, ParamAxis, check_layer_values
from fedsap_ray.config.registry import MODELS, register_model

ModelFactory = Callable[..., MaskableModel]
# name -> factory, each registered with @register_model("name") where it is defined (fedsap_ray.config.registry)
MODEL_REGISTRY: dict[str, ModelFactory] = MODELS.entries


def build_model(name: str, *, num_classes: int, input_shape: tuple[int, ...], width_mult: float = 1.0,
                vocab_size: int | None = None, channels: Mapping[str, int] | None = None) -> MaskableModel:
    """Build a registered model. ``channels`` overrides per-layer widths (physically sliced sub-models).
    A factory is called with ``num_classes``, ``input_shape``, ``width_mult`` and ``channels``, and with
    ``vocab_size`` when it takes one (text models)."""
    if name not in MODEL_REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid models are {', '.join(sorted(MODEL_REGISTRY))}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    if not width_mult > 0:
        raise ValueError(f"width_mult must be > 0, got {width_mult!r}")
    factory = MODEL_REGISTRY[name]
    text = {"vocab_size": vocab_size} if "vocab_size" in inspect.signature(factory).parameters else {}
    model = factory(num_classes=num_classes, input_shape=tuple(input_shape), width_mult=width_mult,
                    channels=channels, **text)
    # how to build it again at other widths (the client's sliced sub-models, fedsap_ray.models.sliced)
    model.build_spec = (name, dict(num_classes=num_classes, input_shape=tuple(input_shape), width_mult=width_mult,
                                   vocab_size=vocab_size))
    return model


def example_input(model: nn.Module, input_shape: tuple[int, ...], batch_size: int = 2,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A random batch of the model's input kind (token ids for text models, N(0,1) otherwise)."""
    device = next(model.parameters()).device
    if getattr(model, "input_dtype", torch.float32) == torch.long:
        vocab = int(getattr(model, "vocab_size"))  # noqa: B009  (text models only; nn.Module types attributes as Tensor | Module)
        return torch.randint(0, vocab, (batch_size, *input_shape), generator=generator).to(device)
    return torch.randn((batch_size, *input_shape), generator=generator).to(device)


_USES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], dict[str, int]]] = weakref.WeakKeyDictionary()


def weight_uses(model: nn.Module, input_shape: tuple[int, ...]) -> dict[str, int]:
    """How many times each conv/linear/LSTM weight entry is applied per sample (cached per model).

    Measured by forward hooks on one eval-mode sample: a conv weight is used once per
    output position, a linear weight once per row, an LSTM weight once per time step.
    """
    key = tuple(int(s) for s in input_shape)
    cached = _USES.setdefault(model, {})
    if key in cached:
        return dict(cached[key])
    uses: dict[str, int] = {}
    handles = []

    def hook(weights: tuple[str, ...]) -> Callable:
        def fn(mod: nn.Module, inputs: tuple, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(mod, nn.Conv2d):
                n = out.shape[-1] * out.shape[-2]
            elif isinstance(mod, nn.Linear):
                n = out.numel() // out.shape[-1]
            else:  # nn.LSTM
                n = out.shape[1] if mod.batch_first else out.shape[0]
            for w in weights:
                uses[w] = uses.get(w, 0) + int(n)
        return fn

    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            handles.append(mod.register_forward_hook(hook((f"{name}.weight",))))
        elif isinstance(mod, nn.LSTM):
            handles.append(mod.register_forward_hook(
                hook(tuple(f"{name}.{w}" for w, _ in mod.named_parameters() if w.startswith("weight_")))))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(example_input(model, key, batch_size=1))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    cached[key] = uses
    return dict(uses)


def model_macs(model: MaskableModel, input_shape: tuple[int, ...],
               channel_masks: Mapping[str, np.ndarray] | None = None) -> int:
    """Multiply-accumulates per sample at a channel mask: sum over weight tensors of
    (covered weight entries) x (applications per sample, :func:`weight_uses`).

    Biases, BN, pooling and activations are not counted: the convention of papers/003
    Table 1, whose CNN and LSTM rows this reproduces (tests/models/test_models.py). Coverage is
    an outer product of per-axis channel masks (masks.param_mask), so a tensor's covered
    count is the product over its axes of the active entries; no flat mask is built.
    """
    space = model.channel_space()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if channel_masks is not None:
        check_layer_values(space, channel_masks, "model_macs")
    active: dict[tuple[str, int], int] = {}
    if channel_masks is not None:
        for layer in space.layers:
            for ax in layer.out + layer.inp:
                active[(ax.name, ax.axis)] = int(np.count_nonzero(ax.expand(np.asarray(channel_masks[layer.name]))))
    total = 0
    for w, n in weight_uses(model, input_shape).items():
        covered = 1
        for axis, size in enumerate(shapes[w]):
            covered *= active.get((w, axis), size)
        total += covered * n
    return total


__all__ = ["MODEL_REGISTRY", "register_model", "build_model", "example_input", "model_macs", "weight_uses", "ChannelSpace", "ChannelLayer",
           "ParamAxis", "ResNet", "resnet10", "resnet18", "CNNSmall", "CNN6", "MLP", "CharLSTM"]
