"""Sliced sub-models: the dense smaller network a client trains instead of the masked full-size one
(``training.submodel=sliced``, the default; docs/architecture.md#sub-model-training).

A plan's parameter mask is a *channel sub-model* when some channel set describes it exactly:
:func:`fedsap_ray.models.masks.covering_channel_masks` reads the active channels off each layer's first ``out``
tensor, and the mask qualifies iff :func:`fedsap_ray.models.masks.param_mask` of those channels gives the mask
back and every layer keeps at least one channel. Then the covered coordinates are exactly the state of
the network built with ``channels=channel_mask_counts(cm)``, and :attr:`SlicedModel.index` says where
each of its flat coordinates lives in the full flat vector (built once per channel set by slicing an
``arange`` through :func:`fedsap_ray.models.masks.extract_substate`, the same machinery that slices the
weights). Anything else (NeFL's ``depth=true`` skipped branches, a layer with no channel left, a model
not built by :func:`fedsap_ray.models.build_model`) returns None and the client trains masked.

Caches, per scratch model (one per worker thread or Ray worker, never shared by two running clients):
the sub-network per channel-count tuple (built once, seeded, under a forked RNG so the global torch RNG
never moves) and the index map per channel set (a small LRU: FedDrop's masks change every round).
Nothing cached can change a number: the sub-network's weights are overwritten from the plan each time.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedsap_ray.models.masks import ChannelMasks, ParamLayout, channel_mask_counts, covering_channel_masks, extract_substate, param_mask
from fedsap_ray.models.space import ChannelSpace, MaskableModel

INDEX_CACHE_SIZE = 32  # channel sets whose index map a scratch model remembers


@dataclass
class SlicedModel:
    """A dense sub-network for one channel set and how its flat vector maps into the full one."""

    model: MaskableModel  # built with channels=channel_mask_counts(channel_masks); shared by plans of the same counts
    layout: ParamLayout  # the sub-network's own flat layout
    index: np.ndarray  # int64 [layout.size]: the full-layout coordinate of each sub-network coordinate
    channel_masks: dict[str, np.ndarray]  # the active channels per layer of the FULL channel space

    def gather(self, full: np.ndarray) -> np.ndarray:
        """Full flat vector -> the sub-network's flat vector."""
        return np.ascontiguousarray(full[self.index])

    def scatter_into(self, full: np.ndarray, sub: np.ndarray) -> np.ndarray:
        """A copy of ``full`` with the sub-network's coordinates replaced by ``sub``."""
        out = np.array(full, dtype=np.float32, copy=True)
        out[self.index] = sub
        return out


class _Cache:
    def __init__(self) -> None:
        self.models: dict[tuple[int, ...], tuple[MaskableModel, ParamLayout]] = {}
        # channel set -> (its parameter mask, the index map; None when that mask is not the plan's)
        self.index: OrderedDict[tuple[bytes, ...], tuple[np.ndarray, np.ndarray | None]] = OrderedDict()


_CACHES: weakref.WeakKeyDictionary[nn.Module, _Cache] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _cache_of(model: nn.Module) -> _Cache:
    with _LOCK:
        c = _CACHES.get(model)
        if c is None:
            c = _CACHES[model] = _Cache()
        return c


def index_map(space: ChannelSpace, layout: ParamLayout, sub_layout: ParamLayout, cm: ChannelMasks) -> np.ndarray:
    """int64 [sub_layout.size]: full flat coordinate of every coordinate of the sliced sub-network's layout."""
    ids = {name: torch.arange(off, off + int(np.prod(shape)), dtype=torch.int64).reshape(shape)
           for name, off, shape in zip(layout.names, layout.offsets, layout.shapes)}
    sub = extract_substate(space, ids, cm)
    out = np.empty(sub_layout.size, dtype=np.int64)
    for name, off, shape in zip(sub_layout.names, sub_layout.offsets, sub_layout.shapes):
        t = sub[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"index_map: sliced {name!r} has shape {tuple(t.shape)}, the sub-network {shape}")
        out[off:off + t.numel()] = t.reshape(-1).numpy()
    return out


def sliced_model(model: MaskableModel, layout: ParamLayout, mask: np.ndarray) -> SlicedModel | None:
    """The cached sub-network that holds exactly the coordinates of ``mask``, or None (train masked; module docstring)."""
    spec = getattr(model, "build_spec", None)
    if spec is None or not hasattr(model, "channel_space"):
        return None
    space = model.channel_space()
    cm = covering_channel_masks(space, layout, mask)
    if any(not m.any() for m in cm.values()):
        return None  # a layer with no channel: no network of that shape exists
    cache = _cache_of(model)
    key = tuple(cm[layer.name].tobytes() for layer in space.layers)
    counts = channel_mask_counts(cm)
    ckey = tuple(counts[layer.name] for layer in space.layers)
    if ckey not in cache.models:
        name, kwargs = spec
        from fedsap_ray.models import build_model  # models imports masks: import late

        with torch.random.fork_rng(devices=[]):  # the global RNG never moves (weights are overwritten anyway)
            torch.manual_seed(0)
            sub = build_model(name, **kwargs, channels=counts)
        cache.models[ckey] = (sub, ParamLayout.from_model(sub))
    sub, sub_layout = cache.models[ckey]
    if key in cache.index:
        cache.index.move_to_end(key)
    else:
        pm = param_mask(space, layout, cm)
        cache.index[key] = (pm, index_map(space, layout, sub_layout, cm) if np.array_equal(pm, mask) else None)
        if len(cache.index) > INDEX_CACHE_SIZE:
            cache.index.popitem(last=False)
    pm, idx = cache.index[key]
    if idx is None or not np.array_equal(pm, mask):
        return None  # no channel set describes this mask (e.g. a skipped residual branch)
    return SlicedModel(sub, sub_layout, idx, cm)


def scatter_channel_values(space: ChannelSpace, sub_space: ChannelSpace, cm: ChannelMasks,
                           values: np.ndarray) -> np.ndarray:
    """Per-channel values of the sub-network (layers concatenated) -> the full channel space, 0 on inactive channels."""
    out = np.zeros(space.total_channels, dtype=np.float32)
    off = soff = 0
    for layer, sl in zip(space.layers, sub_space.layers):
        if layer.name != sl.name:
            raise ValueError(f"scatter_channel_values: layer {sl.name!r} where {layer.name!r} was expected")
        ids = np.flatnonzero(cm[layer.name])
        out[off + ids] = values[soff:soff + sl.channels]
        off += layer.channels
        soff += sl.channels
    if soff != values.size:
        raise ValueError(f"scatter_channel_values: {values.size} values for {soff} sub-network channels")
    return out


def scatter_tensor_values(layout: ParamLayout, sliced: SlicedModel, names: list[str], values: np.ndarray) -> np.ndarray:
    """Tensors ``names`` of the sub-network, flattened and concatenated -> the same tensors at full size, 0 elsewhere."""
    full = np.zeros(layout.size, dtype=np.float32)
    pos = 0
    for n in names:
        a, b = sliced.layout.span(n)
        full[sliced.index[a:b]] = values[pos:pos + b - a]
        pos += b - a
    if pos != values.size:
        raise ValueError(f"scatter_tensor_values: {values.size} values for {pos} sub-network entries")
    return np.concatenate([full[slice(*layout.span(n))] for n in names])
