"""One run end to end: config -> federation, model, strategy, backend -> Parquet.

:func:`run_experiment` is what ``fedsap-ray run`` and the sweeps call.
"""
from __future__ import annotations

import datetime as _dt
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import fedsap_ray
from fedsap_ray import algorithms
from fedsap_ray.algorithms.base import RunContext
from fedsap_ray.client import pick_device
from fedsap_ray.config import ExperimentConfig
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import Federation
from fedsap_ray.masks import ParamLayout
from fedsap_ray.models import build_model
from fedsap_ray.results import RunWriter
from fedsap_ray.runtime import make_backend
from fedsap_ray.seeding import seed_for
from fedsap_ray.server import RoundSummary, Server


@dataclass
class RunOutcome:
    run_id: str
    out: Path
    status: str
    final_global_accuracy: float
    best_global_accuracy: float
    wall_s: float


def build_context(cfg: ExperimentConfig, federation: Federation | None = None) -> RunContext:
    """Federation + seeded initial model + its layout and channel space."""
    fed = federation if federation is not None else build_federation(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_for(cfg.seed, 0, -1, "model-init"))
        model = build_model(cfg.model.name, num_classes=fed.num_classes, input_shape=fed.input_shape,
                            width_mult=cfg.model.width_mult, vocab_size=fed.vocab_size)
    return RunContext(cfg=cfg, federation=fed, model=model, layout=ParamLayout.from_model(model),
                      space=model.channel_space())


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def run_experiment(cfg: ExperimentConfig, out: str | Path, *, run_id: str | None = None,
                   progress: Callable[[RoundSummary], None] | None = None,
                   federation: Federation | None = None, backend=None) -> RunOutcome:
    """Run ``cfg`` and write its ``runs``/``rounds``/``clients`` rows under ``out``.

    The ``runs`` row is written first (status ``running``) and rewritten on exit with
    ``finished``, ``failed`` (with the error) or ``interrupted`` (Ctrl-C), so an
    interrupted run is visible and its completed rounds stay loadable.
    """
    torch.set_num_threads(cfg.resources.torch_threads)  # evaluation numerics (see ResourcesConfig)
    out = Path(out)
    run_id = run_id or f"{cfg.config_hash()}-{uuid.uuid4().hex[:6]}"
    writer = RunWriter(out, run_id)
    t0 = time.perf_counter()
    started = _now()
    ctx = build_context(cfg, federation)
    strategy_cls = algorithms.get(cfg.algorithm.name)
    strategy = strategy_cls(ctx, algorithms.parse_options(cfg.algorithm.name, cfg.algorithm.options))
    backend = backend if backend is not None else make_backend(cfg)
    base_row = dict(study=cfg.study, algorithm=cfg.algorithm.name, dataset=ctx.federation.dataset,
                    model=cfg.model.name, preset=cfg.preset, seed=cfg.seed,
                    num_clients=len(ctx.federation.clients), rounds=cfg.training.rounds,
                    backend=cfg.resources.backend, config_json=cfg.to_json(), config_hash=cfg.config_hash(),
                    started_at=started, package_version=fedsap_ray.__version__,
                    dataset_notes=ctx.federation.notes)
    server = Server(ctx, strategy, backend, writer, eval_models=_scratch(ctx), device=pick_device(cfg.resources.device),
                    progress=progress)
    done = {"rounds": 0}

    def row(status: str, error: str | None = None) -> dict:
        finished = None if status == "running" else _now()
        return dict(base_row, status=status, error=error, finished_at=finished, rounds_done=done["rounds"],
                    wall_s=time.perf_counter() - t0, final_global_accuracy=_nan_none(server.last_global),
                    best_global_accuracy=_nan_none(server.best))

    writer.set_run(row("running"))
    status = "failed"
    try:
        backend.start(ctx)
        state = strategy.init_state()

        def on_round(s):
            done["rounds"] = s.round
            writer.set_run(row("running"))

        server.run(state, cfg.training.rounds, on_round=on_round)
        status = "finished"
        writer.set_run(row(status))
    except KeyboardInterrupt:
        status = "interrupted"
        writer.set_run(row(status, "interrupted by the user"))
        raise
    except BaseException as e:
        writer.set_run(row("failed", f"{e.__class__.__name__}: {e}\n{traceback.format_exc(limit=5)}"))
        raise
    finally:
        backend.close()
    return RunOutcome(run_id=run_id, out=out, status=status, final_global_accuracy=server.last_global,
                      best_global_accuracy=server.best, wall_s=time.perf_counter() - t0)


def _scratch(ctx: RunContext) -> list:
    """Scratch modules for concurrent per-domain evaluation (as many as the local CPU allows)."""
    import copy

    from fedsap_ray.runtime.local import default_workers

    n = min(len(ctx.federation.test), default_workers(ctx.cfg.resources.torch_threads))
    return [copy.deepcopy(ctx.model) for _ in range(max(1, n))]


def _nan_none(x: float) -> float | None:
    return None if x is None or np.isnan(x) else float(x)
