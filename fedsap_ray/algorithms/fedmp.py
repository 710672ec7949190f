"""FedMP (Jiang et al., ICDE 2022, "FedMP: Federated Learning through Adaptive Model Pruning
in Heterogeneous Edge Computing") at each client's capacity (papers/000 Table 1).

Each round the server prunes the current global model separately for every sampled
client with structured magnitude pruning: of every layer it keeps the ceil(kappa_i C_l)
filters with the largest L1 norm (the filter criterion of Li et al. 2017, "Pruning Filters
for Efficient ConvNets", which FedMP's structured pruning uses;
:func:`fedsap_ray.algorithms.pruning.l1_channel_masks`
on the global parameters the round starts from; a residual stream is scored by the
summed L1 norms of every filter that writes it, BN scales are not filters), sends the
pruned sub-model, and the client trains it. kappa_i = 1 - pruning ratio of client i;
a client with kappa_i = 1 trains the full model. The masks follow the global model:
they are recomputed from it every round.

FedMP chooses every client's pruning ratio online with a multi-armed-bandit learner
(its adaptive pruning-ratio selection) from measured computation and
communication times; papers/000 instead gives every client a fixed pruning ratio, so
that bandit is replaced by the client's capacity kappa_i and not modelled.

``aggregation`` (how the pruned models are merged):

- ``r2sp`` (default): FedMP's Residual Recovery Synchronous Parallel. Our reading: the
  server first recovers every client's pruned model to full size with the residual,
  the global parameters it pruned away for that client, and then takes the FedAvg
  sample-weighted mean of the recovered models, so for coordinate j

      w_j <- sum_i n_i x_ij / sum_i n_i,   x_ij = trained value if client i trained j, else w_j,

  over all clients of the round. BN running statistics follow the same rule.
- ``coordinate``: the HeteroFL rule shared by the other sub-model baselines (average of
  the clients that trained the coordinate, papers/003 Algorithm 1 line 18).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedsap_ray.algorithms.aggregation import masked_weighted_average, scatter
from fedsap_ray.algorithms.channel_subsets import ChannelSubsetStrategy
from fedsap_ray.algorithms.pruning import l1_channel_masks
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_choice
from fedsap_ray.models.masks import ChannelMasks
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState

AGGREGATIONS = ("r2sp", "coordinate")


@register("fedmp")
class FedMP(ChannelSubsetStrategy):
    summary = "server keeps each client's largest-L1 filters at its capacity; R2SP residual-recovery aggregation"
    supports_async = True  # docs/readings.md#asynchronous-training

    @dataclass(frozen=True)
    class Options:
        aggregation: str = "r2sp"  # r2sp | coordinate (module docstring)

        def __post_init__(self) -> None:
            check_choice("algorithm.aggregation", self.aggregation, AGGREGATIONS)

    def channel_masks(self, state: ServerState, client_id: int, t: int) -> ChannelMasks | None:
        kappa = float(self.ctx.federation.clients[client_id].capacity)
        if kappa >= 1.0:
            return None
        return l1_channel_masks(self.ctx.space, self.ctx.layout, state.params, kappa)

    def merge(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult], t: int) -> np.ndarray:
        if self.opts.aggregation == "coordinate":
            return super().merge(state, plans, results, t)
        size = self.ctx.layout.size
        recovered = [(None, scatter(r.values, r.mask, size, fill=state.params), float(r.n_samples))
                     for r in results]  # pruned model + residual = full-size model
        return masked_weighted_average(state.params, recovered)
