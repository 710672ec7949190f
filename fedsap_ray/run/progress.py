"""One progress line per round on stderr (log-friendly, works in notebooks and on clusters).

The line ends with the strategy's own summary (``RoundSummary.progress``: the template its ``aggregate``
returned in ``RoundRecords.progress``, filled with the round's columns), so no algorithm is named here.
"""
from __future__ import annotations

import sys
from typing import TextIO

from fedsap_ray.engine.server import RoundSummary


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}MB"


class ProgressPrinter:
    def __init__(self, rounds: int, stream: TextIO | None = None) -> None:
        self.rounds = rounds
        self.stream = stream or sys.stderr
        self.width = len(str(rounds))

    def __call__(self, s: RoundSummary) -> None:
        head = f"round {s.round:>{self.width}}/{self.rounds}"
        if s.evaluated:
            acc = (f"global acc {s.global_accuracy:.4f} (best {s.best_global_accuracy:.4f}, "
                   f"worst {s.worst_domain} {s.worst_domain_accuracy:.4f})")
            if s.deployed_accuracy is not None:
                acc += f"  deployed {s.deployed_accuracy:.4f} (worst client {s.worst_client_accuracy:.4f})"
        else:
            acc = "not evaluated"
        print(f"{head}  {acc}  train loss {s.train_loss:.3f}  trained width {s.avg_capacity:.2f}  "
              f"up {_mb(s.bytes_up)} down {_mb(s.bytes_down)}  {s.wall_s:.1f}s{_phases(s)}{_simulated(s)}{s.progress}{_lost(s)}",
              file=self.stream, flush=True)


def _phases(s: RoundSummary) -> str:
    """`` (train 4.1 eval 1.2 server 0.1)``: where the round's seconds went (rounds.train_s, eval_s, server_s)."""
    t = s.times
    return f" (train {t.train_s:.1f} eval {t.eval_s:.1f} server {t.server_s:.1f})" if t.total > 0 else ""


def _lost(s: RoundSummary) -> str:
    """``  [node 3c38abb3a1f0 lost: replaced, their clients re-ran]``: what the Ray backend lost this round."""
    return f"  [{'; '.join(s.lost)}: replaced, their clients re-ran]" if s.lost else ""


def _simulated(s: RoundSummary) -> str:
    """``  device time 4.2min (3 late)``: simulated device hours so far (rounds.sim_elapsed_s) and this round's
    stragglers (docs/guides/device-time.md)."""
    late = f" ({s.n_stragglers} late)" if s.n_stragglers else ""
    x = s.sim_elapsed_s
    shown = f"{x:.1f}s" if x < 120 else f"{x / 60:.1f}min" if x < 7200 else f"{x / 3600:.2f}h"
    return f"  device time {shown}{late}"
