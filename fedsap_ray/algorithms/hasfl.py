"""HAS-FL (papers/003 section 3, Algorithm 1): heterogeneity-aware nested sub-model allocation.

Per round (Algorithm 1): sampled clients train nested sub-models at p_i (Algorithm 2)
and the server averages coordinate-wise (line 18). After every round t >= ``warmup``
with t % ``t_adapt`` == 0 (an adaptation step; rounds are 1-based, so with the paper's
warm-up 10 and T_adapt 5 the first step ends round 10):

- Eq. 4 (line 22): H_hat_i = ||m_i * (Delta_i - Delta_bar)||^2 / (||m_i * Delta_bar||^2 + eps)
  over the coordinates client i trained (its own mask m_i; BN running statistics are not
  parameters and are left out), Delta_bar = the coordinate-wise aggregated update.
- Eq. 5 (line 23): H~_i <- beta H~_i + (1 - beta) H_hat_i for the round's participants;
  H~ starts at 1 (line 2).
- every ``t_norm`` rounds (section 3.2; docs/readings.md#has-fl): H~ <- H~ / mean(H~).
- Eq. 6 (lines 25-28): p_i = min(p_max_i, p_min + gamma H~_i / (H_bar + eps)) for all N
  clients, H_bar = mean of H~ over all N clients.
- coverage guarantee (line 29), when ``coverage`` is on: p_i = p_max_i for the clients
  whose p_max is the largest in the federation.

Allocations start at p_max (line 3). H_hat is also computed on rounds that are not
adaptation steps and recorded (``clients.h_hat``) as a diagnostic; only adaptation
steps feed the EMA, as in the algorithm. Defaults are section 4.1's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.widths import WidthRule
from fedsap_ray.common.columns import Column
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_bool, check_int, check_number
from fedsap_ray.common.messages import ClientResult, ServerState


def allocation_rule(h_tilde: np.ndarray, p_max: np.ndarray, p_min: float, gamma: float, eps: float,
                    coverage: bool) -> np.ndarray:
    """Eq. 6 for every client, then the coverage guarantee (Algorithm 1 lines 25-29)."""
    h_bar = float(np.mean(h_tilde))
    p = np.minimum(p_max, p_min + gamma * h_tilde / (h_bar + eps))
    if coverage:
        top = p_max == p_max.max()
        p[top] = p_max[top]
    return p


def h_hat(delta_i: np.ndarray, delta_bar: np.ndarray, eps: float) -> float:
    """Eq. 4 on the client's own coordinates: both arguments are already restricted to m_i."""
    d_i = delta_i - delta_bar
    return float(np.dot(d_i, d_i) / (np.dot(delta_bar, delta_bar) + eps))


@dataclass(frozen=True)
class HasFLState:
    """HAS-FL's server state besides the global model (Algorithm 1)."""

    h_tilde: np.ndarray  # float64 [N]: the smoothed estimates H~_i (Eq. 5), 1 at the start (line 2)
    h_hat: np.ndarray  # float64 [N]: each client's latest raw estimate H_hat_i (Eq. 4), NaN before its first
    alloc: np.ndarray  # float64 [N]: p_i for the NEXT round (Eq. 6 at adaptation steps, else kept)
    alloc_used: np.ndarray  # float64 [N]: the p_i the round that produced this state trained at


class Allocated(WidthRule):
    """HAS-FL's width: p_i as the last adaptation step allocated it (the state's ``alloc``)."""

    def __call__(self, s: Strategy, state: ServerState, client_id: int, t: int) -> float:
        return float(state.strategy_state.alloc[client_id])

    def round_widths(self, s: Strategy, state: ServerState, t: int,
                     clients: Sequence[int] | None = None) -> dict[int, float]:
        """The widths round t trained at (the state after it allocates round t+1's)."""
        used = state.strategy_state.alloc_used
        return {cid: used[cid] for cid in (range(len(used)) if clients is None else clients)}

    def adapted(self, s: Strategy, t: int) -> bool:
        return bool(s.is_adaptation_round(t))  # type: ignore[attr-defined]


