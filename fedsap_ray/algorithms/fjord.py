"""FjORD (Horvath et al. 2021) as papers/003 runs it: ordered dropout over the capacity tiers.

Every round each sampled client draws its width uniformly from the federation's
capacity tiers at or below its own p_max (papers/003 section 4.2: "assigns capacity
tiers randomly from the available options"), seeded by (run seed, round, client), and
trains the nested sub-model of that width. papers/003 section 4.1 mentions FjORD's
knowledge distillation between widths in passing but gives no setting for it, and section
4.2 describes the baseline by its random tier assignment alone; the distillation is not
modelled (docs/readings.md#other-choices).
"""
from __future__ import annotations

from dataclasses import dataclass

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.registry import register
from fedsap_ray.algorithms.widths import RANDOM_TIER


@register("fjord")
class FjORD(FedAvg):
    summary = "ordered dropout: each round a random tier at or below p_max (papers/003)"
    confound_variants = {"fjord": ()}  # papers/003 Table 3
    supports_async = True  # docs/readings.md#asynchronous-training
    @dataclass(frozen=True)
    class Options:
        """No options (not FedAvg's ``width``: the rule is fixed)."""

    width = RANDOM_TIER
