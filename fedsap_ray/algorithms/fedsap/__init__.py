"""FedSAP (papers/000): registered as ``fedsap`` (main adaptive setting, Appendix B Table 3 left)
and ``fedsap_fixed`` (the fixed-mask, uniform-budget reference configuration, Table 3 right)."""
from __future__ import annotations

from dataclasses import dataclass

from fedsap_ray.algorithms.fedsap.strategy import FedSAP, FedSAPOptions
from fedsap_ray.algorithms.registry import register


@register("fedsap")
class FedSAPMain(FedSAP):
    summary = "tri-state channels, adaptive layer budgets, DGA, type-matched aggregation"
    Options = FedSAPOptions


@register("fedsap_fixed")
class FedSAPFixed(FedSAP):
    summary = "FedSAP's fixed-mask, uniform-budget reference setting (Table 3 right)"

    @dataclass(frozen=True)
    class Options(FedSAPOptions):
        adaptive_layer_budget: int = 0
        tau_var: float = 0.1
        beta_ema: float = 0.3
        masks: str = "fixed"
        # the reference setting keeps the selection it was defined with (docs/readings.md#stable-masks): its masks
        # freeze after warm-up anyway, and papers/000 Tables 2 and 7 are read against it
        smoothing: str = "dispersion"
        stability: str = "none"
        ranking: str = "client"
        dga_source: str = "train"  # the paper's DGA input (Eq. 4: the gradient after local training)


__all__ = ["FedSAP", "FedSAPOptions", "FedSAPMain", "FedSAPFixed"]
