"""Uniform allocation (papers/003 section 4.1): p_i = min(p, p_max_i) with p = 0.5 for every client.

It caps every client at half width, so the outer half of every layer (including the
classifier's input columns) is trained by nobody: Proposition 3's failure mode, kept
on purpose as the paper's coverage-violating baseline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.widths import Capped
from fedsap_ray.algorithms.registry import register
from fedsap_ray.errors import ConfigError
from fedsap_ray.context import RunContext


@register("uniform")
class Uniform(FedAvg):
    summary = "p_i = min(0.5, p_max): every client capped at half width (no coverage)"
    supports_async = True  # docs/readings.md#asynchronous-training
    @dataclass(frozen=True)
    class Options:
        p: float = 0.5  # papers/003 section 4.1

        def __post_init__(self) -> None:
            if not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
                raise ConfigError(f"invalid algorithm.p={self.p!r}: must be a number in (0, 1]")

    def __init__(self, ctx: RunContext, options: Any) -> None:
        super().__init__(ctx, options)
        self.width = Capped(self.opts.p)
