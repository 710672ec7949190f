"""Per-client overhead paid once per run (issue 27): prepared client data, the torch warm-up, the guarded move.

None of it may change a number: a backend's results equal those of training each client on its raw
data with a fresh model, the way every client was trained before."""
from __future__ import annotations

import copy
import dataclasses
import types

import numpy as np
import pytest
import torch

from fedsap_ray.engine import client as client_mod
from fedsap_ray.engine.client import PreparedData, to_device, train_client, warm_torch
from fedsap_ray.config import build_config
from fedsap_ray.data.base import DomainData, as_input
from fedsap_ray.runtime import local as local_mod
from fedsap_ray.runtime import wire
from fedsap_ray.runtime.local import LocalBackend
from tests.conftest import federation_fixture, make_strategy, tiny_overrides

TINY = tiny_overrides("fedavg", "data.num_clients=4", "training.rounds=3")
fed = federation_fixture(TINY)


def _counting(fed):
    calls: list[int] = []
    original = fed.client_data

    def client_data(cid: int) -> DomainData:
        calls.append(cid)
        return original(cid)

    return calls, client_data


def _rounds(cfg, fed, backend, rounds):
    ctx, strat = make_strategy(cfg, fed)
    backend.start(ctx)
    state, outs = strat.init_state(), []
    try:
        for t in range(1, rounds + 1):
            plans = strat.configure_round(state, t)
            outs.append((plans, backend.train(plans)))
            state = strat.aggregate(state, plans, outs[-1][1], t).state
    finally:
        backend.close()
    return ctx, state, outs


def test_client_data_is_prepared_once_per_run(fed, monkeypatch):
    cfg = build_config(preset="smoke", overrides=TINY)
    calls, counting = _counting(fed)
    monkeypatch.setattr(fed, "client_data", counting)
    _, _, outs = _rounds(cfg, fed, LocalBackend("cpu", num_workers=1), 3)
    trained = [r.client_id for _, results in outs for r in results]
    assert len(trained) == 3 * len(fed.clients)  # every client, every round
    assert sorted(calls) == sorted(set(trained))  # but each one's data built once


@pytest.mark.parametrize("algorithm", ["fedavg", "fedsap", "scaffold"])
def test_results_equal_fresh_training_on_raw_data(algorithm, fed):
    """Each round's results are those of the pre-issue-27 path: a fresh copy of the model and the raw
    (uint8) client data normalised inside the loop, per client."""
    cfg = build_config(preset="smoke", overrides=tiny_overrides(algorithm, "data.num_clients=4", "training.rounds=2"))
    ctx, _, outs = _rounds(cfg, fed, LocalBackend("cpu", num_workers=2), 2)
    for plans, results in outs:
        for r in results:
            fresh = train_client(plans[r.client_id], copy.deepcopy(ctx.model), ctx.layout,
                                 fed.client_data(r.client_id))
            assert r.values.tobytes() == fresh.values.tobytes()
            assert r.train_loss == fresh.train_loss
            assert r.stats.keys() == fresh.stats.keys()
            for k in r.stats:
                assert np.asarray(r.stats[k]).tobytes() == np.asarray(fresh.stats[k]).tobytes()


def test_past_the_budget_clients_are_prepared_per_call_with_the_same_values(fed):
    kept = PreparedData(fed.client_data, torch.device("cpu"))
    unkept = PreparedData(fed.client_data, torch.device("cpu"), max_bytes=0)
    for cid in (0, 1, 0, 1):
        a, b = kept.get(cid), unkept.get(cid)
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
        assert torch.equal(a.x, as_input(fed.client_data(cid).x))
    assert kept.builds == 2 and unkept.builds == 4
    assert unkept.nbytes == 0 and kept.nbytes > 0
    assert kept.get(0) is kept.get(0)
    kept.clear()
    assert kept.nbytes == 0
    kept.get(0)
    assert kept.builds == 3


def test_prepared_data_leaves_the_pool_untouched(fed):
    pool = next(iter(fed.train.values()))
    before = pool.x.clone()
    PreparedData(fed.client_data, torch.device("cpu")).get(0)
    assert pool.x.dtype == torch.uint8 and torch.equal(pool.x, before)


def test_warm_torch_moves_no_rng_and_leaves_no_state():
    state = torch.random.get_rng_state()
    threads, grad, dtype = torch.get_num_threads(), torch.is_grad_enabled(), torch.get_default_dtype()
    warm_torch()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert (torch.get_num_threads(), torch.is_grad_enabled(), torch.get_default_dtype()) == (threads, grad, dtype)


def test_local_backend_start_warms_torch_and_draws_nothing(fed, monkeypatch):
    warmed = []
    monkeypatch.setattr("fedsap_ray.runtime.local.warm_torch", lambda: warmed.append(1))
    cfg = build_config(preset="smoke", overrides=TINY)
    ctx, _ = make_strategy(cfg, fed)
    backend = LocalBackend("cpu", num_workers=1)
    state = torch.random.get_rng_state()
    backend.start(ctx)
    backend.close()
    assert warmed == [1]
    assert torch.equal(torch.random.get_rng_state(), state)


def test_to_device_skips_a_model_already_there(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    moved = []
    real = torch.nn.Module.to

    def spy(self, *a, **kw):
        moved.append(a)
        return real(self, *a, **kw)

    monkeypatch.setattr(torch.nn.Module, "to", spy)
    to_device(model, torch.device("cpu"))
    assert moved == []
    to_device(model, torch.device("meta"))
    assert len(moved) == 1 and all(t.device.type == "meta" for t in model.state_dict().values())


def test_budget_default_is_the_module_constant(fed, monkeypatch):
    monkeypatch.setattr(client_mod, "PREPARED_BYTES", 0)
    cache = PreparedData(fed.client_data, torch.device("cpu"))
    cache.get(0)
    cache.get(0)
    assert cache.builds == 2


def test_the_local_backend_starts_the_longest_expected_work_first(fed, monkeypatch):
    """Greedy longest-first, as the Ray pool shares a round: a long client never starts last while the other
    thread idles; the results still come back in client-id order."""
    cfg = build_config(preset="smoke", overrides=TINY)
    ctx, strat = make_strategy(cfg, fed)
    plans = strat.configure_round(strat.init_state(), 1)
    epochs = {cid: 1 + i % 3 for i, cid in enumerate(sorted(plans))}  # unequal work: 1, 2, 3, 1, ... epochs
    plans = {cid: dataclasses.replace(p, local_epochs=epochs[cid]) for cid, p in plans.items()}
    started: list[int] = []

    def fake_train(plan, *args, **kwargs):
        started.append(plan.client_id)
        return types.SimpleNamespace(client_id=plan.client_id, node=None)

    monkeypatch.setattr(local_mod, "train_client", fake_train)
    backend = LocalBackend("cpu", num_workers=1)
    backend.start(ctx)
    try:
        results = backend.train(plans)
    finally:
        backend.close()
    work = {cid: wire.expected_work(p, fed.clients[cid].n_samples) for cid, p in plans.items()}
    assert started == sorted(plans, key=lambda c: (-work[c], c))
    assert started != sorted(plans)  # the order really moved away from client ids
    assert [r.client_id for r in results] == sorted(plans)
