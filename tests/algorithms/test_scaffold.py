"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II): server algebra, client correction, runs."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import (assert_finite_global_accuracy, assert_options_rejected, assert_same_tables, federation_fixture,
                      run_rounds_with_plans, tiny_mlp, tiny_overrides)
from fedsap_ray import results
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.algorithms.scaffold import HOOK as SCAFFOLD_HOOK
from fedsap_ray.algorithms.scaffold import ControlCorrection
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.experiment import run_experiment
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan

TINY = tiny_overrides("scaffold", "data.num_clients=4", "training.rounds=2")

tiny_fed = federation_fixture(TINY, "tiny_fed")


def test_one_client_scaffold_is_local_sgd(tiny_fed):
    """N = |S| = 1 makes c == c_1 after every round, so the correction is exactly zero and SCAFFOLD
    must be FedAvg with plain SGD, bit for bit; SCAFFOLD keeps the config's momentum 0.9 here, so
    equality also shows momentum is forced to 0 while weight decay, clipping and lr decay are kept."""
    one = dataclasses.replace(tiny_fed, clients=tiny_fed.clients[:1])
    common = ["training.rounds=3", "training.weight_decay=0.0005", "training.grad_clip=1.0", "training.lr_decay=0.9"]
    sc = build_config(preset="smoke", overrides=TINY + common + ["training.momentum=0.9"])
    avg = build_config(preset="smoke", overrides=TINY + common + ["algorithm.name=fedavg", "training.momentum=0"])
    _, _, s_states, s_plans, _ = run_rounds_with_plans(sc, one, 3)
    _, _, a_states, _, _ = run_rounds_with_plans(avg, one, 3)
    assert all(p.momentum == 0.0 for plans in s_plans for p in plans.values())
    for s, a in zip(s_states[1:], a_states[1:]):
        np.testing.assert_array_equal(s.params, a.params)
    assert not np.array_equal(s_states[-1].params, s_states[0].params)
    c, c_1 = s_states[-1].strategy_state["c"], s_states[-1].strategy_state["c_i"][0]
    assert np.abs(c).max() > 0 and np.array_equal(c, c_1)  # zero correction because c == c_i, not because c == 0
    assert not np.any(s_plans[-1][0].payload(SCAFFOLD_HOOK).control)


def _expected_steps(n: int, batch: int, epochs: int, cap: int) -> int:
    """Local steps of the client loop: full batches, a last batch of >= 2 samples, at most ``cap`` per epoch."""
    per_epoch = n // batch + (1 if n % batch >= 2 else 0)
    return epochs * min(per_epoch, cap)


def test_control_variates_match_hand_computation(tiny_fed):
    """Option II and lines 16-17 computed by hand from the clients' results, over two rounds with
    participation 1/2 (|S|/N = 1/2), lr decay (c_i+ must use that round's lr), K from the real step
    count and eta_g = 0.5; round 2 samples one client seen in round 1 and one not seen yet."""
    cfg = build_config(preset="smoke", overrides=TINY + ["training.participation=0.5", "training.local_epochs=2",
                                                         "training.lr_decay=0.5", "algorithm.global_lr=0.5"])
    ctx, _, states, plans, outs = run_rounds_with_plans(cfg, tiny_fed, 2)
    n_clients, pc = len(tiny_fed.clients), ctx.layout.param_coords()
    assert (~pc).any()  # the model has BN running statistics: they must get no control variate
    s1, s2 = set(plans[0]), set(plans[1])
    assert len(s1) == 2 and s1 & s2 and s2 - s1
    assert all(not np.any(p.payload(SCAFFOLD_HOOK).control) for p in plans[0].values())  # c = c_i = 0 at the start

    c_hand = np.zeros(pc.size)
    c_i_hand: dict[int, np.ndarray] = {}
    for t in (1, 2):
        x, lr = states[t - 1].params.astype(np.float64), cfg.training.lr * 0.5 ** (t - 1)
        if t == 2:  # the plan's correction is c - c_i with c_i = 0 for a client never seen
            for cid, plan in plans[1].items():
                want = c_hand - c_i_hand.get(cid, 0.0)
                np.testing.assert_allclose(plan.payload(SCAFFOLD_HOOK).control, want, rtol=1e-6, atol=1e-7)
            back, new = plans[1][min(s2 & s1)], plans[1][min(s2 - s1)]
            assert not np.array_equal(back.payload(SCAFFOLD_HOOK).control, new.payload(SCAFFOLD_HOOK).control)
        dc_sum, ys = np.zeros_like(x), []
        for r in outs[t - 1]:
            plan = plans[t - 1][r.client_id]
            assert plan.lr == pytest.approx(lr) and plan.momentum == 0.0
            k = _expected_steps(len(tiny_fed.client_data(r.client_id)), 16, 2, 3)
            assert r.steps == k
            y = r.values.astype(np.float64)
            ys.append(y)
            new = c_i_hand.get(r.client_id, 0.0) - c_hand + (x - y) / (k * lr)
            new[~pc] = 0.0
            dc_sum += new - c_i_hand.get(r.client_id, 0.0)
            c_i_hand[r.client_id] = new
        c_hand = c_hand + len(ys) / n_clients * (dc_sum / len(ys))
        got = states[t].strategy_state
        np.testing.assert_allclose(got["c"], c_hand, rtol=1e-5, atol=1e-6)
        assert set(got["c_i"]) == set(c_i_hand)
        for cid, v in c_i_hand.items():
            np.testing.assert_allclose(got["c_i"][cid], v, rtol=1e-5, atol=1e-6)
        mean_y = np.mean(ys, axis=0)  # unweighted over S (Algorithm 1), not sample-weighted
        want_x = np.where(pc, x + 0.5 * (mean_y - x), mean_y)
        np.testing.assert_allclose(states[t].params, want_x, rtol=1e-6, atol=1e-7)
    assert np.abs(c_hand).max() > 0


