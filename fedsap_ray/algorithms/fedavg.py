"""FedAvg (McMahan et al. 2017), full-model or heterogeneous.

``width=full``: every client trains the whole model (the papers' full-model baseline).
``width=capacity``: every client trains the nested sub-model at its own capacity
(leading ceil(kappa_i * C_l) channels of every layer, papers/003 Algorithm 2), and the
server averages each coordinate over the clients that trained it
(:func:`fedsap_ray.aggregation.masked_weighted_average`), the HeteroFL rule.
Sub-model strategies with other allocation rules override :meth:`FedAvg.width_for`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsap_ray.aggregation import masked_weighted_average
from fedsap_ray.algorithms.base import Strategy
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config import ConfigError
from fedsap_ray.masks import nested_channel_masks, param_mask
from fedsap_ray.models import model_macs
from fedsap_ray.messages import ClientPlan, ClientResult, ServerState

WIDTHS = ("full", "capacity")


@register("fedavg")
class FedAvg(Strategy):
    @dataclass(frozen=True)
    class Options:
        width: str = "full"  # full | capacity

        def __post_init__(self) -> None:
            if self.width not in WIDTHS:
                raise ConfigError(f"invalid algorithm.width={self.width!r}: allowed values are {', '.join(WIDTHS)}")

    def width_for(self, client_id: int, t: int) -> float:
        """Fraction p of every layer's channels client ``client_id`` trains in round t."""
        if self.opts.width == "full":
            return 1.0
        return float(self.ctx.federation.clients[client_id].capacity)

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict:
        return {}

    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        plans: dict[int, ClientPlan] = {}
        total = sum(layer.channels for layer in self.ctx.space.layers)
        for cid in self.sample_clients(t):
            p = self.width_for(cid, t)
            if p >= 1.0:
                mask, values, active = None, state.params, total  # shared, never mutated
            else:
                mask, active = self.nested_mask(p)
                values = state.params[mask]
            plans[cid] = ClientPlan(
                values=values, mask=mask, capacity_used=active / total,
                channel_counts={"n_global": active, "n_private": 0, "n_dropped": total - active},
                **self.plan_kwargs(t, cid), **self.extra_plan_fields(state, cid, t),
            )
        return plans

    def aggregate(self, state: ServerState, results: list[ClientResult], t: int) -> ServerState:
        masks = self._masks_for(results, t)
        contributions = [(masks[r.client_id], r.values, float(r.n_samples)) for r in sorted(results, key=lambda r: r.client_id)]
        params = masked_weighted_average(state.params, contributions)
        return ServerState(round=t, params=params, extra=state.extra)

    def _masks_for(self, results: list[ClientResult], t: int) -> dict[int, np.ndarray | None]:
        """Masks are a pure function of (client, round), so they are recomputed, not kept on the actor."""
        out = {}
        for r in results:
            p = self.width_for(r.client_id, t)
            out[r.client_id] = None if p >= 1.0 else self.nested_mask(p)[0]
        return out

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict:
        return {"macs_per_sample": self.macs(self.width_for(plan.client_id, plan.round))}

    def macs(self, p: float) -> int:
        """Multiply-accumulates per sample of the width-p sub-model (papers/003 Table 1); memoised."""
        cache = self.__dict__.setdefault("_macs_cache", {})
        if p not in cache:
            masks = None if p >= 1.0 else nested_channel_masks(self.ctx.space, p)
            cache[p] = int(model_macs(self.ctx.model, self.ctx.federation.input_shape, masks))
        return cache[p]

    def nested_mask(self, p: float) -> tuple[np.ndarray, int]:
        """(parameter mask, active channels) of the width-p nested sub-model; memoised (pure in p)."""
        cache = self.__dict__.setdefault("_nested_cache", {})
        if p not in cache:
            cmasks = nested_channel_masks(self.ctx.space, p)
            cache[p] = (param_mask(self.ctx.space, self.ctx.layout, cmasks), int(sum(int(m.sum()) for m in cmasks.values())))
        return cache[p]
