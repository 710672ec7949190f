"""Channel masks -> parameter masks over one flat float32 layout (docs/architecture.md#channel-spaces-and-masks).

Parameters travel as flat float32 buffers (:class:`ParamLayout`): every parameter plus
the BatchNorm running statistics, in ``state_dict`` order. A *channel mask* is a bool
vector per :class:`~fedsap_ray.models.space.ChannelLayer`; a *parameter mask* is a bool
vector over the flat layout.

Coverage rule: a coordinate is covered iff every channel it depends on (the channel
of its output axis and that of its input axis, each expanded over LSTM gate blocks or
flattened spatial groups) is active; tensors no layer mentions (classifier bias and
output rows, embeddings) are always covered. This is papers/003 Algorithm 2 line 3
("the parameters of the leading c_l channels of layer l and their input connections
from the retained channels of layer l-1") for an arbitrary, not only leading, subset.

BatchNorm: running statistics are part of the layout and follow their channel like
its affine parameters (docs/architecture.md#batchnorm: statistics kept per channel
and role). A client's dropped channels are uncovered, so whatever its local forward
pass writes into their running statistics is never uploaded or aggregated. For the
active channels the masked full-size model computes exactly the sliced sub-model's
batch statistics (tests/models/test_masks.py), so no pollution reaches the server.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from fedsap_ray.models.space import ChannelSpace, ParamAxis, check_layer_values

ChannelMasks = Mapping[str, np.ndarray]


# --------------------------------------------------------------------------------------------------
# Flat layout
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamLayout:
    """Where each float tensor of a model's state lives in one flat float32 vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    is_param: tuple[bool, ...]  # True: nn.Parameter; False: float buffer (BN running stats)

    @classmethod
    def from_model(cls, model: nn.Module) -> ParamLayout:
        """All floating-point state entries in state_dict order (drops num_batches_tracked)."""
        params = {n for n, _ in model.named_parameters()}
        names, shapes, offsets, is_param = [], [], [], []
        off = 0
        for name, t in model.state_dict().items():
            if not torch.is_floating_point(t):
                continue
            names.append(name)
            shapes.append(tuple(int(s) for s in t.shape))
            offsets.append(off)
            is_param.append(name in params)
            off += int(t.numel())
        return cls(tuple(names), tuple(shapes), tuple(offsets), tuple(is_param))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        return self.offsets[-1] + math.prod(self.shapes[-1]) if self.names else 0

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"{name!r} is not in the layout") from None

    def span(self, name: str) -> tuple[int, int]:
        i = self.index(name)
        return self.offsets[i], self.offsets[i] + math.prod(self.shapes[i])

    def slice(self, name: str, vec: np.ndarray) -> np.ndarray:
        """A view of ``vec`` holding tensor ``name`` in its own shape (writes go through)."""
        a, b = self.span(name)
        return vec[a:b].reshape(self.shapes[self.index(name)])

    def param_coords(self) -> np.ndarray:
        """bool [size]: True on trainable-parameter coordinates, False on buffer coordinates."""
        out = np.zeros(self.size, dtype=bool)
        for off, shape, p in zip(self.offsets, self.shapes, self.is_param):
            if p:
                out[off:off + math.prod(shape)] = True
        return out

    def flatten(self, model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> np.ndarray:
        """The model's float state as one new float32 vector (bit-exact for float32 tensors)."""
        state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
        out = np.empty(self.size, dtype=np.float32)
        for name, off, shape in zip(self.names, self.offsets, self.shapes):
            t = state[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"ParamLayout.flatten: {name!r} has shape {tuple(t.shape)}, layout says {shape}")
            out[off:off + math.prod(shape)] = t.detach().to("cpu", torch.float32).reshape(-1).numpy()
        return out

    def load_into(self, model: nn.Module, vec: np.ndarray) -> None:
        """Write ``vec`` into the model's parameters and buffers in place (no reallocation)."""
        if vec.shape != (self.size,):
            raise ValueError(f"ParamLayout.load_into: vector has shape {vec.shape}, layout size is {self.size}")
        state = model.state_dict(keep_vars=True)
        src = torch.from_numpy(np.ascontiguousarray(vec, dtype=np.float32))
        with torch.no_grad():
            for name, off, shape in zip(self.names, self.offsets, self.shapes):
                t = state[name]
                if tuple(t.shape) != shape:
                    raise ValueError(f"ParamLayout.load_into: {name!r} has shape {tuple(t.shape)}, layout says {shape}")
                t.copy_(src[off:off + math.prod(shape)].view(shape))


# --------------------------------------------------------------------------------------------------
# Channel masks
# --------------------------------------------------------------------------------------------------

def trainable_mask(layout: ParamLayout, model: nn.Module) -> np.ndarray:
    """Coordinates that are nn.Parameters (not BN running statistics): what 'parameters trained' counts."""
    out = np.zeros(layout.size, dtype=bool)
    for name, _ in model.named_parameters():
        layout.slice(name, out)[:] = True
    return out


def full_channel_masks(space: ChannelSpace) -> dict[str, np.ndarray]:
    """Every channel active (the full model)."""
    return {layer.name: np.ones(layer.channels, dtype=bool) for layer in space.layers}


def nested_count(p: float, channels: int) -> int:
    """ceil(p * C) channels, at least 1 (papers/003 Algorithm 2 line 2).

    The product is rounded to 9 decimals before the ceiling, so float noise such as
    0.6 * 10 = 6.000000000000001 gives 6, not 7.
    """
    if not (isinstance(p, (int, float)) and 0 < p <= 1):
        raise ValueError(f"nested width p must be in (0, 1], got {p!r}")
    return max(1, min(channels, math.ceil(round(p * channels, 9))))


def nested_channel_masks(space: ChannelSpace, p: float) -> dict[str, np.ndarray]:
    """The leading ceil(p * C_l) channels of every layer (HeteroFL / FjORD / HAS-FL nested width)."""
    out = {}
    for layer in space.layers:
        m = np.zeros(layer.channels, dtype=bool)
        m[:nested_count(p, layer.channels)] = True
        out[layer.name] = m
    return out


def channel_mask_counts(channel_masks: ChannelMasks) -> dict[str, int]:
    """Active channels per layer: the widths of the physically sliced sub-model."""
    return {k: int(np.count_nonzero(v)) for k, v in channel_masks.items()}


def covering_channel_masks(space: ChannelSpace, layout: ParamLayout, mask: np.ndarray) -> dict[str, np.ndarray]:
    """The channel masks a parameter mask was built from: channel c of layer l is active iff any entry it owns in
    the layer's first ``out`` tensor is covered.

    For a mask that came from :func:`param_mask` this recovers its channel masks exactly (a channel's own
    output entries are covered iff it is active). Other masks (a skipped residual branch, a single
    coordinate) give some channel set too: compare ``param_mask`` of the result with ``mask`` to know
    whether a channel set describes the mask at all (what the sliced client does).
    """
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (layout.size,):
        raise ValueError(f"covering_channel_masks: mask has shape {mask.shape}, layout size is {layout.size}")
    out: dict[str, np.ndarray] = {}
    for layer in space.layers:
        ax = layer.out[0]
        t = np.moveaxis(layout.slice(ax.name, mask), ax.axis, 0)
        out[layer.name] = np.asarray(t.reshape(ax.blocks, layer.channels, ax.group, -1).any(axis=(0, 2, 3)))
    return out


@lru_cache(maxsize=64)
def coordinate_dependencies(space: ChannelSpace, layout: ParamLayout) -> tuple[tuple[tuple[str, ParamAxis, bool], ...], ...]:
    """Per layout tensor: (layer name, axis, is_output) for every channel axis it has. Validates shapes."""
    space.validate(dict(zip(layout.names, layout.shapes)))
    by_name: dict[str, list[tuple[str, ParamAxis, bool]]] = {n: [] for n in layout.names}
    for layer in space.layers:
        for ax in layer.out:
            by_name[ax.name].append((layer.name, ax, True))
        for ax in layer.inp:
            by_name[ax.name].append((layer.name, ax, False))
    return tuple(tuple(by_name[n]) for n in layout.names)


def along(values: np.ndarray, ax: ParamAxis, ndim: int) -> np.ndarray:
    """Per-channel values expanded along ``ax`` and shaped to broadcast against the tensor."""
    shape = [1] * ndim
    shape[ax.axis] = -1
    return ax.expand(values).reshape(shape)


def param_mask(space: ChannelSpace, layout: ParamLayout, channel_masks: ChannelMasks) -> np.ndarray:
    """bool [layout.size]: covered iff every channel the coordinate depends on is active (module docstring)."""
    check_layer_values(space, channel_masks, "param_mask")
    out = np.ones(layout.size, dtype=bool)
    for deps, off, shape in zip(coordinate_dependencies(space, layout), layout.offsets, layout.shapes):
        if not deps:
            continue
        t = np.ones(shape, dtype=bool)
        for layer, ax, _ in deps:
            t &= along(np.asarray(channel_masks[layer], dtype=bool), ax, len(shape))
        out[off:off + t.size] = t.reshape(-1)
    return out


# --------------------------------------------------------------------------------------------------
# Applying masks to a torch model
# --------------------------------------------------------------------------------------------------

@dataclass
class TorchMask:
    """Uncovered positions per (partly masked) tensor, on the model's device.

    Build it once per client plan; :func:`mask_grads_` runs after every backward, so the
    numpy -> torch conversion must not sit in that loop.
    """

    uncovered: dict[str, torch.Tensor]

    @classmethod
    def build(cls, model: nn.Module, layout: ParamLayout, mask: np.ndarray) -> TorchMask:
        if mask.shape != (layout.size,) or mask.dtype != np.bool_:
            raise ValueError(f"mask must be bool of shape ({layout.size},), got {mask.dtype} {mask.shape}")
        state = model.state_dict(keep_vars=True)
        out: dict[str, torch.Tensor] = {}
        for name, off, shape in zip(layout.names, layout.offsets, layout.shapes):
            m = mask[off:off + math.prod(shape)]
            if m.all():
                continue
            out[name] = torch.from_numpy(~m.reshape(shape)).to(state[name].device)
        return cls(out)


def _as_torch_mask(model: nn.Module, layout: ParamLayout, mask: np.ndarray | TorchMask) -> TorchMask:
    return mask if isinstance(mask, TorchMask) else TorchMask.build(model, layout, mask)


def apply_mask_(model: nn.Module, layout: ParamLayout, mask: np.ndarray | TorchMask) -> None:
    """Zero every uncovered parameter/buffer coordinate in place.

    With a dropped channel's filter, bias and BN weight AND bias at 0, its activation is
    exactly 0 in train and eval mode (BN: 0 * normalised + 0), so the full-size masked
    model computes what the physically sliced sub-model computes.
    """
    tm = _as_torch_mask(model, layout, mask)
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, unc in tm.uncovered.items():
            state[name].masked_fill_(unc, 0.0)


def mask_grads_(model: nn.Module, layout: ParamLayout, mask: np.ndarray | TorchMask) -> None:
    """Zero the gradients of uncovered coordinates (call after backward, before the optimizer step)."""
    tm = _as_torch_mask(model, layout, mask)
    params = dict(model.named_parameters())
    for name, unc in tm.uncovered.items():
        p = params.get(name)
        if p is not None and p.grad is not None:
            p.grad.masked_fill_(unc, 0.0)


def extract_substate(space: ChannelSpace, state: Mapping[str, torch.Tensor],
                     channel_masks: ChannelMasks) -> dict[str, torch.Tensor]:
    """The state of the physically sliced sub-model keeping only the active channels (any subset).

    Load it into a model built with ``channels=channel_mask_counts(channel_masks)``;
    entries no layer mentions are copied whole.
    """
    check_layer_values(space, channel_masks, "extract_substate")
    axes: dict[str, list[tuple[ParamAxis, np.ndarray, int]]] = {}
    for layer in space.layers:
        ids = np.flatnonzero(np.asarray(channel_masks[layer.name]))
        for ax in layer.out + layer.inp:
            axes.setdefault(ax.name, []).append((ax, ids, layer.channels))
    out = {}
    for name, t in state.items():
        t = t.detach()
        for ax, ids, c in axes.get(name, ()):
            t = t.index_select(ax.axis, torch.as_tensor(ax.indices(ids, c), device=t.device))
        out[name] = t.clone()
    return out


# --------------------------------------------------------------------------------------------------
# Counting (papers/003 Table 1)
# --------------------------------------------------------------------------------------------------

def covered_params(mask: np.ndarray) -> int:
    """Covered coordinates of a flat mask (parameters and BN statistics alike): the payload size."""
    return int(np.count_nonzero(mask))


def params_in_mask(layout: ParamLayout, mask: np.ndarray, *, include_buffers: bool = False) -> int:
    """Trainable parameters a client holds under ``mask`` (papers/003 Table 1 "Params" column).

    BN running statistics are buffers, not parameters; pass include_buffers=True to count them.
    """
    if include_buffers:
        return covered_params(mask)
    return int(np.count_nonzero(mask & layout.param_coords()))
