"""FedProx (Li et al. 2020): FedAvg plus the proximal term (mu/2)||w - w^t||^2 (their Eq. 2)
in every client's local objective; aggregation is FedAvg's.

Client side: the ``fedprox`` hook (:class:`ProximalTerm`) adds the term to every batch loss after
the base loss, over every trained parameter (coordinates outside the plan's mask stay at their
start value 0 and add nothing); w^t is the model as received. ``mu`` travels as the hook's payload
(:class:`ProximalPayload`, the validated option itself); with mu = 0 nothing is added (exactly FedAvg).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_number
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan, ServerState
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.models.sliced import SlicedModel

HOOK = "fedprox"


@dataclass(frozen=True)
class ProximalPayload:
    mu: float  # the weight of the proximal term (algorithm.mu, validated >= 0 by the options)


@register_hook(HOOK)
class ProximalTerm(ClientHook):
    """loss + (mu/2) sum_p ||p - p^t||^2 (Li et al. 2020, Eq. 2); mu is the payload's ``mu``.

    Works on a sliced sub-network as is: the anchor is the trained model's own parameters at ``start``
    (the masked model's other coordinates are 0 in both w and w^t and add nothing)."""

    supports_sliced = True
    supports_compile = True  # reads parameters only, after the forward
    Payload: ClassVar[type] = ProximalPayload
    payload: ProximalPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device,
                 sliced: SlicedModel | None = None) -> None:
        super().__init__(plan, model, layout, device, sliced)
        self.mu = self.payload.mu
        self.anchor: list[torch.Tensor] | None = None

    def start(self, model: MaskableModel) -> None:
        self.params = list(model.parameters())
        self.anchor = [p.detach().clone() for p in self.params] if self.mu > 0 else None

    def add_terms(self, model: MaskableModel, loss: torch.Tensor) -> torch.Tensor:
        if self.anchor is None:
            return loss
        prox = sum(((p - a) ** 2).sum() for p, a in zip(self.params, self.anchor))
        return loss + 0.5 * self.mu * prox


@register("fedprox")
class FedProx(FedAvg):
    summary = "FedAvg plus the proximal term (mu/2)||w - w^t||^2 in the local objective"
    confound_variants = {"fedprox": ("algorithm.mu=1.0",)}  # papers/003 section 4.5: "the standard mu = 1.0"
    supports_async = True  # docs/readings.md#asynchronous-training
    supports_privacy = True  # docs/readings.md#privacy
    @dataclass(frozen=True)
    class Options(FedAvg.Options):
        mu: float = 0.01  # weight of the proximal term (mu/2)||w - w^t||^2

        def __post_init__(self) -> None:
            super().__post_init__()
            check_number("algorithm.mu", self.mu, 0)

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict[str, Any]:
        return {"hooks": (call(ProximalTerm, mu=float(self.opts.mu)),)}
