"""FedSAP's type-matched aggregation (papers/000 Eq. 8, Algorithm 1 line 18) and the statistics it keeps.

Coordinates a client trained as Global are averaged over the clients holding them as Global,
Private ones only within the client's pseudo-group, sample-weighted; Dropped coordinates keep
their value bit for bit. The masks used are the ones the clients trained under this round.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from fedsap_ray.algorithms.aggregation import masked_weighted_average
from fedsap_ray.algorithms.fedsap import roles
from fedsap_ray.algorithms.fedsap.options import FedSAPOptions
from fedsap_ray.algorithms.fedsap.state import FedSAPState, MaskPair
from fedsap_ray.algorithms.fedsap.tristate import DROPPED
from fedsap_ray.common.messages import ClientResult
from fedsap_ray.models.space import ChannelSpace


def type_matched(params: np.ndarray, st: FedSAPState, results: list[ClientResult], masks: MaskPair,
                 t: int) -> tuple[np.ndarray, FedSAPState]:
    """Eq. 8 over ``results`` (client-id order): the new W_G, and ``st`` with the new Private vectors and
    the rounds each coordinate last moved (``stamp_g``, ``stamp_p``); ``st`` itself is not modified."""
    glob_contrib: list[tuple[np.ndarray, np.ndarray, float]] = []
    priv_contrib: dict[int, list[tuple[np.ndarray, np.ndarray, float]]] = {}
    for r in results:
        gmask, pmask = masks(st.states[r.client_id])
        # r.values hold the coordinates of r.mask (messages.py), here gmask | pmask in coordinate order, so the
        # Global (Private) ones are r.values where gmask (pmask) is set within r.mask: no full-size scatter
        held = r.mask
        w = float(r.n_samples)
        glob_contrib.append((gmask, r.values[gmask if held is None else gmask[held]], w))
        if pmask.any():
            priv_contrib.setdefault(int(st.groups[r.client_id]), []).append(
                (pmask, r.values[pmask if held is None else pmask[held]], w))
    new_params = masked_weighted_average(params, glob_contrib)  # Eq. 8, Global branch
    stamp_g = st.stamp_g.copy()
    stamp_g[np.logical_or.reduce([m for m, _, _ in glob_contrib])] = t
    private, stamp_p = dict(st.private), dict(st.stamp_p)
    for k, contrib in priv_contrib.items():  # Eq. 8, Private branch, within group k
        private[k] = masked_weighted_average(private.get(k, params), contrib)
        stamp_p[k] = stamp_p.get(k, np.zeros_like(stamp_g)).copy()
        stamp_p[k][np.logical_or.reduce([m for m, _, _ in contrib])] = t
    return new_params, replace(st, private=private, stamp_g=stamp_g, stamp_p=stamp_p)


def update_statistics(st: FedSAPState, results: list[ClientResult], space: ChannelSpace, o: FedSAPOptions) -> None:
    """Line 6's uploads into ``st`` (a fresh copy: every changed field gets a new dict): each client's channel
    statistics, its Eq. 5 utility (smoothed with beta_EMA under ``smoothing=statistics``,
    :func:`roles.smooth_utility`) on the mask it trained under, and its DGA gradient on DGA rounds."""
    util, act, grads = dict(st.utility), dict(st.activation), dict(st.dga_grads)
    chan_grad, measured = dict(st.gradient), dict(st.measured_on)
    beta = o.beta_ema if o.smoothing == "statistics" else 0.0
    for r in results:
        a, g = r.stats["channel_activation"], r.stats["channel_gradient"]
        act[r.client_id] = a.astype(np.float64)
        chan_grad[r.client_id] = g.astype(np.float64)
        held = st.states[r.client_id] != DROPPED  # the mask it trained under
        u = roles.utility(a, g, space, o.lambda_a, o.lambda_g)
        util[r.client_id] = roles.smooth_utility(util.get(r.client_id), measured.get(r.client_id), u, held,
                                                 st.estimate, beta)
        measured[r.client_id] = held
        if "dga_gradient" in r.stats:
            grads[r.client_id] = r.stats["dga_gradient"]
    st.utility, st.activation, st.dga_grads = util, act, grads
    st.gradient, st.measured_on = chan_grad, measured
