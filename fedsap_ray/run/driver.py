"""The one driver loop: start the run(s), step every round, close each with the right status.

Both ways a run is driven use :func:`drive`: :func:`fedsap_ray.experiment.run_experiment` (one
session, in-process or on a Ray ``ServerActor``) and the Ray Tune trainable of the sweeps (one
session per seed of a trial, in lockstep). What differs between them is a list of
:class:`DriverCallback` objects, so the status rules are written once:

- ``finished``: every round ran; the checkpoint is removed.
- ``stopped``: a callback (or the session) raised :class:`~fedsap_ray.common.errors.RunStopped`,
  e.g. Tune's scheduler stopped a weak trial; the outcome is returned, nothing is raised.
- ``interrupted``: ``KeyboardInterrupt`` (Ctrl-C); re-raised after the runs are closed.
- ``failed``: any other error, with its message and a short traceback in the runs row;
  re-raised. If closing the run fails too, that second error becomes a note on the first
  (``error.__notes__``), never a replacement.

Callbacks, in the order given, see each round only once it is durable: a session saves its
checkpoint inside :meth:`~fedsap_ray.run.session.RunSession.step`, where the session lives (the
``ServerActor`` for Ray), before it counts the round as done. That is where the sweeps copy a
run's files (checkpoint included) to their destination (``on_round``/``on_finish``). A kill at
any point leaves either round t's checkpoint with a ``running`` row (a resume has nothing
left to train and closes the run ``finished``) or a ``finished`` row (never resumed; a sweep
removes a checkpoint left beside it, see ``sweeps/study.py``).
"""
from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from fedsap_ray.common.errors import RunStopped

if TYPE_CHECKING:  # annotations only: the loop itself needs no torch (fedsap_ray.run.trackers builds on it)
    from fedsap_ray.engine.server import RoundSummary
    from fedsap_ray.run.session import RunOutcome, SessionMetrics


class Drivable(Protocol):
    """What the loop needs of a session: :class:`~fedsap_ray.run.session.RunSession`, or its remote proxy."""

    def start(self) -> int: ...

    def step(self, t: int) -> RoundSummary: ...

    def metrics(self, workers: bool = False) -> SessionMetrics: ...

    def finish(self, status: str, error: str | None = None) -> RunOutcome: ...


class DriverCallback:
    """Hooks of :func:`drive`; each does nothing unless overridden. Raising
    :class:`~fedsap_ray.common.errors.RunStopped` from a hook stops every run with status ``stopped``."""

    def on_start(self, metrics: Sequence[SessionMetrics]) -> None:
        """After every session started (``metrics`` include each backend's workers)."""

    def on_round(self, t: int, summaries: Sequence[RoundSummary], metrics: Sequence[SessionMetrics]) -> None:
        """After round ``t`` is checkpointed; ``summaries`` of the sessions that ran it (a resumed
        session already past ``t`` sits it out), ``metrics`` of every session."""

    def on_finish(self, outcomes: Sequence[RunOutcome | None]) -> None:
        """After every session was closed (``None`` where closing it failed)."""


class Progress(DriverCallback):
    """Calls ``fn(summary)`` for every round of every session (what ``run_experiment(progress=...)`` takes)."""

    def __init__(self, fn: Callable[[RoundSummary], None]) -> None:
        self.fn = fn

    def on_round(self, t: int, summaries: Sequence[RoundSummary], metrics: Sequence[SessionMetrics]) -> None:
        for s in summaries:
            self.fn(s)


def drive(sessions: Sequence[Drivable], rounds: int, callbacks: Sequence[DriverCallback] = ()) -> list[RunOutcome]:
    """Run ``sessions`` in lockstep to ``rounds`` and close each; see the module docstring for the statuses."""
    try:
        starts = [s.start() for s in sessions]
        if callbacks:
            metrics = [s.metrics(workers=True) for s in sessions]
            for cb in callbacks:
                cb.on_start(metrics)
        for t in range(min(starts, default=rounds) + 1, rounds + 1):
            summaries = [s.step(t) for s, done in zip(sessions, starts) if done < t]
            if callbacks:
                metrics = [s.metrics() for s in sessions]
                for cb in callbacks:
                    cb.on_round(t, summaries, metrics)
    except RunStopped as e:
        return _close(sessions, callbacks, "stopped", str(e) or "stopped early by its caller")
    except KeyboardInterrupt as e:
        _close(sessions, callbacks, "interrupted", "interrupted by the user", cause=e)
        raise
    except BaseException as e:
        _close(sessions, callbacks, "failed", f"{e.__class__.__name__}: {e}\n{traceback.format_exc(limit=5)}", cause=e)
        raise
    return _close(sessions, callbacks, "finished")


def drive_one(session: Drivable, rounds: int, callbacks: Sequence[DriverCallback] = ()) -> RunOutcome:
    """:func:`drive` for a single session."""
    (outcome,) = drive([session], rounds, callbacks)
    return outcome


def _close(sessions: Sequence[Drivable], callbacks: Sequence[DriverCallback], status: str, message: str | None = None,
           cause: BaseException | None = None) -> list[RunOutcome]:
    """Close every session with ``status`` (each even if another's close failed), then tell the callbacks.

    After an error (``cause``), a failure to close becomes a note on that error, which the
    caller re-raises; otherwise the first such failure is raised once every session was closed.
    """
    outcomes: list[RunOutcome | None] = []
    first: BaseException | None = None
    for s in sessions:
        try:
            outcomes.append(s.finish(status, message if status != "finished" else None))
        except Exception as second:
            outcomes.append(None)
            if cause is None:
                first = first or second
            else:
                add_note(cause, f"the runs row could not be updated to status {status!r}: "
                                f"{second.__class__.__name__}: {str(second).splitlines()[0] if str(second) else ''}")
    for cb in callbacks:
        try:
            cb.on_finish(outcomes)
        except Exception as second:
            if cause is None:
                first = first or second
            else:
                add_note(cause, f"closing the run failed: {second.__class__.__name__}: {second}")
    if first is not None:
        raise first
    return [o for o in outcomes if o is not None]


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (Python >= 3.11), or the same ``__notes__`` list on 3.10."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # pragma: no cover - Python 3.10
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]
