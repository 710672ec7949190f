"""FedSAP's server state and the Eq. 9 client model read from it.

:class:`FedSAPState` is everything the server keeps between rounds besides W_G: the pseudo-groups,
every group's Private vector, every client's tri-state masks for the next round and the
statistics that choose them. Each round builds a new one (a shallow copy whose changed fields are
new objects), so the state a round started from is never modified.

Role changes take the freshest copy (papers/000 Eq. 9 read with per-coordinate timestamps):
W_G and every group's Private vector carry, per coordinate, the round they were last aggregated.
A client's model takes its role's copy unless the other copy it can see was trained more recently
(:func:`private_is_fresher`; ties: the role's copy).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedsap_ray.common.messages import ServerState, StartOverlay

# (Global, Private) parameter masks of a client's tri-state channel vector
MaskPair = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass
class FedSAPState:
    """FedSAP's ``ServerState.strategy_state`` (client ids and group ids as dict keys)."""

    groups: np.ndarray  # int64 [N]: pi(i), every client's pseudo-group
    private: dict[int, np.ndarray]  # group -> full float32 vector (only its Private coordinates matter)
    states: dict[int, np.ndarray]  # client -> int8 [channels]: its tri-state masks of the NEXT round
    utility: dict[int, np.ndarray]  # client -> its Eq. 5 utility (EMA-smoothed under smoothing=statistics)
    activation: dict[int, np.ndarray]  # client -> latest mean |activation| per channel
    gradient: dict[int, np.ndarray]  # client -> latest channel gradient norm
    measured_on: dict[int, np.ndarray]  # client -> the channels it held active when it measured the above
    estimate: np.ndarray | None  # federation utility estimate of every channel (NaN: never measured)
    stamp_g: np.ndarray  # int32 [n_params]: the round W_G last moved, per coordinate
    stamp_p: dict[int, np.ndarray]  # group -> the same for its Private vector
    dga_grads: dict[int, np.ndarray]  # client -> latest DGA gradient (Eq. 4's input)
    d_tilde: np.ndarray | None  # EMA dispersion of every channel (Eq. 6)
    frozen: bool  # masks=fixed: the masks stopped moving at the end of warm-up
    layer_counts: dict[int, np.ndarray]  # client -> active channels per layer (Eq. 2's budget)
    layer_u: np.ndarray | None  # the layer utilities U_l, EMA-smoothed under smoothing=statistics


def private_is_fresher(pmask: np.ndarray, gmask: np.ndarray | None, stamp_p: np.ndarray,
                       stamp_g: np.ndarray) -> np.ndarray:
    """Where a model takes the group's Private copy rather than W_G (module docstring): on Private
    coordinates unless W_G was trained more recently, on Global ones only when the Private copy was
    (ties: the role's copy)."""
    take = pmask & (stamp_p >= stamp_g)
    return take if gmask is None else take | (gmask & (stamp_p > stamp_g))


def private_take(state: ServerState, cid: int, masks: MaskPair) -> tuple[int, np.ndarray | None]:
    """(client ``cid``'s group k, where Eq. 9's W_i reads k's Private vector: the client's Private coordinates
    where that copy is the fresher; None when group k has no Private vector yet)."""
    st: FedSAPState = state.strategy_state
    gmask, pmask = masks(st.states[cid])
    k = int(st.groups[cid])
    if st.private.get(k) is None:
        return k, None
    return k, private_is_fresher(pmask, gmask, st.stamp_p[k], st.stamp_g)


def client_view(state: ServerState, cid: int, masks: MaskPair) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Eq. 9 for client ``cid``: (W_i = M_G ⊙ W_G + M_P ⊙ W_{pi(i),P} full-size, the round each coordinate's
    value was last aggregated, where it comes from the group's Private vector); uncovered coordinates from W_G."""
    st: FedSAPState = state.strategy_state
    k, take = private_take(state, cid, masks)
    if take is None:
        return state.params, st.stamp_g, np.zeros(st.stamp_g.size, dtype=bool)
    if not take.any():
        return state.params, st.stamp_g, take
    return np.where(take, st.private[k], state.params), np.where(take, st.stamp_p[k], st.stamp_g), take


def client_overlay(state: ServerState, cid: int, masks: MaskPair) -> tuple[StartOverlay | None, np.ndarray]:
    """Eq. 9's W_i as a plan names it (issue 42): the shared W_G (``state.params``) overlaid with the group's
    shared Private vector where ``take`` (the client's own mask, :func:`private_take`), so no per-client copy
    of W_i is built or sent: (the overlay, None when ``take`` is empty; ``take``)."""
    st: FedSAPState = state.strategy_state
    k, take = private_take(state, cid, masks)
    if take is None:
        return None, np.zeros(state.params.size, dtype=bool)
    return (StartOverlay(st.private[k], take) if take.any() else None), take
