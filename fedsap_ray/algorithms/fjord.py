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

from fedsap_ray.algorithms.nested import NestedWidth
from fedsap_ray.algorithms.registry import register
from fedsap_ray.messages import ServerState
from fedsap_ray.seeding import rng_for


@register("fjord")
class FjORD(NestedWidth):
    summary = "ordered dropout: each round a random tier at or below p_max (papers/003)"
    def tiers(self) -> list[float]:
        """The distinct device capacities of the federation (p_max values), ascending."""
        return sorted({float(c.capacity) for c in self.ctx.federation.clients})

    def width_for(self, state: ServerState, client_id: int, t: int) -> float:
        p_max = float(self.ctx.federation.clients[client_id].capacity)
        options = [p for p in self.tiers() if p <= p_max]
        return float(rng_for(self.cfg.seed, t, client_id, "fjord").choice(options))
