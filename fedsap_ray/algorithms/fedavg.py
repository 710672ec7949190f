"""FedAvg (McMahan et al. 2017) at the root of every method that averages what its clients trained.

``width=full``: every client trains the whole model (the papers' full-model baseline).
``width=capacity``: every client trains the nested sub-model at its own capacity (leading
ceil(kappa_i * C_l) channels of every layer, papers/003 Algorithm 2), the HeteroFL rule (also
registered as ``heterofl``).

:class:`FedAvg` is also the base the other methods build on. The width a client trains is the
composed rule :attr:`FedAvg.width` (:mod:`fedsap_ray.algorithms.widths`: full, capacity, capped,
random tier, HAS-FL's allocation); a method with its own client objective (FedProx, MOON, FedSR,
FPL) keeps the full rule, a nested-width method (HeteroFL, FjORD, Uniform, HAS-FL) holds its own,
and methods of arbitrary channel subsets extend :class:`~fedsap_ray.algorithms.channel_subsets.ChannelSubsetStrategy`.

Aggregation is papers/003 Algorithm 1 line 18: each coordinate is averaged over exactly the
clients that trained it, weighted by sample counts; coordinates nobody trained keep their value
(:func:`fedsap_ray.algorithms.aggregation.masked_weighted_average`). With the full rule that is FedAvg's
sample-weighted mean. Masks are pure functions of (state the round starts from, client, round),
so the deployed model recomputes next round's instead of keeping it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from fedsap_ray.algorithms.aggregation import masked_weighted_average
from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.algorithms.records import CHANNEL_COUNT_COLUMNS, client_records
from fedsap_ray.algorithms.registry import register
from fedsap_ray.algorithms.schedule import plan_settings
from fedsap_ray.algorithms.widths import CAPACITY, FULL, WidthRule
from fedsap_ray.common.columns import Column
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.config.checks import check_choice
from fedsap_ray.models.masks import ChannelMasks, nested_channel_masks, param_mask
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundOutput, RoundRecords, ServerState
from fedsap_ray.models import model_macs

WIDTHS = ("full", "capacity")
# a method's ``algorithm.weighting`` where it offers one (HeteroFL, NeFL, FedSR): each client's weight in the
# server's mean, its samples n_i (papers/003 Algorithm 1 line 18) or 1 (the count its authors' code divides by)
WEIGHTINGS = ("samples", "count")
MASK_CACHE = 32  # sub-model masks kept per run (a HAS-FL run sees many distinct widths)


@register("fedavg")
class FedAvg(Strategy):
    summary = "full model on every client (width=capacity: nested sub-models at p_max)"
    confound_variants = {"fedavg": ()}  # papers/003 Table 6 (full model)
    columns = {
        "clients": CHANNEL_COUNT_COLUMNS,
        "allocations": (
            Column("p", pa.float64(), "width assigned to the client for this round (what it trains if sampled)"),
            Column("adapted", pa.bool_(), "an adaptation step (new allocations) happened at the end of this round"),
        ),
    }
    width: WidthRule = FULL  # the composed width rule (module docstring); a subclass holds its own
    supports_async = True  # stateless: docs/readings.md#asynchronous-training
    supports_privacy = True  # uploads its update only; masks from (capacity, round, seed)  # docs/readings.md#privacy
    writes_with = {"allocations": {"width": "capacity"}}  # the full rule allocates nothing (WidthRule.tracked)

    @dataclass(frozen=True)
    class Options:
        width: str = "full"  # full: every client trains the whole model; capacity: the nested sub-model at its capacity

        def __post_init__(self) -> None:
            check_choice("algorithm.width", self.width, WIDTHS)

    def __init__(self, ctx: RunContext, options: Any) -> None:
        super().__init__(ctx, options)
        self.width = self.width_rule(options)

    @classmethod
    def width_rule(cls, options: Any) -> WidthRule:
        """The width rule a run with ``options`` composes: the class's own, or the capacity rule for FedAvg's
        ``width=capacity`` option (and FedProx's, whose options extend FedAvg's)."""
        if isinstance(options, FedAvg.Options) and options.width == "capacity":
            return CAPACITY
        return cls.width

    @classmethod
    def writes(cls, table: str, options: Any) -> bool:
        """``allocations`` rows come from the width rule (:meth:`allocation_rows`): only a tracked rule writes them."""
        if table == "allocations":
            return cls.width_rule(options).tracked
        return super().writes(table, options)

    # --- which sub-model a client trains -----------------------------------------------
    def width_for(self, state: ServerState, client_id: int, t: int) -> float:
        """p_i of client ``client_id`` in round t, by the composed rule (:attr:`width`)."""
        return self.width(self, state, client_id, t)

    def channel_masks(self, state: ServerState, client_id: int, t: int) -> ChannelMasks | None:
        """The leading ceil(p_i C_l) channels of every layer (None at p_i >= 1)."""
        p = self.width_for(state, client_id, t)
        return None if p >= 1.0 else nested_channel_masks(self.ctx.space, p)

    def sub_model(self, state: ServerState, client_id: int, t: int) -> tuple[np.ndarray | None, int, float]:
        """(parameter mask or None for the full model, active channels, capacity_used) of the round-t
        sub-model: the width-p nested sub-model from the LRU cache; capacity_used is p_i itself
        (the ``clients`` table, docs/reference/results.md#clients)."""
        p = self.width_for(state, client_id, t)
        if p >= 1.0:
            return None, self.ctx.space.total_channels, 1.0
        mask, active = self.nested_mask(p)
        return mask, active, min(float(p), 1.0)

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict[str, Any]:
        """Strategy-specific ClientPlan fields (its hooks and their payloads)."""
        return {}

    def assigned_width(self, plan: ClientPlan) -> float:
        """p_i of the width rule (1.0 for the full rule): the plan's ``capacity_used`` is p_i itself (:meth:`sub_model`)."""
        return float(plan.capacity_used)

    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        return self.configure_clients(state, t, self.sampler.sample(t))

    def configure_clients(self, state: ServerState, t: int, clients: list[int]) -> dict[int, ClientPlan]:
        """The round-t plans of ``clients`` from ``state`` (what :meth:`configure_round` gives its sample; the
        asynchronous mode, :mod:`fedsap_ray.engine.asyncmode`, asks for the clients it starts)."""
        plans: dict[int, ClientPlan] = {}
        for cid in clients:
            mask, _, used = self.sub_model(state, cid, t)
            plans[cid] = ClientPlan(
                params=state.params, mask=mask, capacity_used=float(used),  # params: shared by every plan, never mutated
                **plan_settings(self.cfg, t, cid), **self.extra_plan_fields(state, cid, t),
            )
        return plans

    # --- aggregation -------------------------------------------------------------------------
    def aggregate(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                  t: int) -> RoundOutput:
        """Algorithm 1 lines 17-19 (:meth:`merge`) over the coordinates the clients uploaded (``ClientResult.mask``,
        messages.py), then :meth:`after_aggregate` (the method's own state: HAS-FL's adaptation step, MOON's previous
        models)."""
        ordered = sorted(results, key=lambda r: r.client_id)
        masks = {r.client_id: r.mask for r in ordered}
        params = self.merge(state, plans, ordered, t)
        new = ServerState(round=t, params=params, strategy_state=self.after_aggregate(state, params, ordered, masks, t))
        return RoundOutput(new, self.records(new, plans, ordered, t))

    def merge(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult], t: int) -> np.ndarray:
        """Algorithm 1 line 18: each coordinate's sample-weighted mean over the clients that trained it (each
        result's ``mask``); ``plans`` and the round ``t`` are there for a method whose merge reads a plan's setting."""
        return masked_weighted_average(state.params, [(r.mask, r.values, self.client_weight(r)) for r in results])

    def client_weight(self, result: ClientResult) -> float:
        """A result's weight in the server's mean: its samples n_i, or 1 under a method's ``weighting=count``
        (:data:`WEIGHTINGS`; methods without the option always weigh by samples)."""
        return 1.0 if getattr(self.opts, "weighting", "samples") == "count" else float(result.n_samples)

    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> Any:
        """The next state's ``strategy_state``; static rules keep none."""
        return state.strategy_state

    def client_mask(self, state: ServerState, client_id: int, t: int) -> np.ndarray | None:
        """The client's round-t parameter mask (None: full model) from the pure rule: what its plan carries."""
        return self.sub_model(state, client_id, t)[0]

    def deployed_model(self, state: ServerState, client_id: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The sub-model the client would receive in the next round (its width, its pruned filters,
        its next random draw) from the global model ``state`` holds. Masks are pure in (state, client,
        round), so this is exactly the next round's plan, whether or not the client is sampled then."""
        return state.params, self.client_mask(state, client_id, state.round + 1)

    # --- records -------------------------------------------------------------------------------
    def records(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                t: int) -> RoundRecords:
        """What :meth:`aggregate` returns besides the state (``state``: the state after round t): the clients'
        rows and the allocations. A method with metrics of its own extends it (``dataclasses.replace`` of
        ``super().records(...)`` with its declared columns and progress template)."""
        return RoundRecords(clients=client_records(self, state, plans, results),
                            allocations=self.allocation_rows(state, t, plans))

    def allocation_rows(self, state: ServerState, t: int, plans: Mapping[int, Any]) -> list[dict[str, Any]]:
        """``allocations``: the clients' widths in round t (nested-width rules only), given the state after it.

        Every client at round 1, at an adaptation step (``adapted``) and at the last round; the round's own
        clients in the rounds between. Why: a width changes only at an adaptation step, and an estimate
        (HAS-FL's h_hat, h_tilde) only when its client trains, so the rows left out repeat the latest
        snapshot; written for every client every round, the table grew with the federation and came to dominate
        a large federation's round (docs/guides/large-sweeps.md has the figures). With every client
        in every round (participation 1) nothing changes."""
        if not self.width.tracked:
            return []
        adapted = self.width.adapted(self, t)
        snapshot = t == 1 or adapted or t >= self.cfg.training.rounds
        widths = self.width.round_widths(self, state, t, None if snapshot else sorted(plans))
        clients = [self.ctx.federation.clients[c] for c in widths]
        return [dict(client_id=c.client_id, capacity_max=float(c.capacity), p=float(min(widths[c.client_id], 1.0)),
                     adapted=adapted, **self.estimate_columns(state, c.client_id))
                for c in clients]

    def estimate_columns(self, state: ServerState, client_id: int) -> dict[str, Any]:
        """The allocation's estimates of a client for ``clients`` and ``allocations`` (HAS-FL's h_hat,
        h_tilde); none for static rules."""
        return {}

    def active_channels(self, plan: ClientPlan) -> int:
        """Channels of the width-p sub-model (capacity_used is p itself here, :meth:`sub_model`)."""
        p = plan.capacity_used
        return self.ctx.space.total_channels if p >= 1.0 else self.nested_mask(p)[1]

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """Channel counts (every trained channel is shared: Global; none is Private), the sub-model's
        MACs and the allocation's estimates."""
        active = self.active_channels(plan)
        return {"n_global": active, "n_private": 0, "n_dropped": self.ctx.space.total_channels - active,
                "macs_per_sample": self.macs(plan.capacity_used), **self.estimate_columns(state, plan.client_id)}

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
