"""FedSAP (papers/000, Algorithm 1): adaptive layer budgets, tri-state masks, DGA, SGP,
type-matched aggregation, client-specific models.

Round t, for the participating clients (Algorithm 1):
- configure (line 3): client i gets the Eq. 9 model W_i = M_G ⊙ W_G + M_P ⊙ W_{pi(i),P}
  at its active coordinates, its tri-state mask, and the Eq. 7 regulariser weight gamma;
  it uploads channel activation / gradient statistics (line 6), plus the ``dga_layer``
  gradient on DGA rounds.
- aggregate (line 18, Eq. 8): coordinates a client trained as Global are averaged over
  the clients holding them as Global, Private ones only within the client's
  pseudo-group, sample-weighted; Dropped coordinates keep their value bit-for-bit.
  The masks used are the ones the clients trained under this round.
- then the server prepares round t+1 (lines 8-17): DGA regrouping on DGA rounds
  (Eq. 4), utilities (Eq. 5), layer budgets (Eq. 2), top-k active channels, EMA
  dispersion (Eq. 6) and roles with the g_target floor (Eq. 3).

Masks in motion (readings of lines 11-16 that keep the partition able to change):
- Line 14 ranks *all* channels of a layer. A client measures nothing on a channel it
  dropped (activation and gradient are exactly 0), so its own utility alone would never
  bring a Dropped channel back. The server therefore keeps a utility estimate for every
  channel (sample-weighted over the clients that held it, kept across rounds:
  :func:`roles.federation_utility`) and a client ranks its own measured utility where it
  held the channel and that estimate elsewhere (:func:`roles.selection_scores`).
- Line 11's layer score normalises each client's signals over its whole network, not per
  layer, so that a layer whose channels matter more receives more budget
  (:func:`roles.layer_utility` says why).
- Role changes take the freshest copy. W_G and every group's Private vector carry, per
  coordinate, the round they were last aggregated. A client's Eq. 9 model takes its
  role's copy unless the other copy it can see (W_G, or its group's Private vector) was
  trained more recently: a channel turning Private starts from W_G when the group has
  not trained its Private copy since W_G last moved, and one turning Global starts from
  the group's Private copy when W_G is the older one (ties: the role's copy). Without
  this a channel turning Private loaded a copy last refreshed at the previous regrouping
  and one turning Global the W_G value from whenever it was last Global.
- The dispersion EMA starts at its first observation (:func:`roles.ema`).
- ``dga_source=probe`` (an addition; the default ``train`` is the paper's gradient after
  local training): on DGA rounds every client computes, before training, the gradient
  of one common sub-model (W_G at the channels every participating client holds) on a
  fixed seeded set of ``probe_samples`` of its own samples, and Eq. 4 compares those.
  The trained gradient is shaped by each client's own sub-model, so it groups clients
  by capacity as much as by domain; the probe runs the same model on every client, so
  only the data differ. The probe values a client does not already hold count in its
  bytes_down.

Readings beyond the paper text (documented, configurable where it matters):
- Warm-up rounds (``warmup``): every active channel Global; the first round's active
  channels are those with the largest filter L1 norms (no statistics yet).
- DGA rounds: t >= warmup and (t - warmup) % regroup_every == 0 (the first grouping
  closes the warm-up, then every R_d rounds). Each client's latest DGA gradient is kept,
  so partial participation still groups every client.
- On regrouping, each new group's Private parameters start as the sample-weighted mean
  of its members' current client models (Eq. 9), so no member's private knowledge is
  discarded by a relabelling.
- ``masks=fixed`` (the paper's reference configuration) freezes the tri-state masks
  computed at the end of warm-up.
- Evaluation (``eval_mode``): ``group`` evaluates each domain with W_G plus the Private
  parameters of the pseudo-group holding most of that domain's clients (ties: lowest
  group id), at the coordinates any member of that group holds as Private (where the
  Private copy is not older than W_G); ``global_only`` evaluates W_G alone.
- Records: ``n_reactivated`` (client-channels Dropped in a client's previous mask and
  active in its next one), ``n_role_switches`` (Global <-> Private), ``swap_share`` and
  ``swap_share_narrow`` (the share of a client's next-round active channels that are new)
  per round; per client ``n_new_channels`` (active channels it did not train last time).

Stable masks (``smoothing``, ``stability``, ``ranking``; docs/readings.md#stable-masks): a
narrow client's measured utilities are mostly noise, so ranking them afresh every round
swapped ~40% of its channels and it deployed sub-networks it never trained. ``smoothing=
statistics`` applies beta_EMA to each client's utilities and to the layer utilities too
(Appendix C: beta_EMA "smooth[s] channel statistics"); ``stability`` adds hysteresis or a
per-round swap budget to line 14's top-k; ``ranking=pooled`` ranks every client's channels
by the one federation estimate.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa

from fedsap_ray.aggregation import masked_weighted_average, scatter
from fedsap_ray.algorithms.base import CHANNEL_COUNT_COLUMNS, RunContext, Strategy
from fedsap_ray.algorithms.fedsap import budget, dga, roles
from fedsap_ray.algorithms.fedsap.dga import DGA_METHODS, DGA_MODES
from fedsap_ray.algorithms.fedsap.hooks import ChannelStatsHook, DGAProbe
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.algorithms.representation import RepresentationNorm
from fedsap_ray.algorithms.pruning import filter_l1_scores
from fedsap_ray.columns import Column
from fedsap_ray.data.base import EvalDomains
from fedsap_ray.errors import ConfigError
from fedsap_ray.masks import DROPPED, GLOBAL, PRIVATE, param_mask, tristate_param_masks
from fedsap_ray.messages import ClientPlan, ClientResult, ServerState
from fedsap_ray.seeding import rng_for, seed_for
from fedsap_ray.stats import dga_param_names

MASK_MODES = ("dynamic", "fixed")
SMOOTHING = ("dispersion", "statistics")
STABILITY = ("none", "hysteresis", "swap_budget")
RANKINGS = ("client", "pooled")
DGA_LAYERS = ("conv1", "layer1", "layer2", "layer3")
DGA_SOURCES = ("train", "probe")


@dataclass(frozen=True)
class FedSAPOptions(Strategy.Options):
    """Defaults: the paper's main adaptive configuration (papers/000 Appendix B Table 3, left)."""

    adaptive_layer_budget: int = 1  # 1: utility-driven layer budgets (Eq. 2); 0: the client's keep ratio in every layer
    temperature: float = 1.0  # softmax temperature over the layer utilities (Eq. 2)
    lambda_a: float = 0.5  # weight of the activation magnitude in a channel's utility (Eq. 5)
    lambda_g: float = 0.5  # weight of the gradient magnitude in a channel's utility (Eq. 5)
    g_target: float = 0.9  # least share of Global channels among a layer's active ones (Eq. 3)
    tau_var: float = 0.05  # dispersion threshold: an active channel above it is Private (Eq. 6)
    beta_ema: float = 0.5  # EMA coefficient of the dispersion (Eq. 6)
    gamma: float = 0.01  # weight of the representation regulariser gamma * ||f_enc(x)||^2 (Eq. 7)
    masks: str = "dynamic"  # dynamic: new masks every round; fixed: the masks of the end of warm-up, kept
    sgp: bool = True  # false: every active channel Global (a single aggregation path, no Private channels)
    # pseudo-groups: gradient (Eq. 4), none (one per client), oracle (true domains), random (matched sizes)
    dga: str = "gradient"
    dga_layer: str = "conv1"  # whose gradient DGA compares (papers/000 Table 2)
    dga_method: str = "components"  # components: connected components of the thresholded similarity; agglomerative
    tau_sim: float = 0.5  # cosine-similarity threshold of DGA (Eq. 4)
    warmup: int = 10  # rounds in which every active channel is Global; the first DGA closes the warm-up
    regroup_every: int = 5  # R_d, rounds between DGA regroupings
    dga_source: str = "train"  # train: the paper's gradient after local training; probe: see the module docstring
    probe_samples: int = 256  # samples per client in the probe gradient (dga_source=probe)
    # Stable masks (docs/readings.md#stable-masks). smoothing: what beta_ema smooths (dispersion: Eq. 6's d~
    # only; statistics: also each client's utilities and the layer utilities, Appendix C's "channel statistics")
    # Defaults from docs/studies/mask-stability.md (pooled-budget): the narrow clients' swaps 41% -> 9% a round,
    # worst client 59 -> 78, deployed 87 -> 92; the full-width best 86.5 -> 83.0 (within seed noise)
    smoothing: str = "statistics"
    stability: str = "swap_budget"  # none: top-n_l by score; hysteresis: a held channel leaves only for a margin
    margin: float = 0.1  # hysteresis: how much a candidate's utility must beat a held channel's to replace it
    swap_budget: float = 0.1  # swap_budget: most of a client's active channels that may change in one round
    ranking: str = "pooled"  # pooled: one shared ranking (the federation estimate); client: own utilities where held

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> None:
            raise ConfigError(f"invalid algorithm.{field}={getattr(self, field)!r}: {allowed}")

        if self.adaptive_layer_budget not in (0, 1):
            bad("adaptive_layer_budget", "allowed values are 0, 1")
        for f in ("g_target", "beta_ema"):
            if not 0 <= getattr(self, f) <= 1:
                bad(f, "must be in [0, 1]")
        if self.beta_ema == 1:
            bad("beta_ema", "must be in [0, 1)")
        for f in ("temperature",):
            if getattr(self, f) <= 0:
                bad(f, "must be > 0")
        for f in ("lambda_a", "lambda_g", "tau_var", "gamma", "margin"):
            if getattr(self, f) < 0:
                bad(f, "must be >= 0")
        if not -1 <= self.tau_sim <= 1:
            bad("tau_sim", "must be in [-1, 1] (a cosine similarity)")
        for f, choices in (("masks", MASK_MODES), ("dga", DGA_MODES), ("dga_layer", DGA_LAYERS),
                           ("dga_method", DGA_METHODS), ("dga_source", DGA_SOURCES), ("smoothing", SMOOTHING),
                           ("stability", STABILITY), ("ranking", RANKINGS)):
            if getattr(self, f) not in choices:
                bad(f, "allowed values are " + ", ".join(choices))
        if self.warmup < 0:
            bad("warmup", "must be an integer >= 0")
        if self.regroup_every < 1:
            bad("regroup_every", "must be an integer >= 1")
        if not 0 < self.swap_budget <= 1:
            bad("swap_budget", "must be in (0, 1] (a share of the client's active channels)")
        if self.probe_samples < 2:
            bad("probe_samples", "must be an integer >= 2")


