"""Channel utilities, dispersion and tri-state roles (papers/000 Eqs. 3, 5, 6; Algorithm 1 lines 11-16).

All vectors here are per channel, concatenated over the ChannelSpace layers in order
(``space.total_channels`` entries); ``offsets`` gives each layer's slice.
"""
from __future__ import annotations

import math

import numpy as np

from fedsap_ray.algorithms.fedsap.tristate import DROPPED, GLOBAL, PRIVATE
from fedsap_ray.models.space import ChannelSpace

_EPS = 1e-12


def layer_offsets(space: ChannelSpace) -> np.ndarray:
    """Start of every layer's slice in a concatenated per-channel vector (last entry = total)."""
    return np.concatenate([[0], np.cumsum([layer.channels for layer in space.layers])]).astype(np.int64)


def split(vec: np.ndarray, space: ChannelSpace) -> dict[str, np.ndarray]:
    off = layer_offsets(space)
    return {layer.name: vec[off[i]:off[i + 1]] for i, layer in enumerate(space.layers)}


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


def layer_utility(activations: list[np.ndarray], gradients: list[np.ndarray], actives: list[np.ndarray],
                  weights: np.ndarray, space: ChannelSpace, entries_per_channel: np.ndarray,
                  lambda_a: float = 0.5, lambda_g: float = 0.5) -> np.ndarray:
    """U_l, the layer-level importance score (Algorithm 1 line 11; the input of Eq. 2's softmax).

    The paper says the server "averages channel utilities across clients to obtain layer-level
    importance scores" without saying over which scope the two signals are normalised. Eq. 5's
    per-layer max normalisation cannot be that scope: it maps every layer's best channel to 1, so
    a layer mean of it measures how *flat* a layer's utilities are, not how much the layer matters
    (with it the adaptive counts stayed within a channel or two of uniform). Our reading: for the
    layer score each client's signals are normalised by their maximum over its whole network, so
    layers stay comparable, and the gradient is taken per parameter entry (the channel's gradient
    norm divided by sqrt of the entries it owns) so that a layer with a larger fan-in is not
    favoured for its size alone. Per client and layer the score is the mean over the channels the
    client kept active (a Dropped channel's zero statistics say nothing about the layer), and the
    server's U_l is the sample-weighted mean over the clients that kept some channel of the layer.
    """
    off = layer_offsets(space)
    rms_scale = np.repeat(1.0 / np.sqrt(np.maximum(np.asarray(entries_per_channel, np.float64), 1.0)),
                          [layer.channels for layer in space.layers])
    num = np.zeros(len(space.layers))
    den = np.zeros(len(space.layers))
    for a, g, on, w in zip(activations, gradients, actives, weights):
        on = np.asarray(on, dtype=bool)
        if not on.any():
            continue
        r = np.asarray(a, np.float64)
        h = np.asarray(g, np.float64) * rms_scale
        r_max, h_max = r[on].max(), h[on].max()
        u = (lambda_a * (r / r_max if r_max > 0 else 0 * r) + lambda_g * (h / h_max if h_max > 0 else 0 * h))
        for i in range(len(space.layers)):
            seg = slice(off[i], off[i + 1])
            if on[seg].any():
                num[i] += w * u[seg][on[seg]].mean()
                den[i] += w
    return np.where(den > 0, num / np.maximum(den, _EPS), 0.0)


def federation_utility(prev: np.ndarray | None, utilities: list[np.ndarray], actives: list[np.ndarray],
                       weights: np.ndarray) -> np.ndarray:
    """The server's utility estimate of every channel (Algorithm 1 line 14's ranking, over all channels).

    Channel c's estimate is the sample-weighted mean of the Eq. 5 utilities measured by the clients
    that held c active in their latest statistics; where no such client exists this time, the
    previous estimate is kept (NaN: never measured). A client cannot measure a channel it dropped
    (its activation and gradient are exactly 0), so without this estimate a Dropped channel could
    never rank back into its top-k.
    """
    u = np.stack(utilities).astype(np.float64)
    on = np.stack(actives).astype(bool)
    w = np.asarray(weights, dtype=np.float64)[:, None] * on
    den = w.sum(0)
    est = np.where(den > 0, (w * u).sum(0) / np.maximum(den, _EPS), np.nan)
    if prev is not None:
        est = np.where(den > 0, est, prev)
    return est


def selection_scores(own: np.ndarray, held: np.ndarray, estimate: np.ndarray | None,
                     space: ChannelSpace) -> np.ndarray:
    """Scores a client's top-k ranks (Algorithm 1 line 14): its own Eq. 5 utility on the channels it
    held when it measured them, the federation's estimate (:func:`federation_utility`) elsewhere.
    A channel nobody has measured yet scores the layer's mean estimate (a neutral prior).
    ``estimate=None`` gives the client's own utilities alone (``selection=own``)."""
    if estimate is None:
        return np.asarray(own, dtype=np.float64)
    est = np.asarray(estimate, dtype=np.float64).copy()
    off = layer_offsets(space)
    for i in range(len(space.layers)):
        seg = est[off[i]:off[i + 1]]
        known = np.isfinite(seg)
        seg[~known] = seg[known].mean() if known.any() else 0.0
    return np.where(np.asarray(held, dtype=bool), np.asarray(own, dtype=np.float64), est)


