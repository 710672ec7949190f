"""The local backend's worker processes (``resources.local_parallelism=processes``): the threaded backend's
numbers exactly, a killed worker replaced with its clients re-run, a failing client named."""
from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest

from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.data.base import DomainData
from fedsap_ray.errors import ClientError
from fedsap_ray.experiment import run_experiment
from fedsap_ray.runtime import make_backend
from fedsap_ray.runtime.local import LocalBackend
from fedsap_ray.runtime.processes import ProcessBackend
from tests.conftest import federation_fixture, make_strategy, tiny_overrides

TINY = tiny_overrides("fedavg", "data.num_clients=4", "training.rounds=2")
fed = federation_fixture(TINY)


def _train_rounds(cfg, fed, backend, rounds, between=None):
    """Each round's results from ``backend``; ``between(t)`` runs before round ``t``'s training."""
    ctx, strat = make_strategy(cfg, fed)
    backend.start(ctx)
    state, outs = strat.init_state(), []
    try:
        for t in range(1, rounds + 1):
            plans = strat.configure_round(state, t)
            if between is not None:
                between(t)
            outs.append(backend.train(plans))
            state = strat.aggregate(state, plans, outs[-1], t).state
    finally:
        backend.close()
    return outs


def _assert_same(a, b):
    assert [[r.client_id for r in rs] for rs in a] == [[r.client_id for r in rs] for rs in b]
    for ra, rb in zip((r for rs in a for r in rs), (r for rs in b for r in rs)):
        np.testing.assert_array_equal(ra.values, rb.values)
        assert (ra.steps, ra.samples_seen, ra.train_loss) == (rb.steps, rb.samples_seen, rb.train_loss)
        assert ra.stats.keys() == rb.stats.keys()
        for k in ra.stats:
            np.testing.assert_array_equal(ra.stats[k], rb.stats[k])


def test_worker_processes_give_the_threaded_backends_numbers(fed):
    # FedSAP past its warm-up: client hooks (Eq. 7, channel statistics, the probe) on sliced sub-models
    cfg = build_config(preset="smoke", overrides=[*TINY, "algorithm.name=fedsap", "algorithm.warmup=1"])
    assert isinstance(make_backend(build_config(preset="smoke", overrides=[*TINY, "resources.local_parallelism=processes"])),
                      ProcessBackend)
    threads = _train_rounds(cfg, fed, LocalBackend("cpu", num_workers=2), 2)
    procs = _train_rounds(cfg, fed, ProcessBackend("cpu", num_workers=2), 2)
    _assert_same(threads, procs)


def test_a_killed_worker_process_is_replaced_and_its_clients_rerun(fed):
    cfg = build_config(preset="smoke", overrides=TINY)
    backend = ProcessBackend("cpu", num_workers=2)
    before: list[int] = []

    def kill_one(t: int) -> None:
        if t == 2:  # between rounds: the next plan sent to it finds it dead
            before.extend(backend.pids)
            os.kill(backend.pids[0], signal.SIGKILL)

    procs = _train_rounds(cfg, fed, backend, 3, between=kill_one)
    assert backend.restarts == 1 and backend.pids[0] != before[0] and backend.pids[1] == before[1]
    _assert_same(_train_rounds(cfg, fed, LocalBackend("cpu", num_workers=1), 3), procs)


def test_a_failing_client_in_a_worker_process_is_named_and_fails_the_run(tmp_path, fed):
    broken = DomainData(fed.train[fed.clients[1].domain].x, fed.train[fed.clients[1].domain].y.clone())
    broken.y[fed.clients[1].indices[:3]] = 99  # labels outside the classes: cross-entropy raises
    fed_broken = dataclasses.replace(fed, train={**fed.train, fed.clients[1].domain: broken})
    cfg = build_config(preset="smoke", overrides=[*TINY, "resources.local_parallelism=processes"])
    with pytest.raises(ClientError, match="client 1 failed in round 1"):
        run_experiment(cfg, tmp_path, run_id="p", federation=fed_broken)
    assert results.load(tmp_path).runs.loc[0, "status"] == "failed"
