"""Client-side pieces of a strategy: the local objective and hooks around each SGD step.

Most strategies only change what the server sends and how it aggregates; the client
loop in :mod:`fedsap_ray.client` (masked SGD, FedProx's proximal term, Eq. 7, SCAFFOLD's
correction) covers them. A strategy whose clients compute something else (MOON's
contrastive term, FedSR's probabilistic representation, FPL's prototypes, FedSPU's
frozen neurons) registers a :class:`LocalObjective` under a name in its own module and
puts that name in ``plan.extra["objective"]``; everything it needs travels in
``plan.extra`` (pure data, so any worker can run any client) and whatever it sends
back goes into ``ClientResult.stats`` (counted in bytes_up).
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fedsap_ray.masks import ParamLayout
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.messages import ClientPlan

_OBJECTIVES: dict[str, type[LocalObjective]] = {}


class LocalObjective:
    """Default: cross-entropy. Subclasses override :meth:`loss` and the hooks they need."""

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device) -> None:
        self.plan, self.layout, self.device = plan, layout, device

    def loss(self, model: MaskableModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def after_backward(self, model: MaskableModel) -> None:
        """Gradients are final (masked); clipping and the optimiser step come next."""

    def after_step(self, model: MaskableModel) -> None:
        """The optimiser step is done (e.g. restore coordinates that must not move)."""

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        """Arrays to send back with the trained values (``ClientResult.stats``)."""
        return {}

    def upload_mask(self) -> np.ndarray | None:
        """Coordinates to upload when the client chose them itself (DapperFL's pruning); None: the plan's mask.
        The strategy must know the same mask (e.g. from :meth:`result`) to read the values."""
        return None


def register_objective(name: str) -> Callable[[type[LocalObjective]], type[LocalObjective]]:
    def deco(cls: type[LocalObjective]) -> type[LocalObjective]:
        if name in _OBJECTIVES:
            raise ValueError(f"local objective {name!r} registered twice")
        _OBJECTIVES[name] = cls
        return cls
    return deco


def make_objective(plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device) -> LocalObjective | None:
    """The plan's objective (None: the built-in loop); strategies register theirs on import."""
    name: Any = plan.extra.get("objective")
    if name is None:
        return None
    import fedsap_ray.algorithms  # noqa: F401  (registers every strategy's objective, also on Ray workers)

    if name not in _OBJECTIVES:
        raise ValueError(f"unknown local objective {name!r}; registered: {sorted(_OBJECTIVES)}")
    return _OBJECTIVES[name](plan, model, layout, device)
