"""Uniform allocation (papers/003 section 4.1): p_i = min(p, p_max_i) with p = 0.5 for every client.

It caps every client at half width, so the outer half of every layer (including the
classifier's input columns) is trained by nobody: Proposition 3's failure mode, kept
on purpose as the paper's coverage-violating baseline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.widths import Capped, WidthRule
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_number


@register("uniform")
class Uniform(FedAvg):
    summary = "p_i = min(0.5, p_max): every client capped at half width (no coverage)"
    confound_variants = {"uniform": ()}  # papers/003 Table 3
    supports_async = True  # docs/readings.md#asynchronous-training
    supports_privacy = True  # docs/readings.md#privacy
    @dataclass(frozen=True)
    class Options:
        p: float = 0.5  # papers/003 section 4.1

        def __post_init__(self) -> None:
            check_number("algorithm.p", self.p, 0, 1, low_open=True)

    @classmethod
    def width_rule(cls, options: Any) -> WidthRule:
        """p_i = min(p, p_max) with the option's p."""
        return Capped(options.p)