@register("hasfl")
class HasFL(FedAvg):
    summary = "heterogeneity-aware widths from update divergence, Eqs. 4-6, coverage guarantee"
    confound_variants = {"hasfl": (), "hasfl-nocov": ("algorithm.coverage=false",)}  # papers/003 Tables 3-4
    columns = {
        "clients": (Column("h_hat", pa.float64(), "HAS-FL raw heterogeneity estimate (Eq. 4)"),
                    Column("h_tilde", pa.float64(), "HAS-FL smoothed estimate (Eq. 5)")),
        "allocations": (Column("h_hat", pa.float64(), "HAS-FL Eq. 4: the client's latest raw estimate (null before "
                                                      "its first)"),
                        Column("h_tilde", pa.float64(), "HAS-FL Eq. 5: smoothed estimate at the end of the round")),
    }
    @dataclass(frozen=True)
    class Options:
        p_min: float = 0.4  # base capacity (section 4.1)
        gamma: float = 0.25  # sensitivity
        beta: float = 0.9  # EMA smoothing (Eq. 5)
        t_adapt: int = 5  # rounds between adaptation steps
        warmup: int = 10  # no adaptation before this round
        t_norm: int = 20  # periodic normalisation interval
        coverage: bool = True  # coverage guarantee (section 3.3)
        eps: float = 1e-8  # numerical stability in Eqs. 4 and 6

        def __post_init__(self) -> None:
            check_number("algorithm.p_min", self.p_min, 0, 1, low_open=True)
            check_number("algorithm.gamma", self.gamma, 0)
            check_number("algorithm.beta", self.beta, 0, 1, high_open=True)
            for name in ("t_adapt", "t_norm"):
                check_int(f"algorithm.{name}", getattr(self, name), 1)
            check_int("algorithm.warmup", self.warmup, 0)
            check_bool("algorithm.coverage", self.coverage)
            check_number("algorithm.eps", self.eps, 0, low_open=True)

    # --- state -------------------------------------------------------------------
    def capacities(self) -> np.ndarray:
        """Every client's capacity (p_max in HAS-FL's paper), by client id: the most each may be allocated."""
        return np.array([float(c.capacity) for c in self.ctx.federation.clients])

    State = HasFLState
    width = Allocated()
    # smoke: adaptation steps after warm-up (rounds 2-4), normalisations at rounds 2 and 4
    preset_options = {"smoke": {"warmup": 2, "t_adapt": 1, "t_norm": 2}}

    def init_state(self) -> ServerState:
        state = super().init_state()
        n = len(self.ctx.federation.clients)
        state.strategy_state = HasFLState(h_tilde=np.ones(n), h_hat=np.full(n, np.nan), alloc=self.capacities(),
                                          alloc_used=self.capacities())
        return state

    def is_adaptation_round(self, t: int) -> bool:
        return t >= self.opts.warmup and t % self.opts.t_adapt == 0

    # --- Algorithm 1 lines 20-30 -----------------------------------------------------
    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> HasFLState:
        o, st = self.opts, state.strategy_state
        h_tilde, latest = st.h_tilde.copy(), st.h_hat.copy()
        delta_bar = params.astype(np.float64) - state.params
        trainable = self.ctx.trainable
        for r in results:
            m = masks[r.client_id]
            sel = trainable if m is None else trainable[m]  # trainable coordinates among the client's
            mask = slice(None) if m is None else m
            delta_i = r.values[sel].astype(np.float64) - state.params[mask][sel]
            latest[r.client_id] = h_hat(delta_i, delta_bar[mask][sel], o.eps)
        adapted = self.is_adaptation_round(t)
        if adapted:
            ids = [r.client_id for r in results]
            h_tilde[ids] = o.beta * h_tilde[ids] + (1 - o.beta) * latest[ids]
        if t % o.t_norm == 0:
            h_tilde = h_tilde / h_tilde.mean()
        alloc = self.allocate(h_tilde, t) if adapted else st.alloc
        return replace(st, h_tilde=h_tilde, h_hat=latest, alloc=alloc, alloc_used=st.alloc)

    def allocate(self, h_tilde: np.ndarray, t: int) -> np.ndarray:
        """New allocations at an adaptation step (Eq. 6 + coverage guarantee)."""
        o = self.opts
        return allocation_rule(h_tilde, self.capacities(), o.p_min, o.gamma, o.eps, o.coverage)

    def estimate_columns(self, state: ServerState, client_id: int) -> dict[str, Any]:
        raw = float(state.strategy_state.h_hat[client_id])
        return {"h_hat": None if np.isnan(raw) else raw, "h_tilde": float(state.strategy_state.h_tilde[client_id])}


