"""FedAvg (McMahan et al. 2017), full-model or heterogeneous.

``width=full``: every client trains the whole model (the papers' full-model baseline).
``width=capacity``: every client trains the nested sub-model at its own capacity
(leading ceil(kappa_i * C_l) channels of every layer, papers/003 Algorithm 2), and the
server averages each coordinate over the clients that trained it (Algorithm 1 line 18),
the HeteroFL rule (also registered as ``heterofl``).
"""
from __future__ import annotations

from dataclasses import dataclass

from fedsap_ray.algorithms.nested import NestedWidth
from fedsap_ray.algorithms.registry import register
from fedsap_ray.errors import ConfigError
from fedsap_ray.messages import ServerState

WIDTHS = ("full", "capacity")


@register("fedavg")
class FedAvg(NestedWidth):
    summary = "full model on every client (width=capacity: nested sub-models at p_max)"
    @dataclass(frozen=True)
    class Options:
        width: str = "full"  # full: every client trains the whole model; capacity: the nested sub-model at its capacity

        def __post_init__(self) -> None:
            if self.width not in WIDTHS:
                raise ConfigError(f"invalid algorithm.width={self.width!r}: allowed values are {', '.join(WIDTHS)}")

    @property
    def track_allocations(self) -> bool:  # type: ignore[override]
        return self.opts.width != "full"

    def width_for(self, state: ServerState, client_id: int, t: int) -> float:
        if self.opts.width == "full":
            return 1.0
        return float(self.ctx.federation.clients[client_id].capacity)