def _mlp_plan(layout: ParamLayout, model: torch.nn.Module, **extra) -> ClientPlan:
    return ClientPlan(client_id=0, round=1, params=layout.flatten(model), mask=None, local_epochs=1, batch_size=6,
                      lr=0.1, momentum=0.0, weight_decay=1e-2, grad_clip=0.05, seed=7,
                      hooks=(call(ControlCorrection, **extra),) if "control" in extra else ())


def test_client_adds_correction_after_clipping():
    """The client step is y <- y - lr (clip(g) + c - c_i + wd y): checked against a hand-rolled torch loop
    over two steps, with clipping active so adding the correction before clipping would fail."""
    model, layout, data = tiny_mlp()
    init = copy.deepcopy(model)
    rng = np.random.default_rng(0)
    control = (0.5 * rng.standard_normal(layout.size)).astype(np.float32)
    plain = train_client(_mlp_plan(layout, init), copy.deepcopy(init), layout, data)
    zero = train_client(_mlp_plan(layout, init, control=np.zeros(layout.size, np.float32)), copy.deepcopy(init),
                        layout, data)
    got = train_client(_mlp_plan(layout, init, control=control), copy.deepcopy(init), layout, data)
    assert plain.steps == zero.steps == got.steps == 2
    np.testing.assert_array_equal(zero.values, plain.values)  # a zero correction changes nothing
    assert not np.allclose(got.values, plain.values, atol=1e-4)

    ref = copy.deepcopy(init)
    params = list(ref.parameters())
    corr = [torch.from_numpy(layout.slice(n, control).copy()) for n, _ in ref.named_parameters()]
    order = torch.randperm(12, generator=torch.Generator().manual_seed(7))
    clipped = []
    for i in (0, 6):
        idx = order[i:i + 6]
        for p in params:
            p.grad = None
        F.cross_entropy(ref(data.x[idx]), data.y[idx]).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, 0.05))
        clipped.append(norm > 0.05)
        with torch.no_grad():
            for p, c in zip(params, corr):
                p -= 0.1 * (p.grad + c + 1e-2 * p)
    assert all(clipped)
    np.testing.assert_allclose(got.values, layout.flatten(ref), rtol=1e-5, atol=1e-6)


def test_control_must_cover_the_flat_vector():
    """A wrongly sized control is a client error, not a silent broadcast."""
    model, layout, data = tiny_mlp()
    with pytest.raises(Exception, match="control"):
        train_client(_mlp_plan(layout, model, control=np.zeros(layout.size - 1, np.float32)), model, layout, data)



def test_global_lr_is_validated():
    assert_options_rejected(TINY, "algorithm.global_lr=0")


def _run(out, fed, extra=(), **kw):
    cfg = build_config(preset="smoke", overrides=TINY + list(extra))
    return run_experiment(cfg, out, run_id="r", federation=fed, **kw)


def test_run_finishes_and_resume_is_exact(tmp_path, tiny_fed):
    """The public path (smoke preset, algorithm.name=scaffold): finite accuracy, and a run cut after round 2
    and resumed from its checkpoint (which carries c and every c_i) writes the uninterrupted run's tables."""
    extra = ["training.rounds=3", "training.participation=0.5"]

    def stop_after_round_2(summary):
        if summary.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "cut", tiny_fed, extra, progress=stop_after_round_2)
    outcome = _run(tmp_path / "cut", tiny_fed, extra, resume=True)
    assert outcome.status == "finished"
    _run(tmp_path / "whole", tiny_fed, extra)
    a, b = results.load(tmp_path / "cut"), results.load(tmp_path / "whole")
    assert_finite_global_accuracy(b, 3)
    assert b.clients["macs_per_sample"].gt(0).all()
    assert_same_tables(a, b)
    assert a.runs.loc[0, "status"] == "finished" and a.runs.loc[0, "rounds_done"] == 3
