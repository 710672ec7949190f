"""One run end to end: config -> federation, model, strategy, backend -> Parquet.

:func:`run_experiment` is what ``fedsap-ray run`` calls: the checks before any write, the run
claim, then a :class:`~fedsap_ray.run.session.RunSession` driven in-process or, for the Ray backend,
hosted on a ``ServerActor``, by the one driver loop (:func:`fedsap_ray.run.driver.drive`). The
session's names are re-exported here.
"""
from __future__ import annotations

import uuid
from pathlib import Path
from collections.abc import Callable, Sequence

from fedsap_ray.persist import checkpoint
from fedsap_ray.persist.outdir import OutDir
from fedsap_ray.results import aside
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import Federation
from fedsap_ray.run.driver import DriverCallback, Progress, add_note, drive, drive_one
from fedsap_ray.common.errors import ConfigError, RunStopped
from fedsap_ray.runtime import make_backend
from fedsap_ray.config.schema import ExperimentConfig
from fedsap_ray.engine.server import RoundSummary
from fedsap_ray.run.session import RunOutcome, RunSession, SessionMetrics, build_context, record_failed_start, run_row

__all__ = ["DriverCallback", "RunOutcome", "RunSession", "RunStopped", "SessionMetrics", "add_note", "build_context",
           "drive", "new_run_id", "record_failed_start", "run_experiment", "run_row"]


def new_run_id(cfg: ExperimentConfig) -> str:
    """A fresh run id: the config hash plus a random suffix."""
    return f"{cfg.config_hash()}-{uuid.uuid4().hex[:6]}"


def run_experiment(cfg: ExperimentConfig, out: str | Path, *, run_id: str | None = None,
                   progress: Callable[[RoundSummary], None] | None = None,
                   federation: Federation | None = None, backend=None, resume: bool = False,
                   overwrite: bool = False, callbacks: Sequence[DriverCallback] = ()) -> RunOutcome:
    """Run ``cfg`` and write its ``runs``/``rounds``/``clients`` rows under ``out``.

    ``resume=True`` continues run ``run_id`` from its last checkpoint in ``out``; the
    finished tables equal those of an uninterrupted run.

    Before anything is written (each refusal a :class:`ConfigError` naming the field):
    the run id must be safe as a file name, ``out`` a writable folder, the device
    present, and the id not in use by another process (:class:`fedsap_ray.run.guard.RunClaim`,
    held for the whole run); a new run refuses an id ``out`` already holds unless
    ``overwrite`` (the old run is then moved aside and deleted only once the new run has
    checkpointed its first round; if the new run fails or stops before that, the old one is
    restored: :mod:`fedsap_ray.results.aside`); a resume refuses when a file the run had
    written is missing, unreadable or inconsistent with its checkpoint.

    ``progress(summary)`` is called after every round; ``callbacks`` are further hooks of the
    driver loop (:class:`fedsap_ray.run.driver.DriverCallback`; one may stop the run early by
    raising :class:`RunStopped`: the outcome then has status ``stopped``).
    """
    from fedsap_ray import results
    from fedsap_ray.run import guard
    from fedsap_ray.runtime import limits

    if resume and not run_id:
        raise ConfigError("invalid resume: needs the run_id of the run to continue")
    run_id = results.check_run_id(run_id, "--resume" if resume else "--run-id") if run_id else new_run_id(cfg)
    out = Path(out)
    if backend is None:
        guard.check_device(cfg)
        limits.check_resources(cfg)
    with guard.claimed(out, run_id, resume=resume, overwrite=overwrite) as claim:
        # loading the data checks the partition against it (e.g. more clients than samples)
        fed = federation if federation is not None else build_federation(cfg)
        hooks = [*([Progress(progress)] if progress is not None else []), *callbacks]
        if claim["previous"] is None:
            return _run(cfg, out, run_id, fed, resume, backend, hooks)
        # --overwrite: the old run is moved aside, not deleted, until the new one has checkpointed a round
        aside.set_aside(out, run_id)
        keep = _CommitOverwrite(out, run_id)
        try:
            outcome = _run(cfg, out, run_id, fed, resume, backend, [keep, *hooks])
        except BaseException:
            if not keep.done:
                aside.restore(out, run_id)
            raise
        if not keep.done:  # ended (stopped, failed) before its first checkpoint: the old run comes back
            aside.restore(out, run_id)
        return outcome


class _CommitOverwrite(DriverCallback):
    """After the new run's first checkpointed round, the run it replaces is deleted for good."""

    def __init__(self, out: Path, run_id: str) -> None:
        self.out, self.run_id, self.done = out, run_id, False

    def on_round(self, t, summaries, metrics) -> None:
        if not self.done and OutDir(self.out).is_file(checkpoint.path_for(self.out, self.run_id)):
            aside.commit(self.out, self.run_id)
            self.done = True


def _run(cfg: ExperimentConfig, out: Path, run_id: str, fed: Federation, resume: bool, backend,
         hooks: list[DriverCallback]) -> RunOutcome:
    if cfg.resources.backend == "ray" and backend is None:
        from fedsap_ray.runtime.ray import run_on_ray  # Ray is imported only here

        return run_on_ray(cfg, out.resolve(), run_id, callbacks=hooks, federation=fed, resume=resume)
    session = RunSession(cfg, out, run_id, federation=fed, resume=resume,
                         backend=backend if backend is not None else make_backend(cfg))
    return drive_one(session, cfg.training.rounds, hooks)
