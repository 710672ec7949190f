"""Width rules: the share p_i of every layer's channels client i trains in round t (papers/003 Algorithm 2).

A :class:`~fedsap_ray.algorithms.fedavg.FedAvg` strategy composes one rule (``width``), so the
nested-width methods differ only in the rule they hold and no method stubs another's: full-model
methods (FedAvg, FedProx, MOON, FedSR, FPL) hold :data:`FULL`, HeteroFL :data:`CAPACITY`, Uniform
:class:`Capped`, FjORD :data:`RANDOM_TIER`, HAS-FL its allocation (``algorithms/hasfl.py``). A rule
must be a pure function of (state the round starts from, client, round), so aggregation and the
deployed model can recompute it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.common.messages import ServerState
from fedsap_ray.common.seeding import rng_for


class WidthRule:
    """p_i per (strategy, state, client, round); the full model by default."""

    # whether the ``allocations`` table records every client's width each round (nested widths do;
    # a full model allocates nothing)
    tracked: ClassVar[bool] = True

    def __call__(self, s: Strategy, state: ServerState, client_id: int, t: int) -> float:
        return 1.0

    def round_widths(self, s: Strategy, state: ServerState, t: int,
                     clients: Sequence[int] | None = None) -> dict[int, float]:
        """Round-t widths of ``clients`` (default: every client) for the ``allocations`` table, given the
        state AFTER round t (a rule whose widths live in the state overrides it)."""
        ids = range(len(s.ctx.federation.clients)) if clients is None else clients
        return {cid: self(s, state, cid, t) for cid in ids}

    def adapted(self, s: Strategy, t: int) -> bool:
        """Whether the allocations changed at the end of round t (``allocations.adapted``; static rules: never)."""
        return False


class Full(WidthRule):
    """p_i = 1: every client trains the whole model."""

    tracked = False


class Capacity(WidthRule):
    """p_i = p_max of client i: the nested sub-model at its device capacity (HeteroFL)."""

    def __call__(self, s: Strategy, state: ServerState, client_id: int, t: int) -> float:
        return float(s.ctx.federation.clients[client_id].capacity)


class Capped(WidthRule):
    """p_i = min(p, p_max): every client capped at one width (papers/003 Uniform baseline)."""

    def __init__(self, p: float) -> None:
        self.p = float(p)

    def __call__(self, s: Strategy, state: ServerState, client_id: int, t: int) -> float:
        return min(self.p, float(s.ctx.federation.clients[client_id].capacity))


class RandomTier(WidthRule):
    """p_i drawn each round uniformly from the federation's capacity tiers at or below p_max (FjORD,
    papers/003 section 4.2), seeded by (run seed, round, client)."""

    def __call__(self, s: Strategy, state: ServerState, client_id: int, t: int) -> float:
        # the federation's tiers, once per run: recomputed per call they made round_widths O(clients^2)
        tiers = s.memo("fjord_tiers", None, lambda: sorted({float(c.capacity) for c in s.ctx.federation.clients}))
        p_max = float(s.ctx.federation.clients[client_id].capacity)
        return float(rng_for(s.cfg.seed, t, client_id, "fjord").choice([p for p in tiers if p <= p_max]))


FULL = Full()
CAPACITY = Capacity()
RANDOM_TIER = RandomTier()
