"""FedSAP's tri-state channel roles (papers/000 Eq. 3: s in {G, P, D}) and their parameter masks.

A client's channels are Global (aggregated over every client holding them as Global), Private
(aggregated within its pseudo-group) or Dropped (not trained); :func:`tristate_param_masks` turns
per-layer role vectors into the two disjoint parameter masks Eq. 8 aggregates over, by the
coverage rule of :mod:`fedsap_ray.models.masks`.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedsap_ray.models.masks import ParamLayout, along, coordinate_dependencies
from fedsap_ray.models.space import ChannelSpace, check_layer_values

GLOBAL: int = 0
PRIVATE: int = 1
DROPPED: int = 2


def active_channel_masks(states: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tri-state -> bool: Global and Private channels are active, Dropped ones are not."""
    return {k: np.asarray(v) != DROPPED for k, v in states.items()}



def tristate_param_masks(space: ChannelSpace, layout: ParamLayout,
                         states: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(global_mask, private_mask) over the flat layout; disjoint, union = active-channel param mask.

    How we read papers/000 Eq. 8 at coordinate level: the parameters W_{l,c} of channel c
    of layer l are the tensors whose OUTPUT axis is c (its filter across all inputs, its
    bias, its BN parameters and statistics). So a coordinate is

    - dropped (in neither mask) if any channel it depends on is Dropped;
    - otherwise it takes the role of its output channel when it has one;
    - else (e.g. classifier weight columns, whose output units are never channels) the
      role of its input channel, Private if any input channel it reads is Private;
    - else (tensors shared in full: classifier bias, embedding) Global.

    Global coordinates are then aggregated over all clients holding them as Global, and
    Private ones within the pseudo-domain group (Eq. 8).
    """
    check_layer_values(space, states, "tristate_param_masks")
    for name, v in states.items():
        v = np.asarray(v)
        if not np.isin(v, (GLOBAL, PRIVATE, DROPPED)).all():
            raise ValueError(f"tristate_param_masks: layer {name!r} has states outside {{0, 1, 2}}")
    glob = np.ones(layout.size, dtype=bool)
    priv = np.zeros(layout.size, dtype=bool)
    for deps, off, shape in zip(coordinate_dependencies(space, layout), layout.offsets, layout.shapes):
        if not deps:
            continue
        nd = len(shape)
        active = np.ones(shape, dtype=bool)
        for layer, ax, _ in deps:
            active &= along(np.asarray(states[layer]) != DROPPED, ax, nd)
        outs = [(layer, ax) for layer, ax, is_out in deps if is_out]
        if outs:
            layer, ax = outs[0]  # ChannelSpace guarantees at most one output layer per tensor
            is_priv = np.broadcast_to(along(np.asarray(states[layer]) == PRIVATE, ax, nd), shape)
        else:
            is_priv = np.zeros(shape, dtype=bool)
            for layer, ax, _ in deps:
                is_priv = is_priv | along(np.asarray(states[layer]) == PRIVATE, ax, nd)
        p = active & is_priv
        glob[off:off + p.size] = (active & ~p).reshape(-1)
        priv[off:off + p.size] = p.reshape(-1)
    return glob, priv