class FedSAP(Strategy):
    Options = FedSAPOptions
    eval_modes = ("group", "global_only")
    columns = {
        "rounds": (
            Column("n_groups", pa.int64(), "FedSAP: pseudo-groups formed by DGA this round (null except on DGA rounds)"),
            Column("ari_capacity", pa.float64(),
                   "FedSAP: adjusted Rand index of the pseudo-groups vs. the capacity tiers (DGA rounds)"),
            Column("n_reactivated", pa.int64(),
                   "FedSAP: client-channels Dropped in a client's mask of this round and active in its next one"),
            Column("n_role_switches", pa.int64(),
                   "FedSAP: client-channels switching Global <-> Private between this round and the next"),
            Column("swap_share", pa.float64(),
                   "FedSAP: mean over clients of the share of next round's active channels not active this round"),
            Column("swap_share_narrow", pa.float64(),
                   "FedSAP: swap_share over the clients of the smallest keep ratio"),
        ),
        "clients": (Column("pseudo_group", pa.int64(), "FedSAP pseudo-domain group the client trained in"),
                    Column("n_new_channels", pa.int64(),
                           "FedSAP: active channels not active in the mask the client last trained under "
                           "(null on its first round)"),
                    *CHANNEL_COUNT_COLUMNS),
        "layers": (Column("n_global", pa.int64(), "Global channels"),
                   Column("n_private", pa.int64(), "Private channels"),
                   Column("n_dropped", pa.int64(), "Dropped channels")),
    }

    def __init__(self, ctx: RunContext, options: Any) -> None:
        super().__init__(ctx, options)
        if self.opts.dga != "none":
            try:
                dga_param_names(ctx.layout, self.opts.dga_layer)
            except ValueError as e:
                raise ConfigError(f"invalid algorithm.dga_layer={self.opts.dga_layer!r}: model {ctx.cfg.model.name} "
                                  f"has no such layer ({e}); use algorithm.dga=none on it") from None

    @classmethod
    def needs_oracle(cls, options: Any) -> bool:
        """``dga=oracle`` is a control that groups clients by their TRUE domains (ground truth a real
        server lacks): only such a run gets ``ctx.oracle``."""
        return getattr(options, "dga", None) == "oracle"

    # --- schedule -------------------------------------------------------------------
    def in_warmup(self, t: int) -> bool:
        return t <= self.opts.warmup

    def is_dga_round(self, t: int) -> bool:
        o = self.opts
        return o.dga != "none" and t >= max(o.warmup, 1) and (t - max(o.warmup, 1)) % o.regroup_every == 0

    # --- contract ---------------------------------------------------------------------
    def init_state(self) -> ServerState:
        state = super().init_state()
        fed, space = self.ctx.federation, self.ctx.space
        n = len(fed.clients)
        init_scores = filter_l1_scores(space, self.ctx.layout, state.params)
        channels = np.array([layer.channels for layer in space.layers])
        states = {}
        for c in fed.clients:
            counts = budget.layer_channel_counts(c.capacity, channels, adaptive=False)
            active = roles.select_active(init_scores, counts, space)
            states[c.client_id] = np.where(active, GLOBAL, DROPPED).astype(np.int8)
        state.extra = {
            "groups": np.zeros(n, dtype=np.int64) if self.opts.dga != "none" else np.arange(n),
            "private": {},  # group id -> full float32 vector (only its Private coordinates matter)
            "states": states,  # client -> int8 [channels], the masks of the next round
            "utility": {},  # client -> latest Eq. 5 utility
            "activation": {},  # client -> latest mean |activation| per channel
            "gradient": {},  # client -> latest channel gradient norm
            "measured_on": {},  # client -> channels it held active when it measured the above
            "estimate": None,  # federation utility estimate of every channel (NaN: never measured)
            "stamp_g": np.zeros(state.params.size, dtype=np.int32),  # round W_G last moved, per coordinate
            "stamp_p": {},  # group id -> the same for its Private vector
            "dga_grads": {},  # client -> latest DGA gradient
            "d_tilde": None,
            "frozen": False,
            "round_info": {},
            "layer_counts": {},  # client -> active channels per layer (for the layers table)
            "layer_u": None,  # the layer utilities U_l, EMA-smoothed under smoothing=statistics
        }
        if self.opts.dga == "none":
            state.extra["private"] = {int(k): state.params.copy() for k in range(n)}
            state.extra["stamp_p"] = {int(k): np.zeros(state.params.size, dtype=np.int32) for k in range(n)}
        return state

    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        ex = state.extra
        plans = {}
        dga_round = self.is_dga_round(t)
        probe = dga_round and self.opts.dga_source == "probe"
        stats = ("channel_activation", "channel_gradient") + (("dga_gradient",) if dga_round and not probe else ())
        clients = self.sample_clients(t)
        probe_mask = self._probe_mask(ex, clients) if probe else None
        probe_values = None if probe_mask is None else state.params[probe_mask]
        for cid in clients:
            st = ex["states"][cid]
            group = int(ex["groups"][cid])
            gmask, pmask = self._masks(st)
            active = gmask | pmask
            model, _, take_private = self._client_view(state, cid)
            hooks = [call(RepresentationNorm, gamma=float(self.opts.gamma)),
                     call(ChannelStatsHook, keys=stats, dga_layer=self.opts.dga_layer)]
            # for the server's own tables (client_columns, layer_rows); no client reads them
            extra: dict[str, Any] = {"states": st, "pseudo_group": group}
            last = ex["measured_on"].get(cid)
            extra["n_new_channels"] = None if last is None else int(((st != DROPPED) & ~last).sum())
            side_down = 0
            if probe_mask is not None:
                hooks.append(call(DGAProbe, mask=probe_mask, values=probe_values, samples=int(self.opts.probe_samples),
                                  seed=seed_for(self.cfg.seed, 0, cid, "dga-probe"),  # fixed per client
                                  dga_layer=self.opts.dga_layer))
                # the client already holds W_G's value where it trains a coordinate from W_G
                missing = probe_mask & ~(active & ~take_private)
                side_down = 4 * int(missing.sum()) + (probe_mask.size + 7) // 8
            plans[cid] = ClientPlan(
                values=model[active], mask=active, capacity_used=float((st != DROPPED).mean()),
                hooks=tuple(hooks), extra=extra, side_bytes_down=side_down,
                **self.plan_kwargs(t, cid),
            )
        return plans

    def _probe_mask(self, ex: dict, clients: list[int]) -> np.ndarray:
        """Parameter mask of the probe's common sub-model: the channels every client of the round holds.
        A layer nobody shares keeps its one best channel by the federation estimate (else the first),
        so the probe's forward pass never goes through an empty layer."""
        space = self.ctx.space
        common = np.logical_and.reduce([ex["states"][c] != DROPPED for c in clients])
        est = ex["estimate"]
        off = roles.layer_offsets(space)
        for i in range(len(space.layers)):
            seg = slice(off[i], off[i + 1])
            if not common[seg].any():
                score = np.nan_to_num(est[seg], nan=-np.inf) if est is not None else np.zeros(off[i + 1] - off[i])
                common[off[i] + int(np.argmax(score))] = True
        return param_mask(space, self.ctx.layout, roles.split(common, space))

    def client_model(self, state: ServerState, cid: int) -> np.ndarray:
        """Eq. 9: W_i = M_G ⊙ W_G + M_P ⊙ W_{pi(i),P} (full-size; uncovered coordinates from W_G),
        each active coordinate from the fresher of its two copies (module docstring)."""
        return self._client_view(state, cid)[0]

    def deployed_model(self, state: ServerState, cid: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Eq. 9's W_i at the client's active channels (M_G | M_P of its next-round states): the model
        it would train and run next."""
        gmask, pmask = self._masks(state.extra["states"][cid])
        return self.client_model(state, cid), gmask | pmask

    def _client_view(self, state: ServerState, cid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(Eq. 9 model, round each coordinate's value was last aggregated, where it comes from the
        group's Private vector)."""
        ex = state.extra
        gmask, pmask = self._masks(ex["states"][cid])
        k = int(ex["groups"][cid])
        private = ex["private"].get(k)
        stamp_g = ex["stamp_g"]
        if private is None:
            return state.params, stamp_g, np.zeros(stamp_g.size, dtype=bool)
        stamp_p = ex["stamp_p"][k]
        take = _private_is_fresher(pmask, gmask, stamp_p, stamp_g)
        if not take.any():
            return state.params, stamp_g, take
        return np.where(take, private, state.params), np.where(take, stamp_p, stamp_g), take

    def aggregate(self, state: ServerState, results: list[ClientResult], t: int) -> ServerState:
        ex = dict(state.extra)
        results = sorted(results, key=lambda r: r.client_id)
        size = self.ctx.layout.size
        glob_contrib: list[tuple[np.ndarray, np.ndarray, float]] = []
        priv_contrib: dict[int, list[tuple[np.ndarray, np.ndarray, float]]] = {}
        for r in results:
            gmask, pmask = self._masks(ex["states"][r.client_id])
            full = scatter(r.values, gmask | pmask, size)
            w = float(r.n_samples)
            glob_contrib.append((gmask, full[gmask], w))
            if pmask.any():
                priv_contrib.setdefault(int(ex["groups"][r.client_id]), []).append((pmask, full[pmask], w))
        params = masked_weighted_average(state.params, glob_contrib)  # Eq. 8, Global branch
        stamp_g = ex["stamp_g"].copy()
        stamp_g[np.logical_or.reduce([m for m, _, _ in glob_contrib])] = t
        private, stamp_p = dict(ex["private"]), dict(ex["stamp_p"])
        for k, contrib in priv_contrib.items():  # Eq. 8, Private branch, within group k
            private[k] = masked_weighted_average(private.get(k, state.params), contrib)
            stamp_p[k] = stamp_p.get(k, np.zeros_like(stamp_g)).copy()
            stamp_p[k][np.logical_or.reduce([m for m, _, _ in contrib])] = t
        new = ServerState(round=t, params=params, extra=ex)
        ex["private"], ex["stamp_g"], ex["stamp_p"] = private, stamp_g, stamp_p
        self._update_statistics(ex, results)
        info: dict[str, Any] = {}
        if self.is_dga_round(t):
            info = self._regroup(new, t)
        info.update(self._next_masks(new, t))
        ex["round_info"] = info
        return new

    # --- lines 8-17 ---------------------------------------------------------------------
    def _update_statistics(self, ex: dict, results: list[ClientResult]) -> None:
        space = self.ctx.space
        util, act, grads = dict(ex["utility"]), dict(ex["activation"]), dict(ex["dga_grads"])
        chan_grad, measured = dict(ex["gradient"]), dict(ex["measured_on"])
        beta = self.opts.beta_ema if self.opts.smoothing == "statistics" else 0.0
        for r in results:
            a, g = r.stats["channel_activation"], r.stats["channel_gradient"]
            act[r.client_id] = a.astype(np.float64)
            chan_grad[r.client_id] = g.astype(np.float64)
            held = ex["states"][r.client_id] != DROPPED  # the mask it trained under
            u = roles.utility(a, g, space, self.opts.lambda_a, self.opts.lambda_g)
            util[r.client_id] = roles.smooth_utility(util.get(r.client_id), measured.get(r.client_id), u, held,
                                                     ex["estimate"], beta)
            measured[r.client_id] = held
            if "dga_gradient" in r.stats:
                grads[r.client_id] = r.stats["dga_gradient"]
        ex["utility"], ex["activation"], ex["dga_grads"] = util, act, grads
        ex["gradient"], ex["measured_on"] = chan_grad, measured

    def _regroup(self, state: ServerState, t: int) -> dict[str, Any]:
        """DGA (Eq. 4): new pseudo-groups; new groups' Private sets from their members' models."""
        ex, fed, o = state.extra, self.ctx.federation, self.opts
        ids = sorted(ex["dga_grads"])
        old_groups = ex["groups"].copy()
        groups = old_groups.copy()
        if ids:
            grads = np.stack([ex["dga_grads"][i] for i in ids]).astype(np.float64)
            # random: the group sizes of the gradient grouping (a matched control); oracle: the true domains,
            # handed to this control explicitly (ctx.oracle, needs_oracle), never to the method itself
            oracle = self.ctx.oracle
            new = dga.assign_groups(o.dga, grads=grads, tau_sim=o.tau_sim, method=o.dga_method,
                                    domains=[oracle.client_domains[i] for i in ids] if oracle is not None else None,
                                    rng=rng_for(self.cfg.seed, t, -1, "dga-random") if o.dga == "random" else None)
            groups[np.array(ids)] = new
            groups = dga.canonical_labels(groups)
        members = {int(k): [c.client_id for c in fed.clients if groups[c.client_id] == k] for k in np.unique(groups)}
        private, stamp_p = {}, {}
        for k, mem in members.items():
            views = [self._client_view(state, i) for i in mem]
            models = [(None, v[0], float(fed.clients[i].n_samples)) for v, i in zip(views, mem)]
            private[k] = masked_weighted_average(state.params, models)
            stamp_p[k] = np.maximum.reduce([v[1] for v in views])  # the freshest value that went into it
        ex["private"], ex["stamp_p"], ex["groups"] = private, stamp_p, groups
        capacities = [c.capacity for c in fed.clients]  # ARI vs the true domains: the recorder's (client_groups)
        return {"n_groups": int(len(members)), "ari_capacity": dga.agreement(groups, capacities)}

    def _next_masks(self, state: ServerState, t: int) -> dict[str, int | float | None]:
        """Lines 11-17 for round t+1; returns how the masks moved (``n_reactivated``, ``n_role_switches``)."""
        ex, o, space, fed = state.extra, self.opts, self.ctx.space, self.ctx.federation
        if ex["frozen"]:
            return {"n_reactivated": 0, "n_role_switches": 0, "swap_share": 0.0, "swap_share_narrow": 0.0}
        channels = np.array([layer.channels for layer in space.layers])
        seen = sorted(ex["utility"])
        if not seen:
            return {}
        actives = [ex["measured_on"][i] for i in seen]
        weights = np.array([fed.clients[i].n_samples for i in seen], dtype=np.float64)
        warm = self.in_warmup(t + 1)  # masks for round t+1
        if not warm:
            d = roles.dispersion([ex["activation"][i] for i in seen], actives, ex["groups"][np.array(seen)])
            ex["d_tilde"] = roles.ema(ex["d_tilde"], d, o.beta_ema)
        ex["estimate"] = roles.federation_utility(ex["estimate"], [ex["utility"][i] for i in seen], actives, weights)
        layer_u = roles.layer_utility([ex["activation"][i] for i in seen], [ex["gradient"][i] for i in seen],
                                      actives, weights, space, self._entries_per_channel, o.lambda_a, o.lambda_g)
        if o.smoothing == "statistics":  # Appendix C: the layer scores are channel statistics too
            layer_u = ex["layer_u"] = roles.ema(ex["layer_u"], layer_u, o.beta_ema)
        states, counts_by_client = dict(ex["states"]), dict(ex["layer_counts"])
        reactivated = switches = 0
        shares: dict[float, list[float]] = {}
        for c in fed.clients:
            if c.client_id not in ex["utility"]:
                continue  # no statistics yet: keep its initial mask
            counts = budget.layer_channel_counts(c.capacity, channels, layer_u, temperature=o.temperature,
                                                 adaptive=bool(o.adaptive_layer_budget))
            old = states[c.client_id]
            active = self._select(ex, c.client_id, old != DROPPED, counts)
            if warm:
                st = np.where(active, GLOBAL, DROPPED).astype(np.int8)
            else:
                st = roles.assign_roles(active, ex["d_tilde"], space, tau_var=o.tau_var, g_target=o.g_target,
                                        sgp=o.sgp)
            reactivated += int(((old == DROPPED) & (st != DROPPED)).sum())
            shares.setdefault(c.capacity, []).append(float((active & (old == DROPPED)).sum() / max(active.sum(), 1)))
            switches += int((((old == GLOBAL) & (st == PRIVATE)) | ((old == PRIVATE) & (st == GLOBAL))).sum())
            states[c.client_id] = st
            counts_by_client[c.client_id] = counts
        ex["states"], ex["layer_counts"] = states, counts_by_client
        if o.masks == "fixed" and not warm:
            ex["frozen"] = True
        every = [x for v in shares.values() for x in v]
        return {"n_reactivated": reactivated, "n_role_switches": switches,
                "swap_share": float(np.mean(every)) if every else None,
                "swap_share_narrow": float(np.mean(shares[min(shares)])) if shares else None}

    def _select(self, ex: dict, cid: int, held: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Line 14 under the ``ranking`` and ``stability`` options (docs/readings.md#stable-masks)."""
        o, space = self.opts, self.ctx.space
        # pooled: every client ranks by the one federation estimate (FedMP's shared ranking), its own
        # measurements entering only through that estimate
        on = ex["measured_on"][cid] if o.ranking == "client" else np.zeros_like(held)
        scores = roles.selection_scores(ex["utility"][cid], on, ex["estimate"], space)
        if o.stability == "none":
            return roles.select_active(scores, counts, space)
        if o.stability == "hysteresis":
            return roles.stable_select(scores, held, counts, space, margin=o.margin)
        return roles.stable_select(scores, held, counts, space,
                                   max_swaps=roles.swap_limit(o.swap_budget, int(np.sum(counts))))

    @cached_property
    def _entries_per_channel(self) -> np.ndarray:
        """Per layer, the gradient-carrying entries one channel owns (filters, biases, BN affine)."""
        layout = self.ctx.layout
        sizes = {n: int(np.prod(s)) for n, s, p in zip(layout.names, layout.shapes, layout.is_param) if p}
        return np.array([sum(sizes.get(ax.name, 0) for ax in layer.out) / layer.channels for layer in self.ctx.space.layers])

    # --- masks and records -------------------------------------------------------------
    def _masks(self, st: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(Global, Private) parameter masks of a tri-state channel vector; memoised on its bytes."""
        return self.memo("tristate_masks", st.tobytes(), lambda: tristate_param_masks(
            self.ctx.space, self.ctx.layout, roles.split(st, self.ctx.space)), maxsize=256)

    def eval_sets(self, state: ServerState, domains: EvalDomains) -> dict[str, dict[str, np.ndarray]]:
        """``group``: each test domain gets the model of the group most of its clients are in (which
        clients those are is evaluation-only ground truth, ``domains``); ``global_only``: W_G."""
        fed, ex = self.ctx.federation, state.extra
        groups = ex["groups"]
        group_models: dict[int, np.ndarray] = {}
        out: dict[str, np.ndarray] = {}
        for d in domains.names:
            ids = list(domains.members[d])
            k = int(np.bincount(groups[ids]).argmax()) if ids else 0
            if k not in group_models:
                private = ex["private"].get(k)
                model = state.params
                if private is not None:
                    pm = np.zeros(self.ctx.layout.size, dtype=bool)
                    for c in fed.clients:
                        if groups[c.client_id] == k:
                            pm |= self._masks(ex["states"][c.client_id])[1]
                    take = _private_is_fresher(pm, None, ex["stamp_p"][k], ex["stamp_g"])
                    if take.any():
                        model = np.where(take, private, state.params)
                group_models[k] = model
            out[d] = group_models[k]
        return {"group": out, "global_only": {d: state.params for d in domains.names}}

    def round_columns(self, state: ServerState) -> dict[str, Any]:
        return dict(state.extra.get("round_info") or {})

    def client_groups(self, state: ServerState) -> np.ndarray | None:
        """The pseudo-groups, on the rounds DGA formed them (the recorder's ``ari_domain``)."""
        return state.extra["groups"] if (state.extra.get("round_info") or {}).get("n_groups") is not None else None

    def progress_text(self, round_columns: dict[str, Any]) -> str:
        """DGA's groups (with the recorder's ARI vs the true domains) and how the masks moved."""
        c = round_columns
        dga_text = motion = ""
        if c.get("n_groups") is not None:
            dga_text = (f"  DGA {c['n_groups']} groups (ARI domains {c['ari_domain']:.2f}, "
                        f"capacities {c['ari_capacity']:.2f})")
        if c.get("n_reactivated") is not None:
            motion = f"  masks +{c['n_reactivated']} back, {c['n_role_switches']} G<->P"
        if c.get("swap_share") is not None:
            motion += f", swap {c['swap_share']:.0%} (narrowest {c['swap_share_narrow']:.0%})"
        return dga_text + motion

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """The pseudo-group the client trained in and its channels by role (from the plan's tri-state masks)."""
        return {"pseudo_group": plan.extra["pseudo_group"], "n_new_channels": plan.extra["n_new_channels"],
                **roles.role_counts(plan.extra["states"])}

    def layer_rows(self, state: ServerState, plans: dict[int, ClientPlan]) -> list[dict[str, Any]]:
        """Where each client's budget went this round: one row per (client, layer)."""
        rows = []
        space = self.ctx.space
        for cid, plan in plans.items():
            st = roles.split(plan.extra["states"], space)
            for layer in space.layers:
                s = st[layer.name]
                rows.append(dict(client_id=cid, layer=layer.name, channels=layer.channels,
                                 keep_ratio=float((s != DROPPED).mean()), n_global=int((s == GLOBAL).sum()),
                                 n_private=int((s == PRIVATE).sum()), n_dropped=int((s == DROPPED).sum())))
        return rows


def _private_is_fresher(pmask: np.ndarray, gmask: np.ndarray | None, stamp_p: np.ndarray,
                        stamp_g: np.ndarray) -> np.ndarray:
    """Where a model takes the group's Private copy rather than W_G (module docstring, role changes):
    on Private coordinates unless W_G was trained more recently, on Global ones only when the Private
    copy was (ties: the role's copy)."""
    take = pmask & (stamp_p >= stamp_g)
    return take if gmask is None else take | (gmask & (stamp_p > stamp_g))
