"""FedProx (Li et al. 2020): FedAvg plus the proximal term (mu/2)||w - w^t||^2 (their Eq. 2)
in every client's local objective; aggregation is FedAvg's."""
from __future__ import annotations

from dataclasses import dataclass

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.registry import register
from fedsap_ray.errors import ConfigError


@register("fedprox")
class FedProx(FedAvg):
    summary = "FedAvg plus the proximal term (mu/2)||w - w^t||^2 in the local objective"
    @dataclass(frozen=True)
    class Options(FedAvg.Options):
        mu: float = 0.01  # weight of the proximal term (mu/2)||w - w^t||^2

        def __post_init__(self) -> None:
            super().__post_init__()
            if not isinstance(self.mu, (int, float)) or self.mu < 0:
                raise ConfigError(f"invalid algorithm.mu={self.mu!r}: must be a number >= 0")

    def extra_plan_fields(self, state, client_id, t):
        return {"prox_mu": float(self.opts.mu)}
