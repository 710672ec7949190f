"""Sub-models of arbitrary channel subsets, aggregated coordinate-wise (papers/003 Algorithms 1-2).

:class:`ChannelSubsetStrategy` extends :class:`~fedsap_ray.algorithms.fedavg.FedAvg` (nested widths by a
width rule) to any per-client channel subset: a subclass says which channels a client trains
(:meth:`ChannelSubsetStrategy.channel_masks`: FedDrop's random subsets, FedMP's largest-L1 filters,
NeFL's depth-and-width nested sub-models, FedRolex's rolling windows), turned into parameter masks here
(:meth:`ChannelSubsetStrategy.coverage`: :func:`fedsap_ray.models.masks.param_mask`; the classifier's output
units, and the LSTM's embedding, are always shared in full). Aggregation, the deployed model and the records are FedAvg's: each
coordinate is averaged over exactly the clients that trained it (Algorithm 1 line 18).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.models.masks import ChannelMasks, param_mask
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState


class ChannelSubsetStrategy(FedAvg):
    """Base of the channel-subset strategies: a subclass chooses each client's channels per (state, client, round)."""

    @abstractmethod
    def channel_masks(self, state: ServerState, client_id: int, t: int) -> ChannelMasks | None:
        """Per channel layer, the channels client ``client_id`` trains in round t (None: the full model).

        ``state`` is the server state the round starts from; the result must be a pure
        function of (state, client, round) so the deployed model can recompute it.
        """

    def sub_model(self, state: ServerState, client_id: int, t: int) -> tuple[np.ndarray | None, int, float]:
        """(parameter mask or None for the full model, active channels, capacity_used) of the round-t sub-model;
        capacity_used is the fraction of all channels the client trains."""
        total = self.ctx.space.total_channels
        cmasks = self.channel_masks(state, client_id, t)
        if cmasks is None:
            return None, total, 1.0
        active = int(sum(int(np.count_nonzero(m)) for m in cmasks.values()))
        return self.coverage(cmasks), active, active / total

    def coverage(self, cmasks: ChannelMasks) -> np.ndarray:
        """Parameter mask of a channel mask (the coverage rule of :mod:`fedsap_ray.models.masks`; NeFL also drops the
        residual branches it skips)."""
        return param_mask(self.ctx.space, self.ctx.layout, cmasks)

    def assigned_width(self, plan: ClientPlan) -> float:
        """The client's capacity kappa_i (at most 1): what its channel subset is drawn or chosen
        for; ``capacity_used`` is the share of channels that subset holds."""
        return min(float(self.ctx.federation.clients[plan.client_id].capacity), 1.0)

    def active_channels(self, plan: ClientPlan) -> int:
        """Channels the plan trains: capacity_used is active / total here (:meth:`sub_model`), so exact."""
        return int(round(plan.capacity_used * self.ctx.space.total_channels))

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """Channel counts: every trained channel is shared (Global); none is Private (``macs_per_sample``
        stays the core count of the plan's coverage)."""
        active = self.active_channels(plan)
        return {"n_global": active, "n_private": 0, "n_dropped": self.ctx.space.total_channels - active}

    def train_macs(self, plan: ClientPlan, result: ClientResult) -> int:
        """One forward pass of the sub-model the plan covers per sample (:meth:`Strategy.train_macs`)."""
        return int(result.samples_seen) * self.compute.mask_macs(plan.mask)
