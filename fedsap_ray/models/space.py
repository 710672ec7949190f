"""The ChannelSpace contract: which tensor coordinates belong to which channel
(docs/architecture.md#channel-spaces-and-masks).

Every maskable model lists its channel layers in forward order. A layer owns ``C``
channels; each entry of ``out`` is a tensor axis *produced* by those channels (conv
filters, biases, BatchNorm affine parameters and running statistics, LSTM gate rows)
and each entry of ``inp`` is a tensor axis *consuming* them (the input axis of the next
convs, of a shortcut conv, of the classifier). ``fedsap_ray.models.masks`` turns a per-layer
channel mask into parameter-level masks from this description alone, so the masking
code never needs to know the architecture.

Residual networks: all tensors tied by identity shortcuts carry the same channels, so
they form ONE layer (a "stream"); dropping stream channel ``c`` zeroes it at the stem
and in every block of the stage at once (the same tying HeteroFL's width slicing uses,
Diao et al. 2021, and papers/003 Algorithm 2 line 3).

Index expansion (``ParamAxis``): an axis holds ``blocks * C * group`` entries and
channel ``c`` owns entries ``b*C*group + c*group + g`` for ``b < blocks``, ``g < group``:
``blocks=4`` expresses the four LSTM gate blocks (papers/003 section 4.1: "slices the
leading fraction of hidden units within each gate block"); ``group=H*W`` expresses a
flatten from ``[C, H, W]`` into a linear layer's input.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class ParamAxis:
    """One tensor axis indexed by a layer's channels (see the module docstring for the expansion)."""

    name: str  # state_dict key
    axis: int
    blocks: int = 1
    group: int = 1

    def __post_init__(self) -> None:
        if self.axis < 0 or self.blocks < 1 or self.group < 1:
            raise ValueError(f"ParamAxis({self.name!r}): axis must be >= 0, blocks and group >= 1")

    def length(self, channels: int) -> int:
        """How many entries this axis has for a layer of ``channels`` channels."""
        return self.blocks * channels * self.group

    def expand(self, channel_values: np.ndarray) -> np.ndarray:
        """Per-channel values -> per-entry values along this axis (index b*C*g + c*g + j)."""
        return np.tile(np.repeat(np.asarray(channel_values), self.group), self.blocks)

    def indices(self, channel_ids: np.ndarray, channels: int) -> np.ndarray:
        """Entry indices (sorted by block, then channel) owned by ``channel_ids`` of a C-channel layer."""
        ids = np.asarray(channel_ids, dtype=np.int64)
        g = np.arange(self.group, dtype=np.int64)
        per_block = (ids[:, None] * self.group + g[None, :]).reshape(-1)
        return np.concatenate([b * channels * self.group + per_block for b in range(self.blocks)])


@dataclass(frozen=True)
class ChannelLayer:
    """A set of C interchangeable channels and every tensor axis that depends on them."""

    name: str
    channels: int
    out: tuple[ParamAxis, ...]  # tensors whose output axis is this layer's channels
    inp: tuple[ParamAxis, ...] = ()  # tensors whose input axis is these channels

    def __post_init__(self) -> None:
        if self.channels < 1:
            raise ValueError(f"ChannelLayer({self.name!r}): channels must be >= 1, got {self.channels}")
        if not self.out:
            raise ValueError(f"ChannelLayer({self.name!r}): needs at least one output tensor")


