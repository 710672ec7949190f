"""How FedSAP prepares round t+1 (papers/000 Algorithm 1 lines 8-17): DGA regrouping, then the masks.

- DGA rounds (Eq. 4): t >= warmup and (t - warmup) % regroup_every == 0 (the first grouping closes
  the warm-up, then every R_d rounds). Each client's latest DGA gradient is kept, so partial
  participation still groups every client. On regrouping, each new group's Private parameters start
  as the sample-weighted mean of its members' current client models (Eq. 9), so no member's private
  knowledge is discarded by a relabelling.
- Masks (lines 11-17): utilities (Eq. 5), layer budgets (Eq. 2), top-k active channels under the
  ``ranking`` and ``stability`` options (line 14, docs/readings.md#stable-masks), EMA dispersion
  (Eq. 6) and roles with the g_target floor (Eq. 3). During warm-up every active channel is Global.

Both change only the :class:`~fedsap_ray.algorithms.fedsap.state.FedSAPState` they are given (the
round's fresh copy) and return what they did, for the ``rounds`` table.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fedsap_ray.algorithms.aggregation import masked_weighted_average
from fedsap_ray.algorithms.fedsap import budget, dga, roles
from fedsap_ray.algorithms.fedsap.options import FedSAPOptions
from fedsap_ray.algorithms.fedsap.state import FedSAPState
from fedsap_ray.algorithms.fedsap.tristate import DROPPED, GLOBAL, PRIVATE
from fedsap_ray.algorithms.context import StrategyContext

# client id -> (its Eq. 9 model, the round each coordinate was last aggregated)
ClientView = Callable[[int], tuple[np.ndarray, np.ndarray]]


def in_warmup(o: FedSAPOptions, t: int) -> bool:
    return t <= o.warmup


def is_dga_round(o: FedSAPOptions, t: int) -> bool:
    return o.dga != "none" and t >= max(o.warmup, 1) and (t - max(o.warmup, 1)) % o.regroup_every == 0


def regroup(st: FedSAPState, params: np.ndarray, view: ClientView, ctx: StrategyContext, o: FedSAPOptions,
            rng: np.random.Generator | None) -> dict[str, Any]:
    """DGA (Eq. 4): new pseudo-groups in ``st``; new groups' Private sets from their members' models.
    ``rng``: the seeded draw of ``dga=random`` (a matched control). Returns ``n_groups`` and ``ari_capacity``
    (the ARI against the true domains is the recorder's: ``RoundRecords.groups``)."""
    fed = ctx.federation
    ids = sorted(st.dga_grads)
    groups = st.groups.copy()
    if ids:
        grads = np.stack([st.dga_grads[i] for i in ids]).astype(np.float64)
        # random: the group sizes of the gradient grouping (a matched control); oracle: the true domains,
        # handed to this control explicitly (ctx.oracle, needs_oracle), never to the method itself
        oracle = ctx.oracle
        new = dga.assign_groups(o.dga, grads=grads, tau_sim=o.tau_sim, method=o.dga_method,
                                domains=[oracle.client_domains[i] for i in ids] if oracle is not None else None,
                                rng=rng)
        groups[np.array(ids)] = new
        groups = dga.canonical_labels(groups)
    members = {int(k): [c.client_id for c in fed.clients if groups[c.client_id] == k] for k in np.unique(groups)}
    private, stamp_p = {}, {}
    for k, mem in members.items():
        views = [view(i) for i in mem]
        models = [(None, v[0], float(fed.clients[i].n_samples)) for v, i in zip(views, mem)]
        private[k] = masked_weighted_average(params, models)
        stamp_p[k] = np.maximum.reduce([v[1] for v in views])  # the freshest value that went into it
    st.private, st.stamp_p, st.groups = private, stamp_p, groups
    return {"n_groups": int(len(members)), "ari_capacity": dga.agreement(groups, [c.capacity for c in fed.clients])}


def next_masks(st: FedSAPState, t: int, ctx: StrategyContext, o: FedSAPOptions,
               entries_per_channel: np.ndarray) -> dict[str, int | float | None]:
    """Lines 11-17 for round t+1 into ``st``; returns how the masks moved (``n_reactivated``,
    ``n_role_switches``, ``swap_share``, ``swap_share_narrow``)."""
    space, fed = ctx.space, ctx.federation
    if st.frozen:
        return {"n_reactivated": 0, "n_role_switches": 0, "swap_share": 0.0, "swap_share_narrow": 0.0}
    channels = np.array([layer.channels for layer in space.layers])
    seen = sorted(st.utility)
    if not seen:
        return {}
    actives = [st.measured_on[i] for i in seen]
    weights = np.array([fed.clients[i].n_samples for i in seen], dtype=np.float64)
    warm = in_warmup(o, t + 1)  # masks for round t+1
    if not warm:
        d = roles.dispersion([st.activation[i] for i in seen], actives, st.groups[np.array(seen)])
        st.d_tilde = roles.ema(st.d_tilde, d, o.beta_ema)
    st.estimate = roles.federation_utility(st.estimate, [st.utility[i] for i in seen], actives, weights)
    layer_u = roles.layer_utility([st.activation[i] for i in seen], [st.gradient[i] for i in seen],
                                  actives, weights, space, entries_per_channel, o.lambda_a, o.lambda_g)
    if o.smoothing == "statistics":  # Appendix C: the layer scores are channel statistics too
        layer_u = st.layer_u = roles.ema(st.layer_u, layer_u, o.beta_ema)
    states, counts_by_client = dict(st.states), dict(st.layer_counts)
    reactivated = switches = 0
    shares: dict[float, list[float]] = {}
    for c in fed.clients:
        if c.client_id not in st.utility:
            continue  # no statistics yet: keep its initial mask
        counts = budget.layer_channel_counts(c.capacity, channels, layer_u, temperature=o.temperature,
                                             adaptive=bool(o.adaptive_layer_budget))
        old = states[c.client_id]
        active = select(st, c.client_id, old != DROPPED, counts, ctx, o)
        if warm:
            new = np.where(active, GLOBAL, DROPPED).astype(np.int8)
        else:
            assert st.d_tilde is not None  # set above on every round after warm-up
            new = roles.assign_roles(active, st.d_tilde, space, tau_var=o.tau_var, g_target=o.g_target, sgp=o.sgp)
        reactivated += int(((old == DROPPED) & (new != DROPPED)).sum())
        shares.setdefault(c.capacity, []).append(float((active & (old == DROPPED)).sum() / max(active.sum(), 1)))
        switches += int((((old == GLOBAL) & (new == PRIVATE)) | ((old == PRIVATE) & (new == GLOBAL))).sum())
        states[c.client_id] = new
        counts_by_client[c.client_id] = counts
    st.states, st.layer_counts = states, counts_by_client
    if o.masks == "fixed" and not warm:
        st.frozen = True
    every = [x for v in shares.values() for x in v]
    return {"n_reactivated": reactivated, "n_role_switches": switches,
            "swap_share": float(np.mean(every)) if every else None,
            "swap_share_narrow": float(np.mean(shares[min(shares)])) if shares else None}


def select(st: FedSAPState, cid: int, held: np.ndarray, counts: np.ndarray, ctx: StrategyContext,
           o: FedSAPOptions) -> np.ndarray:
    """Line 14 under the ``ranking`` and ``stability`` options (docs/readings.md#stable-masks)."""
    space = ctx.space
    # pooled: every client ranks by the one federation estimate (FedMP's shared ranking), its own
    # measurements entering only through that estimate
    on = st.measured_on[cid] if o.ranking == "client" else np.zeros_like(held)
    scores = roles.selection_scores(st.utility[cid], on, st.estimate, space)
    if o.stability == "none":
        return roles.select_active(scores, counts, space)
    if o.stability == "hysteresis":
        return roles.stable_select(scores, held, counts, space, margin=o.margin)
    return roles.stable_select(scores, held, counts, space, max_swaps=roles.swap_limit(o.swap_budget, int(np.sum(counts))))
