"""Shared fixtures: where the real data files are, and small configs for fast runs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fedsap_ray import algorithms
from fedsap_ray.experiment import build_context
from fedsap_ray.runtime.local import LocalBackend

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FEDSAP_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return SHARED_DATA


def shared_file(rel: str) -> Path:
    """Path of a file under ../shared/data, skipping the test (with the reason) when it is absent."""
    p = SHARED_DATA / rel
    if not p.exists():
        pytest.skip(f"real data file not found at {p} (set FEDSAP_SHARED_DATA to the folder holding it)")
    return p


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models: one intra-op thread avoids OpenMP spin-waits on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_strategy(cfg, fed):
    """(RunContext, Strategy) for ``cfg`` on a prebuilt federation, without a backend."""
    ctx = build_context(cfg, fed)
    return ctx, algorithms.get(cfg.algorithm.name)(ctx, algorithms.parse_options(cfg.algorithm.name, cfg.algorithm.options))


def run_rounds(cfg, fed, rounds):
    """Run the strategy in-process and return (ctx, strategy, states): states[0] initial, states[t] after round t."""
    ctx, strat = make_strategy(cfg, fed)
    backend = LocalBackend("cpu", num_workers=1)
    backend.start(ctx)
    states = [strat.init_state()]
    for t in range(1, rounds + 1):
        states.append(strat.aggregate(states[-1], backend.train(strat.configure_round(states[-1], t)), t))
    return ctx, strat, states
