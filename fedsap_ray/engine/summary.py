"""What one round of the engine produced, as the run's drivers read it: the summary, its phase times, the evaluation.

Defined beside the engine that fills them rather than beside the recorder that writes their rows, so the round
loop (``engine/server.py``) imports nothing of ``results/``: the session hands the server its recorder.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEPLOYED = "deployed"  # the eval mode of each client's own model (fedsap_ray.engine.evaluate)


@dataclass(frozen=True)
class PhaseTimes:
    """Where a round's wall time went (``rounds.train_s``, ``eval_s``, ``server_s``; their sum is
    ``round_wall_s``): the backend's training call (dispatch, local training, results back), the
    evaluation of the server's models and the deployed ones, and the server's own work (plans and
    aggregation). Writing the round's rows comes after and is in none of them."""

    train_s: float = 0.0
    eval_s: float = 0.0
    server_s: float = 0.0
    # and what the backend's training call moved between processes (``rounds.backend_bytes_down``/``_up``)
    moved_down: int = 0
    moved_up: int = 0
    # evaluation forwards compiled in the round (``rounds.eval_compiles``; None: evaluation not compiled)
    eval_compiles: int | None = None

    @property
    def total(self) -> float:
        return self.train_s + self.eval_s + self.server_s


@dataclass
class RoundSummary:
    """One round for the progress line and drivers (what :meth:`fedsap_ray.engine.server.Server.round` returns with the state)."""

    round: int
    evaluated: bool
    global_accuracy: float
    best_global_accuracy: float
    worst_domain: str | None
    worst_domain_accuracy: float
    avg_capacity: float
    bytes_up: int
    bytes_down: int
    train_loss: float
    wall_s: float
    per_domain: dict[str, float] = field(default_factory=dict)
    times: PhaseTimes = field(default_factory=PhaseTimes)  # wall_s by phase
    columns: dict[str, Any] = field(default_factory=dict)  # the round columns (strategy's and ground-truth ones)
    progress: str = ""  # the strategy's part of the progress line (RoundRecords.progress, filled in)
    deployed_accuracy: float | None = None  # the 'deployed' eval mode's global figure (None: not evaluated)
    worst_client_accuracy: float | None = None  # ... and its worst client
    sim_elapsed_s: float = 0.0  # simulated device seconds of rounds 1..this one (fedsap_ray.data.devices)
    n_stragglers: int = 0  # clients left out of aggregation by devices.policy this round
    lost: tuple[str, ...] = ()  # workers or nodes the Ray backend lost this round (their clients re-ran)
    # the rows this round wrote to the rounds table, as written (run_id and schema_version aside): what the
    # trackers log (fedsap_ray.run.trackers.round_metrics), so they show the table's numbers, never recomputed ones
    rows: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class RoundEvaluation:
    """A round's evaluation: (accuracy, loss) per eval mode and test domain, and per evaluated client's
    deployed model (empty when the round did not evaluate)."""

    by_mode: Mapping[str, Mapping[str, tuple[float, float]]] = field(default_factory=dict)
    deployed: Mapping[int, tuple[float, float]] = field(default_factory=dict)
