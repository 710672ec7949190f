"""FedSAP (papers/000, Algorithm 1): adaptive layer budgets, tri-state masks, DGA, SGP,
type-matched aggregation, client-specific models.

Round t, for the participating clients (Algorithm 1), one job per module of this package:
- configure (line 3, here): client i gets the Eq. 9 model W_i = M_G ⊙ W_G + M_P ⊙ W_{pi(i),P}
  (:func:`state.client_view`) at its active coordinates, its tri-state mask, and the Eq. 7
  regulariser weight gamma; it uploads channel activation / gradient statistics (line 6,
  :mod:`stats`, :mod:`hooks`), plus the ``dga_layer`` gradient on DGA rounds.
- aggregate (line 18, Eq. 8: :mod:`aggregation`): Global coordinates over the clients holding them
  as Global, Private ones within the client's pseudo-group; Dropped ones keep their value.
- then the server prepares round t+1 (lines 8-17, :mod:`schedule`): DGA regrouping on DGA rounds
  (Eq. 4, :mod:`dga`), utilities (Eq. 5), layer budgets (Eq. 2, :mod:`budget`), top-k active channels,
  EMA dispersion (Eq. 6) and roles with the g_target floor (Eq. 3, :mod:`roles`).
- records: ``aggregate`` returns the round's rows (:class:`~fedsap_ray.common.messages.RoundRecords`): the
  groups DGA formed, how the masks moved, each client's pseudo-group and channels by role.

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
- Role changes take the freshest copy (:mod:`state`): a channel turning Private starts from W_G
  when the group has not trained its Private copy since W_G last moved, and one turning Global
  starts from the group's Private copy when W_G is the older one (ties: the role's copy).
- The dispersion EMA starts at its first observation (:func:`roles.ema`).
- ``dga_source=probe`` (an addition, and the default since the mask-stability study, where it beat the
  paper's ``train`` signal, the gradient after local training, on the deployed models and recovered
  the domains better: ARI 0.29 against 0.06, docs/studies/mask-stability.md; ``fedsap_fixed`` keeps
  ``train``): on DGA rounds every client computes, before training, the gradient
  of one common sub-model (W_G at the channels every participating client holds) on a
  fixed seeded set of ``probe_samples`` of its own samples, and Eq. 4 compares those.
  The trained gradient is shaped by each client's own sub-model, so it groups clients
  by capacity as much as by domain; the probe runs the same model on every client, so
  only the data differ. The probe values a client does not already hold count in its
  bytes_down.

Readings beyond the paper text (documented, configurable where it matters):
- Warm-up rounds (``warmup``): every active channel Global; the first round's active
  channels are those with the largest filter L1 norms (no statistics yet).
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

from collections.abc import Mapping
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa

from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.algorithms.records import CHANNEL_COUNT_COLUMNS, client_records
from fedsap_ray.algorithms.fedsap import aggregation, budget, roles, schedule
from fedsap_ray.algorithms.fedsap.hooks import ChannelStatsHook, DGAProbe
from fedsap_ray.algorithms.fedsap.options import FedSAPOptions
from fedsap_ray.algorithms.fedsap.state import FedSAPState, client_overlay, client_view, private_is_fresher
from fedsap_ray.algorithms.fedsap.stats import dga_param_names
from fedsap_ray.algorithms.fedsap.tristate import DROPPED, GLOBAL, PRIVATE, tristate_param_masks
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.algorithms.representation import RepresentationNorm
from fedsap_ray.algorithms.schedule import plan_settings
from fedsap_ray.algorithms.pruning import filter_l1_scores
from fedsap_ray.common.columns import Column
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.data.base import EvalDomains
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.models.masks import param_mask
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundOutput, RoundRecords, ServerState
from fedsap_ray.common.seeding import rng_for, seed_for

__all__ = ["FedSAP", "FedSAPOptions", "FedSAPState"]


class FedSAP(Strategy):
    Options = FedSAPOptions
    State = FedSAPState
    state_vectors = ("private", "stamp_g", "stamp_p")  # per-coordinate: the groups' Private copies and their stamps
    # smoke: a warm-up shorter than the run and a DGA regrouping every round, so every mechanism runs;
    # laptop: warm-up 5 and regrouping every 5 of its 25 rounds
    preset_options = {"smoke": {"warmup": 1, "regroup_every": 1}, "laptop": {"warmup": 5, "regroup_every": 5}}
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
                   "FedSAP: swap_share over the clients of the smallest capacity"),
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
    def privacy_support(cls, options: Any) -> str | None:
        """Refused by name: each client's mask and role come from the channel statistics it uploads (line 6) and its
        pseudo-group from its DGA gradient, data-dependent releases no mechanism of ours covers yet
        (docs/readings.md#privacy)."""
        return ("its masks, roles and pseudo-groups are chosen from the channel statistics and DGA gradients each "
                "client uploads (Algorithm 1 line 6), which no mechanism here covers (docs/readings.md#privacy)")

    @classmethod
    def needs_oracle(cls, options: Any) -> bool:
        """``dga=oracle`` is a control that groups clients by their TRUE domains (ground truth a real
        server lacks): only such a run gets ``ctx.oracle``."""
        return getattr(options, "dga", None) == "oracle"

    def in_warmup(self, t: int) -> bool:
        return schedule.in_warmup(self.opts, t)

    def is_dga_round(self, t: int) -> bool:
        return schedule.is_dga_round(self.opts, t)

    # --- contract ---------------------------------------------------------------------
    def init_state(self) -> ServerState:
        state = super().init_state()
        fed, space = self.ctx.federation, self.ctx.space
        n = len(fed.clients)
        init_scores = filter_l1_scores(space, self.ctx.layout, state.params)
        channels = np.array([layer.channels for layer in space.layers])
        # a client's first mask depends only on its capacity: one array per distinct capacity, shared by the
        # clients that have it (read-only: masks are replaced, never edited) and stored once in a checkpoint
        # (treecodec keeps aliasing); computed per client it grew with the federation (issue 29;
        # docs/guides/performance.md)
        first: dict[float, np.ndarray] = {}
        for kappa in sorted({c.capacity for c in fed.clients}):
            counts = budget.layer_channel_counts(kappa, channels, adaptive=False)
            first[kappa] = np.where(roles.select_active(init_scores, counts, space), GLOBAL, DROPPED).astype(np.int8)
            first[kappa].flags.writeable = False
        states = {c.client_id: first[c.capacity] for c in fed.clients}
        # dga=none: one group per client. Its Private vector is created when the client first trains one
        # (aggregation.type_matched starts it from W_G), not here: a copy of W_G per client made up front
        # reads the same everywhere (client_view and eval_sets read W_G for a group without one, and a
        # coordinate never aggregated as Private keeps W_G's initial value either way) but costs N x P
        # floats of memory and checkpoint, which a large federation cannot afford (issue 29; docs/guides/large-sweeps.md).
        alone = self.opts.dga == "none"
        state.strategy_state = FedSAPState(
            groups=np.arange(n) if alone else np.zeros(n, dtype=np.int64), private={},
            states=states, utility={}, activation={}, gradient={}, measured_on={}, estimate=None,
            stamp_g=np.zeros(state.params.size, dtype=np.int32), stamp_p={},
            dga_grads={}, d_tilde=None, frozen=False, layer_counts={}, layer_u=None)
        return state

    def assigned_width(self, plan: ClientPlan) -> float:
        """The client's capacity kappa_i = 1 - rho_i, which its channel budget is drawn from
        (:meth:`Strategy.assigned_width`; ``capacity_used`` is the share of channels its roles keep)."""
        return min(float(self.ctx.federation.clients[plan.client_id].capacity), 1.0)

    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        st: FedSAPState = state.strategy_state
        plans = {}
        dga_round = self.is_dga_round(t)
        probe = dga_round and self.opts.dga_source == "probe"
        stats = ("channel_activation", "channel_gradient") + (("dga_gradient",) if dga_round and not probe else ())
        clients = self.sampler.sample(t)
        probe_mask = self._probe_mask(st, clients) if probe else None
        probe_values = None if probe_mask is None else state.params[probe_mask]
        for cid in clients:
            states = st.states[cid]
            gmask, pmask = self._masks(states)
            active = gmask | pmask
            overlay, take_private = client_overlay(state, cid, self._masks)
            hooks = [call(RepresentationNorm, gamma=float(self.opts.gamma)),
                     call(ChannelStatsHook, keys=stats, dga_layer=self.opts.dga_layer)]
            side_down = 0
            if probe_mask is not None:
                hooks.append(call(DGAProbe, mask=probe_mask, values=probe_values, samples=int(self.opts.probe_samples),
                                  seed=seed_for(self.cfg.seed, 0, cid, "dga-probe"),  # fixed per client
                                  dga_layer=self.opts.dga_layer))
                # the client already holds W_G's value where it trains a coordinate from W_G
                missing = probe_mask & ~(active & ~take_private)
                side_down = 4 * int(missing.sum()) + (probe_mask.size + 7) // 8
            plans[cid] = ClientPlan(
                # Eq. 9's W_i: W_G overlaid with the group's Private vector (shared vectors, nothing copied)
                params=state.params, overlay=overlay, mask=active, capacity_used=float((states != DROPPED).mean()),
                hooks=tuple(hooks), side_bytes_down=side_down,
                **plan_settings(self.cfg, t, cid),
            )
        return plans

    def _probe_mask(self, st: FedSAPState, clients: list[int]) -> np.ndarray:
        """Parameter mask of the probe's common sub-model: the channels every client of the round holds.
        A layer nobody shares keeps its one best channel by the federation estimate (else the first),
        so the probe's forward pass never goes through an empty layer."""
        space = self.ctx.space
        common = np.logical_and.reduce([st.states[c] != DROPPED for c in clients])
        est = st.estimate
        off = roles.layer_offsets(space)
        for i in range(len(space.layers)):
            seg = slice(off[i], off[i + 1])
            if not common[seg].any():
                score = np.nan_to_num(est[seg], nan=-np.inf) if est is not None else np.zeros(off[i + 1] - off[i])
                common[off[i] + int(np.argmax(score))] = True
        return param_mask(space, self.ctx.layout, roles.split(common, space))

    def client_model(self, state: ServerState, cid: int) -> np.ndarray:
        """Eq. 9: W_i = M_G ⊙ W_G + M_P ⊙ W_{pi(i),P} (full-size; uncovered coordinates from W_G),
        each active coordinate from the fresher of its two copies (:mod:`fedsap_ray.algorithms.fedsap.state`)."""
        return self._client_view(state, cid)[0]

    def deployed_model(self, state: ServerState, cid: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Eq. 9's W_i at the client's active channels (M_G | M_P of its next-round states): the model
        it would train and run next."""
        gmask, pmask = self._masks(state.strategy_state.states[cid])
        return self.client_model(state, cid), gmask | pmask

    def _client_view(self, state: ServerState, cid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return client_view(state, cid, self._masks)

    def aggregate(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                  t: int) -> RoundOutput:
        """Eq. 8 (line 18), the statistics of line 6, then lines 8-17 for round t+1; the round's records."""
        results = sorted(results, key=lambda r: r.client_id)
        old: FedSAPState = state.strategy_state
        params, st = aggregation.type_matched(state.params, old, results, self._masks, t)
        aggregation.update_statistics(st, results, self.ctx.space, self.opts)
        new = ServerState(round=t, params=params, strategy_state=st)
        info: dict[str, Any] = {}
        dga_round = self.is_dga_round(t)
        if dga_round:
            rng = rng_for(self.cfg.seed, t, -1, "dga-random") if self.opts.dga == "random" else None
            info = schedule.regroup(st, params, lambda i: self._client_view(new, i)[:2], self.ctx, self.opts, rng)
        info.update(schedule.next_masks(st, t, self.ctx, self.opts, self._entries_per_channel))
        records = RoundRecords(rounds=info, clients=self._client_rows(new, old, plans, results),
                               layers=self._layer_rows(old, plans), groups=st.groups if dga_round else None,
                               progress=progress_template(info))
        return RoundOutput(new, records)

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
        fed, st = self.ctx.federation, state.strategy_state
        groups = st.groups
        group_models: dict[int, np.ndarray] = {}
        out: dict[str, np.ndarray] = {}
        for d in domains.names:
            ids = list(domains.members[d])
            k = int(np.bincount(groups[ids]).argmax()) if ids else 0
            if k not in group_models:
                private = st.private.get(k)
                model = state.params
                if private is not None:
                    pm = np.zeros(self.ctx.layout.size, dtype=bool)
                    for c in fed.clients:
                        if groups[c.client_id] == k:
                            pm |= self._masks(st.states[c.client_id])[1]
                    take = private_is_fresher(pm, None, st.stamp_p[k], st.stamp_g)
                    if take.any():
                        model = np.where(take, private, state.params)
                group_models[k] = model
            out[d] = group_models[k]
        return {"group": out, "global_only": {d: state.params for d in domains.names}}

    def _client_rows(self, new: ServerState, old: FedSAPState, plans: Mapping[int, ClientPlan],
                     results: list[ClientResult]) -> dict[int, dict[str, Any]]:
        """What each client spent, the pseudo-group it trained in and its channels by role (the masks it
        trained under: ``old``, the state the round started from)."""
        rows = client_records(self, new, plans, results)
        for cid, row in rows.items():
            states, last = old.states[cid], old.measured_on.get(cid)
            row.update(pseudo_group=int(old.groups[cid]), **roles.role_counts(states),
                       n_new_channels=None if last is None else int(((states != DROPPED) & ~last).sum()))
        return rows

    def _layer_rows(self, old: FedSAPState, plans: Mapping[int, ClientPlan]) -> list[dict[str, Any]]:
        """Where each client's budget went this round: one row per (client, layer)."""
        rows = []
        space = self.ctx.space
        for cid in plans:
            st = roles.split(old.states[cid], space)
            for layer in space.layers:
                s = st[layer.name]
                rows.append(dict(client_id=cid, layer=layer.name, channels=layer.channels,
                                 keep_ratio=float((s != DROPPED).mean()), n_global=int((s == GLOBAL).sum()),
                                 n_private=int((s == PRIVATE).sum()), n_dropped=int((s == DROPPED).sum())))
        return rows


def progress_template(info: Mapping[str, Any]) -> str:
    """The progress line's template: DGA's groups (with the recorder's ARI vs the true domains) and how the
    masks moved (``RoundRecords.progress``)."""
    text = ""
    if info.get("n_groups") is not None:
        text = "  DGA {n_groups} groups (ARI domains {ari_domain:.2f}, capacities {ari_capacity:.2f})"
    if info.get("n_reactivated") is not None:
        text += "  masks +{n_reactivated} back, {n_role_switches} G<->P"
    if info.get("swap_share") is not None:
        text += ", swap {swap_share:.0%} (narrowest {swap_share_narrow:.0%})"
    return text
