"""Honest compute (issue 13): ``samples_seen`` is what the client loop processed, and each strategy's
``train_macs`` / ``params_trained`` count what its clients really ran and updated."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import federation_fixture, run_rounds_with_plans, tiny_mlp, tiny_overrides
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.common.messages import ClientPlan

BASE = ("data.num_clients=4", "training.local_epochs=2")  # smoke: clients 0-3 keep 1.0, 0.8, 0.6, 0.4
fed = federation_fixture(tiny_overrides("fedavg", *BASE))


def _plan(values: np.ndarray, batch: int, max_steps: int | None, epochs: int = 1) -> ClientPlan:
    return ClientPlan(client_id=0, round=1, params=values, mask=None, local_epochs=epochs, batch_size=batch, lr=0.05,
                      max_steps_per_epoch=max_steps, seed=3)


@pytest.mark.parametrize("batch,max_steps,epochs,want", [
    (5, None, 1, 12),  # 5 + 5 + 2
    (11, None, 1, 11),  # 11, then a size-1 batch BatchNorm cannot train on: dropped
    (5, 2, 1, 10),  # max_steps_per_epoch stops after two batches
    (11, None, 3, 33),  # every epoch drops its size-1 batch
    (4, 2, 2, 16),
])
def test_samples_seen_is_what_the_loop_processed(batch, max_steps, epochs, want):
    model, layout, data = tiny_mlp()
    r = train_client(_plan(layout.flatten(model), batch, max_steps, epochs), model, layout, data)
    assert r.samples_seen == want


def _round(name: str, fed, rounds: int = 1, *extra: str):
    cfg = build_config(preset="smoke", overrides=tiny_overrides(name, *BASE, *extra))
    _, strat, _, plans, outs = run_rounds_with_plans(cfg, fed, rounds)
    return strat, plans, [{r.client_id: r for r in o} for o in outs]


def test_fedavg_and_heterofl_spend_one_forward_pass_of_what_they_train(fed):
    """FedAvg: samples_seen x full MACs; HeteroFL: samples_seen x its width's MACs (<= full)."""
    strat, plans, outs = _round("fedavg", fed)
    full = strat.compute.mask_macs(None)
    for cid, r in outs[0].items():
        assert r.samples_seen > 0 and strat.train_macs(plans[0][cid], r) == r.samples_seen * full
        assert strat.params_trained(plans[0][cid], r) == int(strat.ctx.trainable.sum())
    het, hplans, houts = _round("heterofl", fed)
    small = houts[0][3]
    assert het.train_macs(hplans[0][3], small) == small.samples_seen * het.macs(0.4) < small.samples_seen * full


def test_moon_counts_its_frozen_forward_passes(fed):
    """MOON: the trained model's forward pass + the frozen global encoder's (first participation: z_prev = z_glob)
    and from round 2 the frozen previous encoder's too; the encoder is the model without its classifier."""
    strat, plans, outs = _round("moon", fed, 2)
    full, enc = strat.compute.mask_macs(None), strat.compute.encoder_macs()
    model = strat.ctx.model
    head = getattr(model, model.classifier)
    assert enc == full - head.in_features * head.out_features and 0 < enc < full
    for t, k in ((0, 1), (1, 2)):
        for cid, r in outs[t].items():
            got = strat.train_macs(plans[t][cid], r)
            assert got == r.samples_seen * (full + k * enc)
            assert got > r.samples_seen * full  # more than one pass of macs_per_sample
    r = outs[1][0]
    assert strat.train_macs(plans[1][0], r) <= 3 * r.samples_seen * full  # 3 passes, two without a classifier


def test_fedspu_runs_the_full_model_but_updates_only_its_active_neurons(fed):
    """FedSPU: frozen neurons run forward (full MACs) but are not updated (params_trained = M_i^t)."""
    strat, plans, outs = _round("fedspu", fed)
    full = strat.compute.mask_macs(None)
    plan, r = plans[0][3], outs[0][3]
    assert strat.train_macs(plan, r) == r.samples_seen * full
    assert strat.params_trained(plan, r) == int((plan.mask & strat.ctx.trainable).sum()) < int(strat.ctx.trainable.sum())
