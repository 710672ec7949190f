"""One run's server side: what both backends and the sweeps share.

:class:`RunSession` owns a run's context, strategy, backend, writer and checkpoints; the one
driver loop, :func:`fedsap_ray.run.driver.drive`, runs its rounds and closes it with the right status.
The local path drives a session in-process; the Ray backend (:mod:`fedsap_ray.runtime.ray`) hosts
one in a ``ServerActor`` and drives the same methods remotely. Callers read a session's progress
through :meth:`RunSession.metrics`, a read-only :class:`SessionMetrics` (also what crosses the
wire from the ``ServerActor``). The session takes its backend from the caller, so this module
needs nothing from :mod:`fedsap_ray.runtime` (which imports it: the Ray backend hosts sessions).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

import fedsap_ray
from fedsap_ray import algorithms
from fedsap_ray.data import devices
from fedsap_ray.persist import checkpoint, statecheck
from fedsap_ray.run import resume
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.algorithms.statetree import state_tree
from fedsap_ray.engine.client import DIVERGED_HINT, default_workers, pick_device
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import Federation
from fedsap_ray.data.explicit import partition_digest
from fedsap_ray.common.errors import ClientError, ConfigError
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ServerState
from fedsap_ray.models import build_model
from fedsap_ray.results import RunWriter
from fedsap_ray.results.kept import ModelKeeper
from fedsap_ray.results.recorder import Recorder
from fedsap_ray.config.schema import ExperimentConfig
from fedsap_ray.common.seeding import seed_for
from fedsap_ray.engine.server import Backend, RoundSummary, Server, deployed_sample

if TYPE_CHECKING:
    from fedsap_ray.engine.asyncmode import AsyncServer


@dataclass
class RunOutcome:
    run_id: str
    out: Path
    status: str
    final_global_accuracy: float
    best_global_accuracy: float
    wall_s: float
    worker_restarts: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    """Where one client worker runs (Ray backend): its actor name, GPU, process and placement group."""

    name: str
    gpu_id: int | None
    pid: int
    device: str
    placement_group: str | None  # hex id, None outside a placement group
    node: str = "local"  # Ray node id, first 12 hex digits
    malloc_tuned: bool = False  # whether the worker fixed glibc malloc's thresholds (fedsap_ray.runtime.allocator)


@dataclass(frozen=True)
class SessionMetrics:
    """A read-only view of a run's progress, for drivers and sweeps (nothing here can change the run).

    ``global_accuracy``/``best_global_accuracy`` are those of the primary eval mode (NaN before
    the first evaluation); ``deployed_accuracy`` is the last round's 'deployed' figure (None when
    that round did not evaluate it). ``workers`` is filled only when asked for (it queries them).
    """

    run_id: str
    round: int  # rounds done
    rounds: int  # rounds planned
    global_accuracy: float
    best_global_accuracy: float
    deployed_accuracy: float | None = None
    worker_restarts: int = 0
    workers: tuple[WorkerInfo, ...] = ()


def build_context(cfg: ExperimentConfig, federation: Federation | None = None) -> RunContext:
    """Federation + seeded initial model + its layout and channel space."""
    fed = federation if federation is not None else build_federation(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_for(cfg.seed, 0, -1, "model-init"))
        try:
            model = build_model(cfg.model.name, num_classes=fed.num_classes, input_shape=fed.input_shape,
                                width_mult=cfg.model.width_mult, vocab_size=fed.vocab_size)
        except ValueError as e:  # a model that cannot take this dataset's inputs is bad input, not a failed run
            raise ConfigError(f"invalid model.name={cfg.model.name!r}: {e} (dataset {fed.dataset} gives "
                              f"{fed.input_kind} inputs of shape {tuple(fed.input_shape)})") from e
    return RunContext(cfg=cfg, federation=fed, model=model, layout=ParamLayout.from_model(model),
                      space=model.channel_space())


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def cpu_kernels() -> str:
    """Which CPU kernels this process's torch runs, e.g. ``aten=AVX512 onednn=max``.

    Why it is recorded: torch (ATen) and oneDNN each pick their kernels by the CPU's instruction set, and
    kernels of different instruction sets round differently, so one config and seed give the same numbers
    on two machines only when this string is the same on both. ``ATEN_CPU_CAPABILITY`` and
    ``ONEDNN_MAX_CPU_ISA`` lower the choice (docs/architecture.md#determinism); oneDNN has no query, so its
    part is the environment variable, ``max`` when unset (the machine's best)."""
    import os

    return (f"aten={torch.backends.cpu.get_cpu_capability()} "
            f"onednn={os.environ.get('ONEDNN_MAX_CPU_ISA', '').strip().upper() or 'max'}")


def run_row(cfg: ExperimentConfig, *, dataset: str, num_clients: int, notes: str = "",
            partition_source: str | None = None, partition_hash: str | None = None) -> dict:
    """The provenance part of a run's ``runs`` row (status, times and accuracies are added by the writer's caller);
    ``partition_source``/``partition_hash``: what the federation trained says (None before one was built)."""
    return dict(study=cfg.study, algorithm=cfg.algorithm.name, dataset=dataset, model=cfg.model.name,
                preset=cfg.preset, seed=cfg.seed, num_clients=num_clients, rounds=cfg.training.rounds,
                backend=cfg.resources.backend, config_json=cfg.to_json(), config_hash=cfg.config_hash(),
                started_at=_now(), package_version=fedsap_ray.__version__, torch_version=torch.__version__,
                cpu_kernels=cpu_kernels(), dataset_notes=notes, partition_source=partition_source,
                partition_hash=partition_hash)


def record_failed_start(cfg: ExperimentConfig, out: str | Path, run_id: str, error: BaseException) -> None:
    """A ``runs`` row (status ``failed``, the error) for a run that failed before it could start
    (e.g. its data could not be loaded), so a sweep's runs table shows every trial."""
    row = run_row(cfg, dataset=cfg.data.name, num_clients=cfg.data.num_clients)
    RunWriter(Path(out), run_id).set_run(dict(row, status="failed", error=f"{error.__class__.__name__}: {error}",
                                              finished_at=row["started_at"], rounds_done=0))


class RunSession:
    """One run's server side: context, strategy, backend, writer and the round loop.

    The local path drives it in-process; the Ray backend hosts it inside a
    ``ServerActor`` and drives the same methods remotely, so both share every line of
    the round logic. The ``runs`` row is written at creation (status ``running``),
    after every round, and by :meth:`finish` (``finished``, ``failed`` with the error,
    or ``interrupted``), so an interrupted run is visible and its rounds stay loadable.
    """

    def __init__(self, cfg: ExperimentConfig, out: str | Path, run_id: str, *,
                 backend: Backend, federation: Federation | None = None, resume: bool = False) -> None:
        torch.set_num_threads(cfg.resources.torch_threads)  # evaluation numerics (see ResourcesConfig)
        self.cfg, self.out, self.run_id = cfg, Path(out), run_id
        self.t0 = time.perf_counter()
        self.writer = RunWriter(self.out, run_id)
        self.ctx = build_context(cfg, federation)
        self.strategy = algorithms.get(cfg.algorithm.name)(self.ctx, cfg.algorithm.opts)  # options typed once, by the config
        self.backend = backend
        deployed_clients, sampled = deployed_sample(self.ctx)
        self.recorder = Recorder.for_strategy(self.ctx, self.strategy, self.writer, sampled)  # the server is handed it
        self.engine: AsyncServer | None = None  # the asynchronous engine: each checkpoint holds its state too
        self.server = self._engine(cfg, deployed_clients)
        fed = self.ctx.federation
        self._refuse_empty_rounds()
        # what was trained, from the federation itself (a given one too), not from what the config names
        self.base_row = run_row(cfg, dataset=fed.dataset, num_clients=len(fed.clients), notes=fed.notes,
                                partition_source=fed.partition_source, partition_hash=partition_digest(fed))
        # the models the run keeps under OUT/models/<run_id>/ (training.keep_model), of the clients it evaluates
        self.keeper = ModelKeeper(self.out, run_id, self.ctx, self.strategy, self.server.deployed_clients)
        self.last_summary: RoundSummary | None = None
        self.state: ServerState | None = None
        self.prior_wall_s = 0.0
        self._resumed: ServerState | None = None
        if resume:  # every check first: nothing of the run is deleted or rewritten before they all pass
            self._resumed = self._resume()
        self.writer.set_run(self._row("running"))

    def _engine(self, cfg: ExperimentConfig, deployed_clients: list[int]) -> Server:
        """The round engine: the synchronous :class:`Server`, or the asynchronous engine (``devices.mode=async``,
        also kept as ``self.engine``: its state goes into every checkpoint)."""
        server_cls = Server
        if cfg.devices.mode == "async":  # asynchronous server steps on the simulated clock (issue 44)
            from fedsap_ray.engine.asyncmode import AsyncServer

            server_cls = AsyncServer
        server = server_cls(self.ctx, self.strategy, self.backend, self.recorder, deployed_clients,
                            eval_models=_scratch(self.ctx), device=pick_device(cfg.resources.device))
        if cfg.devices.mode == "async":
            self.engine = cast("AsyncServer", server)
        return server

    def _refuse_empty_rounds(self) -> None:
        """A round in which no client can train (``devices.availability``, a trace) is refused now, before any work."""
        cfg = self.cfg
        if cfg.devices.availability < 1 or cfg.devices.trace is not None:
            empty = devices.empty_round(cfg, self.strategy.sampler.devices(), range(1, cfg.training.rounds + 1))
            if empty is not None:
                raise devices.no_client_error(cfg, empty)

    def _resume(self) -> ServerState:
        """The state to resume from. Every check comes first (:mod:`fedsap_ray.run.resume`: the checkpoint, the
        strategy's state, the runs row's config and partition), then what is restored in memory (the engine, the
        recorder's metrics, the kept models' count), and only then the first write: the tables rewound to the
        checkpoint's round (:meth:`_rewind_files`)."""
        cfg, run_id = self.cfg, self.run_id
        ck, where = resume.load_checked(self.out, run_id, self.ctx, self.strategy, self.recorder.metrics_state(),
                                        cfg.training.rounds)
        st = ck["state"]
        own = resume.strategy_state(self.strategy, st.strategy_state, run_id, self.out, cfg.algorithm.name)
        old = self.writer.previous_row()
        resume.check_same_config(run_id, old, cfg)
        resume.check_same_partition(run_id, old, self.base_row)
        state = ServerState(round=st.round, params=st.params, strategy_state=own)
        if self.engine is not None:  # the event queue, the clients in flight, the clock: checked, then set
            self.engine.load_state_dict(ck.get("engine"), state, where)
        elif "engine" in ck:
            raise statecheck.BadCheckpoint(f"{where} holds an asynchronous engine's state; this run has "
                                           f"devices.mode={cfg.devices.mode}")
        if self.server.privacy is not None:  # C, the releases composed, the local participations
            try:
                self.server.privacy.load_state_dict(ck.get("privacy"), where)
            except ValueError as e:
                raise statecheck.BadCheckpoint(str(e)) from e
        self.recorder.restore_metrics(ck["server"])
        self.keeper.check_resume(st.round, ck["server"], where)  # the kept best model the checkpoint counted
        self._rewind_files(state.round, old)
        return state

    def _rewind_files(self, round_: int, old: dict | None) -> None:
        """The run's tables back to ``round_`` (the first write of a resume), and the runs row's provenance kept
        from the row the run started with."""
        self.writer.restore(round_)
        if old is not None:
            self.base_row["started_at"] = old["started_at"]
            # the provenance stays the bytes the run started with (a re-serialised config
            # can spell the same numbers differently, e.g. 7 as 7.0)
            self.base_row["config_json"] = old["config_json"] or self.base_row["config_json"]
            self.prior_wall_s = float(old["wall_s"] or 0.0)

    def start(self) -> int:
        """Start the backend; return the last completed round (0, or the checkpoint's when resuming)."""
        self.backend.start(self.ctx)
        if self._resumed is None:
            self.keeper.start_fresh()
        self.state = self._resumed if self._resumed is not None else self.strategy.init_state()
        return self.state.round

    def step(self, t: int) -> RoundSummary:
        assert self.state is not None, "RunSession.start() first"
        best_before = self.recorder.best
        try:
            state, summary = self.server.round(self.state, t)
        except ClientError as e:
            if DIVERGED_HINT not in str(e):
                raise
            raise ClientError(str(e).replace(DIVERGED_HINT, diverged(self.cfg))) from e
        bad = np.count_nonzero(~np.isfinite(state.params))
        if bad:  # a server step that diverged: never checkpointed (a resume would refuse it) nor trained on
            raise FloatingPointError(f"round {t}: the model holds {bad} non-finite value(s) after the server's step "
                                     f"({diverged(self.cfg)})")
        take = getattr(self.backend, "take_losses", None)
        lost = tuple(take()) if take is not None else ()
        if lost:
            summary = dataclasses.replace(summary, lost=lost)
        # a best model before the checkpoint: a kill in between resumes from round t-1 and keeps round t again
        self.keeper.after_round(state, _improved(best_before, self.recorder.best, summary.evaluated), self.recorder,
                                self.base_row["config_json"])
        tree = ServerState(round=state.round, params=state.params,
                           strategy_state=state_tree(self.strategy, state.strategy_state))
        checkpoint.save(self.out, self.run_id, tree, self.recorder.metrics_state(),
                        tables=self.writer.tables_written(), rows=self.writer.counts,
                        engine=None if self.engine is None else self.engine.state_dict(),
                        privacy=None if self.server.privacy is None else self.server.privacy.state_dict())
        self.state, self.last_summary = state, summary  # only now is round t done: a resume can continue after it
        self.writer.set_run(self._row("running"))
        return summary

    def finish(self, status: str, error: str | None = None) -> RunOutcome:
        kept_error: Exception | None = None
        try:
            if status in ("finished", "stopped") and self.writer.lost is None:
                try:  # before the runs row says so: a kill in between leaves a run a resume finishes again
                    self.keeper.at_end(self.state, self.recorder, self.base_row["config_json"])
                except Exception as e:  # e.g. a full disk: the run fails, its checkpoint stays for a resume
                    kept_error = e
                    status, error = "failed", f"its final model could not be kept: {e.__class__.__name__}: {e}"
            self.writer.set_run(self._row(status, error))
            if status == "finished":
                checkpoint.remove(self.out, self.run_id)
        finally:
            self.backend.close()
        if kept_error is not None:
            raise kept_error
        return RunOutcome(run_id=self.run_id, out=self.out, status=status,
                          final_global_accuracy=self.recorder.last_global, best_global_accuracy=self.recorder.best,
                          wall_s=self.prior_wall_s + time.perf_counter() - self.t0,
                          worker_restarts=int(getattr(self.backend, "restarts", 0)))

    def metrics(self, workers: bool = False) -> SessionMetrics:
        """The run's progress so far; ``workers``: also where its client workers run (asks each one)."""
        last = self.last_summary
        info = getattr(self.backend, "worker_info", None) if workers else None
        return SessionMetrics(run_id=self.run_id, round=self._rounds_done(), rounds=self.cfg.training.rounds,
                              global_accuracy=float(self.recorder.last_global),
                              best_global_accuracy=float(self.recorder.best),
                              deployed_accuracy=None if last is None else last.deployed_accuracy,
                              worker_restarts=int(getattr(self.backend, "restarts", 0)),
                              workers=tuple(info()) if info is not None else ())

    def _row(self, status: str, error: str | None = None) -> dict:
        return dict(self.base_row, status=status, error=error, finished_at=None if status == "running" else _now(),
                    rounds_done=self._rounds_done(), wall_s=self.prior_wall_s + time.perf_counter() - self.t0,
                    final_global_accuracy=_nan_none(self.recorder.last_global),
                    best_global_accuracy=_nan_none(self.recorder.best), models_kept=self.keeper.models_kept())

    def _rounds_done(self) -> int:
        state = self.state if self.state is not None else self._resumed
        return 0 if state is None else state.round


def step_sizes(cfg: ExperimentConfig) -> dict[str, float]:
    """The settings that scale this run's steps, by name: ``training.lr``, in ``devices.mode=async``
    ``asynchronous.server_lr``, and the strategy's own (an option named ``*_lr``, e.g. SCAFFOLD's ``global_lr``)."""
    sizes = {"training.lr": cfg.training.lr}
    if cfg.devices.mode == "async":
        sizes["asynchronous.server_lr"] = cfg.asynchronous.server_lr
    opts = cfg.algorithm.opts
    for f in dataclasses.fields(opts) if dataclasses.is_dataclass(opts) else ():
        if f.name.endswith("_lr"):
            sizes[f"algorithm.{f.name}"] = getattr(opts, f.name)
    return sizes


def diverged(cfg: ExperimentConfig) -> str:
    """What a divergence message suggests: lower one of the run's step sizes (:func:`step_sizes`), each named
    with its value, so the hint names the setting that matters in this run's mode."""
    return "diverged; lower " + " or ".join(f"{k}={v:g}" for k, v in step_sizes(cfg).items()) + "?"


def _scratch(ctx: RunContext) -> list:
    """Scratch modules for concurrent per-domain evaluation (as many as the local CPU allows)."""
    n = min(len(ctx.federation.test), default_workers(ctx.cfg.resources.torch_threads))
    return [copy.deepcopy(ctx.model) for _ in range(max(1, n))]


def _nan_none(x: float) -> float | None:
    return None if x is None or np.isnan(x) else float(x)


def _improved(before: float, after: float, evaluated: bool) -> bool:
    """Whether an evaluated round strictly raised the best-so-far global accuracy of the first eval mode (the
    round a ``best`` model is kept at; NaN before the first evaluation)."""
    return evaluated and not np.isnan(after) and (np.isnan(before) or after > before)
