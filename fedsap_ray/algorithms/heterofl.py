"""HeteroFL (Diao et al. 2021) as papers/003 runs it: static resource-only widths p_i = p_max_i.

Nested sub-models and coordinate-wise aggregation (papers/003 Algorithms 1-2); the
widest tier trains the full model, so every coordinate stays covered (Table 4's
"full coverage" row). HeteroFL's static batch-norm and scaler modules are not part of
papers/003's protocol and are not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.registry import register
from fedsap_ray.algorithms.widths import CAPACITY


@register("heterofl")
class HeteroFL(FedAvg):
    summary = "static nested sub-models at p_max, coordinate-wise aggregation"
    confound_variants = {"heterofl": ()}  # papers/003 Table 3
    supports_async = True  # docs/readings.md#asynchronous-training
    @dataclass(frozen=True)
    class Options:
        """No options (not FedAvg's ``width``: the rule is fixed)."""

    width = CAPACITY