@dataclass(frozen=True)
class ChannelSpace:
    """The maskable layers of a model, in forward order (docs/architecture.md#channel-spaces-and-masks)."""

    layers: tuple[ChannelLayer, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        seen_axes: dict[tuple[str, int], str] = {}
        out_owner: dict[str, str] = {}
        for i, layer in enumerate(self.layers):
            if layer.name in index:
                raise ValueError(f"ChannelSpace: duplicate layer name {layer.name!r}")
            index[layer.name] = i
            for ax in layer.out + layer.inp:
                key = (ax.name, ax.axis)
                if key in seen_axes:
                    raise ValueError(f"ChannelSpace: axis {ax.axis} of {ax.name!r} claimed by both "
                                     f"{seen_axes[key]!r} and {layer.name!r}")
                seen_axes[key] = layer.name
            for ax in layer.out:
                if ax.name in out_owner:
                    raise ValueError(f"ChannelSpace: {ax.name!r} is an output of both {out_owner[ax.name]!r} "
                                     f"and {layer.name!r}")
                out_owner[ax.name] = layer.name
        object.__setattr__(self, "_index", index)

    def layer(self, name: str) -> ChannelLayer:
        try:
            return self.layers[self._index[name]]
        except KeyError:
            raise KeyError(f"no channel layer {name!r}; layers are {', '.join(self.names)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    @property
    def total_channels(self) -> int:
        """Sum of C_l: the denominator of FedSAP's global budget constraint (papers/000 Eq. 2)."""
        return sum(layer.channels for layer in self.layers)

    @property
    def channel_counts(self) -> dict[str, int]:
        return {layer.name: layer.channels for layer in self.layers}

    def tensors(self) -> set[str]:
        """Names of every tensor that depends on some channel (all others are shared in full)."""
        return {ax.name for layer in self.layers for ax in layer.out + layer.inp}

    def output_layer_of(self, tensor: str) -> str | None:
        """The layer whose channels index ``tensor``'s output axis (None: not channel-owned)."""
        for layer in self.layers:
            if any(ax.name == tensor for ax in layer.out):
                return layer.name
        return None

    def validate(self, shapes: Mapping[str, Iterable[int]]) -> None:
        """Check every axis exists with ``blocks * C * group`` entries; raise ValueError naming the mismatch."""
        for layer in self.layers:
            for ax in layer.out + layer.inp:
                if ax.name not in shapes:
                    raise ValueError(f"ChannelSpace layer {layer.name!r}: tensor {ax.name!r} is not in the model state")
                shape = tuple(shapes[ax.name])
                if ax.axis >= len(shape) or shape[ax.axis] != ax.length(layer.channels):
                    raise ValueError(f"ChannelSpace layer {layer.name!r}: {ax.name!r} has shape {shape}, expected "
                                     f"{ax.length(layer.channels)} entries on axis {ax.axis}")


# --- helpers the model files use to describe themselves -------------------------------------------

BN_TENSORS = ("weight", "bias", "running_mean", "running_var")


def conv_out(module: str, *, bias: bool) -> tuple[ParamAxis, ...]:
    """Output axis (0) of a conv/linear weight and its bias."""
    axes = [ParamAxis(f"{module}.weight", 0)]
    if bias:
        axes.append(ParamAxis(f"{module}.bias", 0))
    return tuple(axes)


def bn_out(module: str) -> tuple[ParamAxis, ...]:
    """BatchNorm affine parameters and running statistics follow their channel (docs/architecture.md#batchnorm)."""
    return tuple(ParamAxis(f"{module}.{t}", 0) for t in BN_TENSORS)


def weight_in(module: str, *, group: int = 1) -> ParamAxis:
    """Input axis (1) of a conv/linear weight."""
    return ParamAxis(f"{module}.weight", 1, group=group)


class MaskableModel(nn.Module):
    """What every model here shares: ``forward = classifier(forward_features(x))`` and its channel counts.

    Subclasses set ``self.classifier`` (the name of the never-sliced output layer),
    ``self._counts`` (channels per ChannelSpace layer) and define ``forward_features`` and
    ``channel_space``.
    """

    classifier: str
    feature_dim: int  # width of forward_features' output (the classifier's input)
    _counts: dict[str, int]
    # every subclass defines these two methods (declared here so that code holding a MaskableModel is typed)
    forward_features: Callable[[torch.Tensor], torch.Tensor]
    channel_space: Callable[[], ChannelSpace]
    # (registry name, build_model keywords) when built by fedsap_ray.models.build_model: how to build it
    # again at other widths (sliced sub-models, fedsap_ray.models.sliced); absent otherwise
    build_spec: tuple[str, dict[str, Any]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.classifier)(self.forward_features(x))

    def channel_counts(self) -> dict[str, int]:
        return dict(self._counts)

    def conv_bn_pairs(self) -> list[tuple[str, str]]:
        """(convolution, BatchNorm) submodule names where the BatchNorm is applied to that convolution's output
        and nothing else reads it, so that evaluation may fold the two into one convolution
        (:func:`fedsap_ray.engine.evaluate.inference_module`). None by default: a model lists its own."""
        return []


def check_layer_values(space: ChannelSpace, values: Mapping[str, np.ndarray], what: str) -> None:
    """Per-layer values (channel masks, states) for ``space``: one entry of shape (C_l,) per layer and nothing
    else; ValueError naming the layer otherwise. Here, beside the space, so that the models and the masks
    both check against it without importing each other."""
    for layer in space.layers:
        if layer.name not in values:
            raise ValueError(f"{what}: no entry for channel layer {layer.name!r}")
        v = np.asarray(values[layer.name])
        if v.shape != (layer.channels,):
            raise ValueError(f"{what}: layer {layer.name!r} needs shape ({layer.channels},), got {v.shape}")
    extra = set(values) - set(space.names)
    if extra:
        raise ValueError(f"{what}: unknown channel layers {sorted(extra)}")
