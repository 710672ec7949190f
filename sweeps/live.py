"""The sweep driver's live progress line (replaces Tune's console output, see ``sweeps/__init__.py``)."""
from __future__ import annotations

import math
import sys
import time

from ray import tune

from sweeps.trials import METRIC


class LiveProgress(tune.Callback):
    """One line: trials done / running / failed of the total, and the best value so far.

    Rewritten in place on a terminal; on a log (not a TTY) printed whenever the counts
    or the best value change, at most every ``every_s`` seconds otherwise.
    """

    def __init__(self, total: int, metric: str = METRIC, stream=None, every_s: float = 30.0) -> None:
        self.total, self.metric, self.every_s = total, metric, every_s
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.running: set[str] = set()
        self.done = self.failed = 0
        self.best: tuple[float, str] | None = None
        self.errored: list = []  # trials that failed after their retries
        self.retries = 0
        self._last = ("", 0.0)
        self.t0 = time.perf_counter()

    def line(self) -> str:
        best = "-" if self.best is None else f"{self.best[0]:.4f} ({self.best[1]})"
        retried = f" ({self.retries} retries)" if self.retries else ""
        return (f"trials {self.done}/{self.total} done, {len(self.running)} running, {self.failed} failed{retried}; "
                f"best {self.metric} {best}; {time.perf_counter() - self.t0:.0f} s")

    def _show(self, force: bool = False) -> None:
        text = self.line()
        key = text.rsplit(";", 1)[0]
        now = time.perf_counter()
        if not force and key == self._last[0] and now - self._last[1] < self.every_s:
            return
        self._last = (key, now)
        if self.tty:
            print("\r" + text.ljust(100), end="", file=self.stream, flush=True)
        else:
            print(text, file=self.stream, flush=True)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.running.add(trial.trial_id)
        self._show()

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        v = result.get(self.metric)
        if v is not None and not math.isnan(v) and (self.best is None or v > self.best[0]):
            self.best = (float(v), str(result.get("run_id", trial.trial_id)))
        self._show()

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.running.discard(trial.trial_id)
        self.done += 1
        self._show()

    def on_trial_recover(self, iteration, trials, trial, **info) -> None:
        self.retries += 1  # failed, and FailureConfig restarts it (it resumes from its checkpoint)
        self._show()

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.running.discard(trial.trial_id)
        self.failed += 1
        self.errored.append(trial)
        self._show()

    def on_experiment_end(self, trials, **info) -> None:
        self._show(force=True)
        if self.tty:
            print(file=self.stream)
