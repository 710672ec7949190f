"""Channel utilities, dispersion and tri-state roles (papers/000 Eqs. 3, 5, 6; Algorithm 1 lines 11-16).

All vectors here are per channel, concatenated over the ChannelSpace layers in order
(``space.total_channels`` entries); ``offsets`` gives each layer's slice.
"""
from __future__ import annotations

import math

import numpy as np

from fedsap_ray.masks import DROPPED, GLOBAL, PRIVATE
from fedsap_ray.models.space import ChannelSpace

_EPS = 1e-12


def layer_offsets(space: ChannelSpace) -> np.ndarray:
    """Start of every layer's slice in a concatenated per-channel vector (last entry = total)."""
    return np.concatenate([[0], np.cumsum([l.channels for l in space.layers])]).astype(np.int64)


def split(vec: np.ndarray, space: ChannelSpace) -> dict[str, np.ndarray]:
    off = layer_offsets(space)
    return {l.name: vec[off[i]:off[i + 1]] for i, l in enumerate(space.layers)}


def per_layer_max_normalise(vec: np.ndarray, space: ChannelSpace) -> np.ndarray:
    """x / max_l(x) within each layer (Eq. 5's tilde: 'each normalised per layer by its maximum')."""
    out = np.zeros_like(vec, dtype=np.float64)
    off = layer_offsets(space)
    for i in range(len(space.layers)):
        seg = vec[off[i]:off[i + 1]].astype(np.float64)
        m = seg.max() if seg.size else 0.0
        out[off[i]:off[i + 1]] = seg / m if m > 0 else 0.0
    return out


def utility(activation: np.ndarray, gradient: np.ndarray, space: ChannelSpace,
            lambda_a: float = 0.5, lambda_g: float = 0.5) -> np.ndarray:
    """Eq. 5: u = lambda_a * r~ + lambda_g * h~ (r: mean |activation|, h: channel gradient norm)."""
    return lambda_a * per_layer_max_normalise(activation, space) + lambda_g * per_layer_max_normalise(gradient, space)


def layer_utility(utilities: list[np.ndarray], actives: list[np.ndarray], space: ChannelSpace) -> np.ndarray:
    """U_l: mean utility over (client, channel) pairs where the client kept the channel active
    (Algorithm 1 line 11; a dropped channel's zero utility says nothing about the layer)."""
    off = layer_offsets(space)
    u = np.stack(utilities)
    a = np.stack(actives).astype(bool)
    out = np.zeros(len(space.layers))
    for i in range(len(space.layers)):
        seg_u, seg_a = u[:, off[i]:off[i + 1]], a[:, off[i]:off[i + 1]]
        out[i] = seg_u[seg_a].mean() if seg_a.any() else 0.0
    return out


def select_active(scores: np.ndarray, counts: np.ndarray, space: ChannelSpace) -> np.ndarray:
    """Algorithm 1 line 14: the top n_l channels of each layer by score (ties: lower index first)."""
    active = np.zeros(scores.shape, dtype=bool)
    off = layer_offsets(space)
    for i in range(len(space.layers)):
        seg = scores[off[i]:off[i + 1]]
        top = np.argsort(-seg, kind="stable")[: int(counts[i])]
        active[off[i] + top] = True
    return active


def dispersion(activations: list[np.ndarray], actives: list[np.ndarray], groups: np.ndarray,
               eps: float = 1e-8) -> np.ndarray:
    """Eq. 6: d_c = Var_k(mu_kc) / ((1/K) sum_k mu_kc)^2 + eps), mu_kc the mean activation magnitude
    of channel c over the members of pseudo-group k that keep it active. Groups where no member
    keeps c active do not enter; with fewer than two such groups d_c = 0 (no evidence of shift)."""
    act = np.stack(activations).astype(np.float64)
    on = np.stack(actives).astype(bool)
    groups = np.asarray(groups)
    mus = []
    for k in np.unique(groups):
        members = groups == k
        cnt = on[members].sum(0)
        s = (act[members] * on[members]).sum(0)
        mus.append(np.where(cnt > 0, s / np.maximum(cnt, 1), np.nan))
    mu = np.stack(mus)  # [K, channels]
    valid = ~np.isnan(mu)
    k_c = valid.sum(0)
    mean = np.where(k_c > 0, np.nansum(mu, 0) / np.maximum(k_c, 1), 0.0)
    var = np.where(k_c > 0, np.nansum((mu - mean) ** 2, 0) / np.maximum(k_c, 1), 0.0)
    d = var / (mean ** 2 + eps)
    return np.where(k_c >= 2, d, 0.0)


def ema(prev: np.ndarray | None, new: np.ndarray, beta: float) -> np.ndarray:
    """d~ <- beta * d~_prev + (1 - beta) * d (papers/000 'smooths these scores with an EMA'); d~ starts at 0."""
    prev = np.zeros_like(new) if prev is None else prev
    return beta * prev + (1.0 - beta) * new


def assign_roles(active: np.ndarray, d_tilde: np.ndarray, space: ChannelSpace, *, tau_var: float,
                 g_target: float, sgp: bool = True) -> np.ndarray:
    """Eq. 3 states per channel: inactive -> Dropped; active -> Global if d~ <= tau_var else Private
    (Selective Global Protection); then, per layer, the most stable Private channels are promoted
    until at least ceil(g_target * active) are Global. ``sgp=False``: every active channel Global."""
    states = np.full(active.shape, DROPPED, dtype=np.int8)
    states[active] = GLOBAL
    if not sgp:
        return states
    states[active & (d_tilde > tau_var)] = PRIVATE
    off = layer_offsets(space)
    for i in range(len(space.layers)):
        seg = slice(off[i], off[i + 1])
        n_active = int(active[seg].sum())
        need = math.ceil(g_target * n_active - 1e-9) - int((states[seg] == GLOBAL).sum())
        if need > 0:
            priv = np.flatnonzero(states[seg] == PRIVATE)
            order = priv[np.argsort(d_tilde[seg][priv], kind="stable")]
            states[seg][order[:need]] = GLOBAL
    return states


def role_counts(states: np.ndarray) -> dict[str, int]:
    return {"n_global": int((states == GLOBAL).sum()), "n_private": int((states == PRIVATE).sum()),
            "n_dropped": int((states == DROPPED).sum())}
