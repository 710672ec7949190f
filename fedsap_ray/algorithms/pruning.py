"""Channel selection rules shared by the pruning baselines (FedMP, DapperFL, FedDrop) and FedSAP.

Every rule returns per-layer boolean channel masks over a model's ChannelSpace that keep
ceil(width * C_l) channels of every layer (the count of papers/003 Algorithm 2, so a
width means the same channel count under every rule); turn them into parameter masks with
:func:`fedsap_ray.models.masks.param_mask`.
"""
from __future__ import annotations

import numpy as np

from fedsap_ray.models.masks import ChannelMasks, ParamLayout, nested_count
from fedsap_ray.models.space import ChannelSpace


def filter_l1_scores(space: ChannelSpace, layout: ParamLayout, params: np.ndarray) -> np.ndarray:
    """Per channel, the L1 norm of its output weights (conv filters / linear rows / LSTM gate rows),
    concatenated over the layers of ``space``; BN scales are not filters and are left out."""
    scores = []
    for layer in space.layers:
        s = np.zeros(layer.channels, dtype=np.float64)
        for ax in layer.out:
            if not ax.name.endswith("weight") or ax.name not in layout.names:
                continue
            w = layout.slice(ax.name, params).reshape(layout.shapes[layout.index(ax.name)])
            if w.ndim < 2:  # BN scale: not a filter
                continue
            w = np.moveaxis(np.abs(w), ax.axis, 0).reshape(w.shape[ax.axis], -1).sum(1)
            s += w.reshape(ax.blocks, layer.channels, ax.group).sum(axis=(0, 2))
        scores.append(s)
    return np.concatenate(scores)


def top_channel_masks(space: ChannelSpace, scores: np.ndarray, width: float) -> ChannelMasks:
    """The ceil(width * C_l) highest-scoring channels of every layer (ties: lower index first)."""
    out, start = {}, 0
    for layer in space.layers:
        seg = scores[start:start + layer.channels]
        m = np.zeros(layer.channels, dtype=bool)
        m[np.argsort(-seg, kind="stable")[:nested_count(width, layer.channels)]] = True
        out[layer.name] = m
        start += layer.channels
    return out


def l1_channel_masks(space: ChannelSpace, layout: ParamLayout, params: np.ndarray, width: float) -> ChannelMasks:
    """Structured magnitude pruning: keep the filters with the largest L1 norm in every layer."""
    return top_channel_masks(space, filter_l1_scores(space, layout, params), width)


def random_channel_masks(space: ChannelSpace, width: float, rng: np.random.Generator) -> ChannelMasks:
    """A uniformly random subset of ceil(width * C_l) channels of every layer."""
    out = {}
    for layer in space.layers:
        m = np.zeros(layer.channels, dtype=bool)
        m[rng.choice(layer.channels, size=nested_count(width, layer.channels), replace=False)] = True
        out[layer.name] = m
    return out