def smooth_utility(prev: np.ndarray | None, prev_held: np.ndarray | None, new: np.ndarray, held: np.ndarray,
                   estimate: np.ndarray | None, beta: float) -> np.ndarray:
    """A client's Eq. 5 utilities smoothed over rounds on the channels it holds (papers/000 Appendix C:
    "beta_EMA is the EMA coefficient used to smooth channel statistics"): u~ <- beta * u~_prev + (1 - beta) * u.

    A channel held at both measurements continues its own EMA. A newly held channel starts from the
    federation's estimate it was ranked on (:func:`federation_utility`, the score that brought it in),
    else (never measured, or the first round) from its first observation. Starting from the first
    observation would rank a new channel by one noisy measurement against its neighbours' averages, so
    a narrow client would drop it again at the first unlucky round (docs/readings.md#stable-masks).
    Channels not held score 0, as the raw utility does (nothing was measured there). ``beta = 0`` gives
    the raw utility exactly."""
    new = np.asarray(new, dtype=np.float64)
    held = np.asarray(held, dtype=bool)
    if beta == 0 or prev is None or prev_held is None:
        return new.copy()
    start = new if estimate is None else np.where(np.isfinite(estimate), estimate, new)
    base = np.where(held & np.asarray(prev_held, dtype=bool), prev, start)
    return np.where(held, beta * base + (1.0 - beta) * new, 0.0)


def stable_select(scores: np.ndarray, held: np.ndarray, counts: np.ndarray, space: ChannelSpace, *,
                  margin: float = 0.0, max_swaps: int | None = None) -> np.ndarray:
    """Line 14's top-n_l per layer with a stability rule over the client's current channels ``held``.

    Per layer the held channels are kept best-first up to n_l (a shrinking layer drops its weakest;
    a growing one takes its best candidates: forced entries). Then the j-th best candidate replaces
    the j-th weakest held channel while it beats it by more than ``margin`` (hysteresis). With
    ``max_swaps`` such exchanges are made in order of that gain over the whole network until the
    forced entries plus the exchanges reach ``max_swaps`` (the per-round swap budget). With
    ``margin = 0`` and no budget the result is the top n_l of every layer (the exchange argument),
    except that on an exact tie the held channel stays."""
    scores = np.asarray(scores, dtype=np.float64)
    held = np.asarray(held, dtype=bool)
    active = np.zeros(scores.shape, dtype=bool)
    off = layer_offsets(space)
    swaps: list[tuple[float, int, int, int]] = []  # (gain, order, entrant, leaver), absolute indices
    forced = 0
    for i in range(len(space.layers)):
        lo, n = int(off[i]), int(counts[i])
        seg, h = scores[lo:off[i + 1]], held[lo:off[i + 1]]
        mine = np.flatnonzero(h)[np.argsort(-seg[h], kind="stable")]
        others = np.flatnonzero(~h)[np.argsort(-seg[~h], kind="stable")]
        take = mine[:n]
        grow = max(0, n - take.size)
        forced += grow
        active[lo + take] = True
        active[lo + others[:grow]] = True
        rest, weakest = others[grow:], take[::-1]
        for j in range(min(rest.size, weakest.size)):
            gain = seg[rest[j]] - seg[weakest[j]] - margin
            if gain <= 0:
                break
            swaps.append((float(gain), len(swaps), lo + int(rest[j]), lo + int(weakest[j])))
    swaps.sort(key=lambda s: (-s[0], s[1]))
    allowed = len(swaps) if max_swaps is None else max(0, max_swaps - forced)
    for _, _, enter, leave in swaps[:allowed]:
        active[enter], active[leave] = True, False
    return active


def swap_limit(share: float, n_active: int) -> int:
    """The per-round swap budget: floor(share * active channels), at least one when ``share > 0`` so a
    clearly better channel can always enter within a bounded number of rounds."""
    return max(1, math.floor(share * n_active + 1e-9)) if share > 0 else 0


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
    """d~ <- beta * d~_prev + (1 - beta) * d (papers/000: FedSAP "smooths these scores with an EMA").

    The paper gives no initial value. Starting from 0 would scale the first post-warm-up
    dispersion by (1 - beta), i.e. halve it at beta = 0.5, and bias roles towards Global for
    the first rounds for no stated reason, so d~ starts at the first observation."""
    if prev is None:
        return np.asarray(new, dtype=np.float64).copy()
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
