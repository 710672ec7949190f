"""Sub-model training with coordinate-wise aggregation (papers/003 Algorithms 1-2).

Every sub-model strategy trains, on client i in round t, the sub-network spanned by a
set of channels per layer and lets the server average each coordinate over the
clients that trained it. :class:`SubModelStrategy` holds that shared machinery; a
subclass only says which channels a client trains (:meth:`SubModelStrategy.channel_masks`):

- nested widths (:class:`NestedWidth`: HeteroFL, FjORD, Uniform, HAS-FL, Random-budget
  and heterogeneous FedAvg): client i trains the leading ceil(p_i C_l) channels of every
  layer with their input connections (Algorithm 2, :func:`fedsap_ray.masks.nested_channel_masks`);
- arbitrary channel subsets (FedDrop's random subsets, FedMP's largest-L1 filters,
  NeFL's depth-and-width nested sub-models), turned into parameter masks by
  :func:`fedsap_ray.masks.param_mask`; the classifier's output units (and the LSTM's
  embedding) are always shared in full.

Aggregation is Algorithm 1 line 18: each coordinate is averaged over exactly the clients
that trained it, weighted by sample counts; coordinates nobody trained keep their value
(:func:`fedsap_ray.aggregation.masked_weighted_average`). Masks are pure functions of
(state the round starts from, client, round), so :meth:`SubModelStrategy.aggregate`
recomputes them instead of keeping them between calls. Client sampling, learning-rate
decay and clipping come from :class:`Strategy`.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np
import pyarrow as pa

from fedsap_ray.aggregation import masked_weighted_average
from fedsap_ray.algorithms.base import CHANNEL_COUNT_COLUMNS, Strategy
from fedsap_ray.columns import Column
from fedsap_ray.masks import ChannelMasks, nested_channel_masks, param_mask
from fedsap_ray.messages import ClientPlan, ClientResult, ServerState
from fedsap_ray.models import model_macs

MASK_CACHE = 32  # sub-model masks kept per run (a HAS-FL run sees many distinct widths)


class SubModelStrategy(Strategy):
    """Base of every sub-model strategy: a subclass chooses each client's channels per (state, client, round)."""

    track_allocations = False  # write the ``allocations`` table (nested widths only)
    columns = {"clients": CHANNEL_COUNT_COLUMNS}

    @abstractmethod
    def channel_masks(self, state: ServerState, client_id: int, t: int) -> ChannelMasks | None:
        """Per channel layer, the channels client ``client_id`` trains in round t (None: the full model).

        ``state`` is the server state the round starts from; the result must be a pure
        function of (state, client, round) so aggregation can recompute it.
        """

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict[str, Any]:
        """Strategy-specific ClientPlan fields (FedProx's mu)."""
        return {}

    def coverage(self, cmasks: ChannelMasks) -> np.ndarray:
        """Parameter mask of a channel mask (the coverage rule of :mod:`fedsap_ray.masks`)."""
        return param_mask(self.ctx.space, self.ctx.layout, cmasks)

    def sub_model(self, state: ServerState, client_id: int, t: int) -> tuple[np.ndarray | None, int, float]:
        """(parameter mask or None for the full model, active channels, capacity_used) of the round-t sub-model.

        capacity_used is the fraction of all channels the client trains (the ``clients`` table,
        docs/reference/results.md#clients).
        """
        total = self.ctx.space.total_channels
        cmasks = self.channel_masks(state, client_id, t)
        if cmasks is None:
            return None, total, 1.0
        active = int(sum(int(np.count_nonzero(m)) for m in cmasks.values()))
        return self.coverage(cmasks), active, active / total

    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        plans: dict[int, ClientPlan] = {}
        for cid in self.sample_clients(t):
            mask, _, used = self.sub_model(state, cid, t)
            values = state.params if mask is None else state.params[mask]  # full: shared, never mutated
            plans[cid] = ClientPlan(
                values=values, mask=mask, capacity_used=float(used),
                **self.plan_kwargs(t, cid), **self.extra_plan_fields(state, cid, t),
            )
        return plans

    def active_channels(self, plan: ClientPlan) -> int:
        """Channels the plan trains: capacity_used is active / total here (:meth:`sub_model`), so exact."""
        return int(round(plan.capacity_used * self.ctx.space.total_channels))

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """Channel counts: every trained channel is shared (Global); none is Private."""
        active = self.active_channels(plan)
        return {"n_global": active, "n_private": 0, "n_dropped": self.ctx.space.total_channels - active}

    def aggregate(self, state: ServerState, results: list[ClientResult], t: int) -> ServerState:
        """Algorithm 1 lines 17-19 (:meth:`merge`), then :meth:`after_aggregate` (HAS-FL's adaptation step)."""
        ordered = sorted(results, key=lambda r: r.client_id)
        masks = {r.client_id: self.client_mask(state, r.client_id, t) for r in ordered}
        params = self.merge(state, ordered, masks)
        extra = self.after_aggregate(state, params, ordered, masks, t)
        return ServerState(round=t, params=params, extra=extra)

    def merge(self, state: ServerState, results: list[ClientResult], masks: dict[int, np.ndarray | None]) -> np.ndarray:
        """Algorithm 1 line 18: each coordinate's sample-weighted mean over the clients that trained it."""
        return masked_weighted_average(state.params, [(masks[r.client_id], r.values, float(r.n_samples)) for r in results])

    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> dict[str, Any]:
        """The next state's ``extra``; static allocation rules keep none."""
        return state.extra

    def client_mask(self, state: ServerState, client_id: int, t: int) -> np.ndarray | None:
        """The client's round-t parameter mask (None: full model), recomputed from the pure rule."""
        return self.sub_model(state, client_id, t)[0]

    def deployed_model(self, state: ServerState, client_id: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The sub-model the client would receive in the next round: its width (nested), its pruned
        filters (FedMP), its next random draw (FedDrop), from the global model ``state`` holds. Masks are
        pure in (state, client, round), so this is exactly the next round's plan, whether or not the
        client is sampled then."""
        return state.params, self.sub_model(state, client_id, state.round + 1)[0]


class NestedWidth(SubModelStrategy):
    """Base of the nested-width strategies: a subclass chooses p_i per (client, round) (Algorithm 2)."""

    track_allocations = True  # write the ``allocations`` table (every client's width each round)
    columns = {"allocations": (
        Column("p", pa.float64(), "width assigned to the client for this round (what it trains if sampled)"),
        Column("adapted", pa.bool_(), "an adaptation step (new allocations) happened at the end of this round"),
    )}

    @abstractmethod
    def width_for(self, state: ServerState, client_id: int, t: int) -> float:
        """p_i: the fraction of every layer's channels client ``client_id`` trains in round t.

        ``state`` is the server state the round starts from; the width must be a pure
        function of (state, client, round) so aggregation can recompute the masks.
        """

    def channel_masks(self, state: ServerState, client_id: int, t: int) -> ChannelMasks | None:
        """The leading ceil(p_i C_l) channels of every layer (None at p_i >= 1)."""
        p = self.width_for(state, client_id, t)
        return None if p >= 1.0 else nested_channel_masks(self.ctx.space, p)

    def sub_model(self, state: ServerState, client_id: int, t: int) -> tuple[np.ndarray | None, int, float]:
        """The width-p nested sub-model from the LRU cache; capacity_used is p_i itself."""
        p = self.width_for(state, client_id, t)
        if p >= 1.0:
            return None, self.ctx.space.total_channels, 1.0
        mask, active = self.nested_mask(p)
        return mask, active, min(float(p), 1.0)

    def round_widths(self, state: ServerState, t: int) -> np.ndarray:
        """Every client's round-t width, given the state AFTER round t (stateless rules ignore it)."""
        return np.array([self.width_for(state, cid, t) for cid in range(len(self.ctx.federation.clients))])

    def allocation_rows(self, state: ServerState, t: int) -> list[dict[str, Any]]:
        if not self.track_allocations:
            return []
        widths = self.round_widths(state, t)
        return [dict(client_id=c.client_id, capacity_max=float(c.capacity), p=float(min(widths[c.client_id], 1.0)),
                     adapted=bool(state.extra.get("adapted", False)),
                     **self.estimate_columns(state, c.client_id))
                for c in self.ctx.federation.clients]

    def estimate_columns(self, state: ServerState, client_id: int) -> dict[str, Any]:
        """h_hat / h_tilde of a client (HAS-FL); none for static rules."""
        return {}

    def active_channels(self, plan: ClientPlan) -> int:
        """Channels of the width-p sub-model (capacity_used is p itself here, :meth:`sub_model`)."""
        p = plan.capacity_used
        return self.ctx.space.total_channels if p >= 1.0 else self.nested_mask(p)[1]

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        return {**super().client_columns(state, plan, result), "macs_per_sample": self.macs(plan.capacity_used),
                **self.estimate_columns(state, plan.client_id)}

    def train_macs(self, plan: ClientPlan, result: ClientResult) -> int:
        """One forward pass of the width-p sub-model per sample seen (:meth:`Strategy.train_macs`)."""
        return int(result.samples_seen) * self.macs(plan.capacity_used)

    # --- memoised sub-model geometry (pure in the per-layer channel counts) -------------
    def macs(self, p: float) -> int:
        """Multiply-accumulates per sample of the width-p sub-model (papers/003 Table 1)."""
        return self.memo("nested_macs", self._counts(p), lambda: int(model_macs(
            self.ctx.model, self.ctx.federation.input_shape, None if p >= 1.0 else nested_channel_masks(self.ctx.space, p))))

    def nested_mask(self, p: float) -> tuple[np.ndarray, int]:
        """(parameter mask, active channels) of the width-p nested sub-model (Algorithm 2); LRU-cached."""
        def compute() -> tuple[np.ndarray, int]:
            cmasks = nested_channel_masks(self.ctx.space, p)
            return param_mask(self.ctx.space, self.ctx.layout, cmasks), int(sum(int(m.sum()) for m in cmasks.values()))

        return self.memo("nested_mask", self._counts(p), compute, maxsize=MASK_CACHE)

    def _counts(self, p: float) -> tuple[int, ...]:
        return tuple(int(m.sum()) for m in nested_channel_masks(self.ctx.space, min(p, 1.0)).values())
