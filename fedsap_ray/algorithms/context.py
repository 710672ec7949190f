"""What a run's server side holds (:class:`RunContext`) and the view a strategy gets (:class:`StrategyContext`).

It lives below both the strategies and the session, so the backends, the session and the
recorder get a run's context without importing every registered strategy (which
``fedsap_ray.algorithms`` does on import).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fedsap_ray.data.base import Federation, FederationView
from fedsap_ray.models.masks import ParamLayout, trainable_mask
from fedsap_ray.models.space import ChannelSpace, MaskableModel
from fedsap_ray.config.schema import ExperimentConfig


@dataclass(frozen=True)
class OracleInputs:
    """Ground truth handed to a strategy only when it declares a control that needs it
    (:meth:`Strategy.needs_oracle`; FedSAP's ``dga=oracle``): such a run is a reference, not a method."""

    client_domains: tuple[str, ...]  # the true domain of each client, by client id


@dataclass
class RunContext:
    """What the server side of a run holds: the whole federation, ground truth included (backends,
    evaluation and the results writer use it). Strategies get :meth:`strategy_context` instead."""

    cfg: ExperimentConfig
    federation: Federation
    model: MaskableModel  # template: strategies read shapes, never train it
    layout: ParamLayout
    space: ChannelSpace

    @cached_property
    def trainable(self) -> np.ndarray:
        """Coordinates that are nn.Parameters (not BN running statistics), computed once per run."""
        return trainable_mask(self.layout, self.model)

    def strategy_context(self, oracle: bool = False) -> StrategyContext:
        """The view a strategy is built with: no true domains or TV distances; the domains as an explicit
        :class:`OracleInputs` only when ``oracle`` (a ground-truth control)."""
        fed = self.federation
        truth = OracleInputs(tuple(c.domain for c in fed.clients)) if oracle else None
        return StrategyContext(cfg=self.cfg, federation=fed.server_view(), model=self.model, layout=self.layout,
                               space=self.space, trainable=self.trainable, oracle=truth)


@dataclass
class StrategyContext:
    """What a strategy knows about the run: what a real server could know (:class:`FederationView`)."""

    cfg: ExperimentConfig
    federation: FederationView
    model: MaskableModel  # template: strategies read shapes, never train it
    layout: ParamLayout
    space: ChannelSpace
    trainable: np.ndarray  # coordinates that are nn.Parameters (not BN running statistics)
    oracle: OracleInputs | None = None  # ground truth, only for a control that declares it (needs_oracle)


