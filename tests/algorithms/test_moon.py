"""MOON (Li et al. 2021): the model-contrastive loss by hand, the previous-model protocol, runs."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from conftest import (assert_finite_global_accuracy, assert_options_rejected, assert_same_tables, e2e_overrides,
                      federation_fixture, global_rows, run_rounds_with_plans, tiny_mlp, tiny_overrides,
                      two_runs_fixture)
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.algorithms.moon import HOOK, MoonObjective, model_contrastive_loss
from fedsap_ray.data.base import DomainData
from fedsap_ray.models import build_model
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.experiment import build_context
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.models.masks import ParamLayout, trainable_mask
from fedsap_ray.common.messages import ClientPlan

TINY = tiny_overrides("moon", "data.num_clients=4", "training.rounds=2")

tiny_fed = federation_fixture(TINY, "tiny_fed")


# --- the loss on hand-built cases -------------------------------------------------------------
def _np_l_con(z: np.ndarray, zg: np.ndarray, zp: np.ndarray, tau: float) -> float:
    """MOON Eq. 2 in numpy, batch mean."""
    def cos(a, b):
        return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    pos, neg = np.exp(cos(z, zg) / tau), np.exp(cos(z, zp) / tau)
    return float(np.mean(-np.log(pos / (pos + neg))))


def test_contrastive_loss_equals_closed_form():
    z = np.array([[1.0, 0.0, 2.0], [0.5, -1.0, 0.0], [3.0, 1.0, -1.0]])
    zg = np.array([[1.0, 0.5, 2.0], [0.0, -1.0, 0.5], [-1.0, 2.0, 0.0]])
    zp = np.array([[-1.0, 0.0, 1.0], [0.5, 1.0, 0.0], [3.0, 1.5, -1.0]])
    for tau in (0.5, 1.0, 0.1):
        got = model_contrastive_loss(*(torch.tensor(a) for a in (z, zg, zp)), tau=tau)
        assert float(got) == pytest.approx(_np_l_con(z, zg, zp, tau), rel=1e-12)
    # first row by hand: cos(z, zg) = 5.0 / (sqrt 5 * sqrt 5.25), cos(z, zp) = 1 / (sqrt 5 * sqrt 2)
    a, b = 5.0 / math.sqrt(5 * 5.25), 1.0 / math.sqrt(10)
    row0 = -math.log(math.exp(a / 0.5) / (math.exp(a / 0.5) + math.exp(b / 0.5)))
    got0 = model_contrastive_loss(*(torch.tensor(v[:1]) for v in (z, zg, zp)), tau=0.5)
    assert float(got0) == pytest.approx(row0, rel=1e-12)
    assert row0 < math.log(2)  # closer to the global than to the previous representation: below log 2


def _plan(layout: ParamLayout, values: np.ndarray, **payload) -> ClientPlan:
    """A plan with the moon hook when a payload is given, else a plain one."""
    return ClientPlan(client_id=0, round=2, params=values, mask=None, local_epochs=2, batch_size=6, lr=0.1,
                      momentum=0.9, weight_decay=1e-3, seed=7,
                      hooks=(call(MoonObjective, **payload),) if payload else ())


def test_previous_equal_to_global_gives_log_2_and_no_gradient():
    """z_prev = z_glob makes the two logits equal: l_con = log 2 for every input, with zero gradient."""
    model, layout, data = tiny_mlp()
    g = layout.flatten(model)
    for extra in ({}, {"prev": g.copy()}):  # no previous model yet / a previous model equal to the global one
        obj = MoonObjective(_plan(layout, g, mu=5.0, tau=0.5, **extra), model, layout,
                            torch.device("cpu"))
        scratch = copy.deepcopy(model)
        scratch.train()
        _, l_con = obj.contrastive(scratch, data.x)
        assert float(l_con.detach()) == pytest.approx(math.log(2), abs=1e-7)
        l_con.backward()
        grads = [p.grad for p in scratch.parameters() if p.grad is not None]  # the encoder's (not the classifier)
        assert len(grads) == 4 and max(float(gr.abs().max()) for gr in grads) < 1e-6


def test_previous_model_is_used_with_its_own_values():
    """With a different previous model, l_con is Eq. 2 over the three models' own representations."""
    model, layout, data = tiny_mlp()
    g = layout.flatten(model)
    rng = np.random.default_rng(1)
    prev = (g + 0.3 * rng.standard_normal(g.size)).astype(np.float32)
    current = (g + 0.3 * rng.standard_normal(g.size)).astype(np.float32)
    obj = MoonObjective(_plan(layout, g, mu=5.0, tau=0.5, prev=prev), model, layout,
                        torch.device("cpu"))
    np.testing.assert_array_equal(layout.flatten(obj.glob), g)
    np.testing.assert_array_equal(layout.flatten(obj.prev), prev)
    feats = {}
    for name, vec in (("z", current), ("g", g), ("p", prev)):
        m = copy.deepcopy(model)
        layout.load_into(m, vec)
        with torch.no_grad():
            feats[name] = m.forward_features(data.x).double().numpy()
    m = copy.deepcopy(model)
    layout.load_into(m, current)
    with torch.no_grad():
        _, l_con = obj.contrastive(m, data.x)
    want = _np_l_con(feats["z"], feats["g"], feats["p"], 0.5)
    assert float(l_con) == pytest.approx(want, rel=1e-5)
    assert abs(want - math.log(2)) > 1e-3
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(m(data.x), data.y)
        total = obj.loss(m, data.x, data.y)
    assert float(total) == pytest.approx(float(ce) + 5.0 * want, rel=1e-5)


def test_first_participation_trains_like_fedavg_and_a_previous_model_changes_training():
    """No previous model: z_prev = z_glob, so the contrastive gradient vanishes and local training equals
    plain cross-entropy (the built-in loop) to float tolerance; a distinct previous model changes it."""
    model, layout, data = tiny_mlp()
    g = layout.flatten(model)
    plain = train_client(_plan(layout, g), copy.deepcopy(model), layout, data)
    first = train_client(_plan(layout, g, mu=5.0, tau=0.5), copy.deepcopy(model), layout, data)
    np.testing.assert_allclose(first.values, plain.values, rtol=0, atol=1e-6)
    prev = (g + 0.3 * np.random.default_rng(1).standard_normal(g.size)).astype(np.float32)
    later = train_client(_plan(layout, g, mu=5.0, tau=0.5, prev=prev), copy.deepcopy(model),
                         layout, data)
    assert np.abs(later.values - plain.values).max() > 1e-4
    assert first.stats == {} and later.stats == {}  # nothing but the model comes back


# --- the server's previous-model protocol ---------------------------------------------------------
def test_server_stores_and_sends_each_clients_previous_model(tiny_fed):
    """Round 2's plan of a client seen in round 1 carries exactly its round-1 trained values (not counted
    in bytes_down: a real MOON client stores them); a client not seen yet gets none; a client that sits out keeps its stored model;
    the global model is the sample-weighted FedAvg of the round's results."""
    cfg = build_config(preset="smoke", overrides=TINY + ["training.participation=0.5", "training.rounds=3"])
    _, _, states, plans, outs = run_rounds_with_plans(cfg, tiny_fed, 3)
    assert states[0].strategy_state["prev"] == {}
    for p in plans[0].values():
        assert p.payload(HOOK).prev is None and p.side_bytes_down == 0 and [c.name for c in p.hooks] == [HOOK]
        assert p.payload(HOOK).mu == 5.0 and p.payload(HOOK).tau == 0.5
    trained1 = {r.client_id: r.values for r in outs[0]}
    assert set(states[1].strategy_state["prev"]) == set(trained1)
    for cid, v in trained1.items():
        np.testing.assert_array_equal(states[1].strategy_state["prev"][cid], v)
    s1, s2 = set(plans[0]), set(plans[1])
    assert s1 & s2 and s2 - s1  # round 2 has a returning and a new client
    for cid, p in plans[1].items():
        if cid in s1:
            np.testing.assert_array_equal(p.payload(HOOK).prev, trained1[cid])
            assert not np.array_equal(p.payload(HOOK).prev, p.values)
            assert p.side_bytes_down == 0 and p.bytes_down == p.values.nbytes
        else:
            assert p.payload(HOOK).prev is None and p.side_bytes_down == 0
    trained2 = {r.client_id: r.values for r in outs[1]}
    for cid in s1 - s2:  # sat out round 2: its previous model is still the round-1 one
        np.testing.assert_array_equal(states[2].strategy_state["prev"][cid], trained1[cid])
    for cid in s2:
        np.testing.assert_array_equal(states[2].strategy_state["prev"][cid], trained2[cid])
    for t in (1, 2, 3):
        rs = outs[t - 1]
        n = np.array([r.n_samples for r in rs], dtype=np.float64)
        want = sum(w * r.values.astype(np.float64) for w, r in zip(n, rs)) / n.sum()
        np.testing.assert_allclose(states[t].params, want, rtol=1e-6, atol=1e-6)


def test_options_are_validated():
    assert_options_rejected(TINY, "algorithm.tau=0", "algorithm.mu=-1", "algorithm.frozen_bn=batch")
    with pytest.raises(ConfigError, match=r"invalid algorithm\.frozen_bn='running': allowed values are train, eval"):
        build_config(preset="smoke", overrides=[*TINY, "algorithm.frozen_bn=running"])


def test_frozen_bn_reaches_the_plan(tiny_fed):
    """algorithm.frozen_bn travels in the moon payload: train by default, eval when set."""
    for extra, want in (([], "train"), (["algorithm.frozen_bn=eval"], "eval")):
        cfg = build_config(preset="smoke", overrides=[*TINY, *extra, "training.rounds=1"])
        _, _, _, plans, _ = run_rounds_with_plans(cfg, tiny_fed, 1)
        assert {p.payload(HOOK).frozen_bn for p in plans[0].values()} == {want}


# --- the frozen copies' BatchNorm (algorithm.frozen_bn; issue 43) ------------------------------------
def _bn_model() -> tuple[torch.nn.Module, ParamLayout, DomainData]:
    """A seeded ResNet10 at 1/16 width (BatchNorm after every convolution) whose running statistics are far
    from any batch's (what cross-domain averaging does to the server's), and 12 seeded 3x32x32 images."""
    torch.manual_seed(0)
    model = build_model("resnet10", num_classes=10, input_shape=(3, 32, 32), width_mult=1 / 16)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.fill_(3.0)
            m.running_var.fill_(40.0)
    g = torch.Generator().manual_seed(0)
    data = DomainData(torch.randint(0, 256, (12, 3, 32, 32), dtype=torch.uint8, generator=g),
                      torch.randint(0, 10, (12,), generator=g))
    return model, ParamLayout.from_model(model), data


def _features(model: torch.nn.Module, layout: ParamLayout, values: np.ndarray, x: torch.Tensor, train: bool):
    m = copy.deepcopy(model)
    layout.load_into(m, values)
    m.train(train)
    with torch.no_grad():
        return m.forward_features(x)


@pytest.mark.parametrize("frozen_bn", ["train", "eval"])
def test_frozen_copies_normalise_as_the_option_says_and_write_no_statistics(frozen_bn):
    """train: z_glob and z_prev are what a train-mode copy computes (batch statistics), bit for bit, and the
    copies hold no running statistics, so their forward passes can update none; eval: what an eval-mode copy
    computes (the running statistics they received). Either way the scratch model and the plan's values are
    untouched and the representations are deterministic."""
    model, layout, data = _bn_model()
    x = data.x.float() / 255
    g = layout.flatten(model)
    prev = (g + 0.05 * np.random.default_rng(1).standard_normal(g.size)).astype(np.float32)
    plan = _plan(layout, g.copy(), mu=5.0, tau=0.5, prev=prev.copy(), frozen_bn=frozen_bn)
    before = layout.flatten(model)
    obj = MoonObjective(plan, model, layout, torch.device("cpu"))
    z_glob, z_prev = obj.representations(x)
    train = frozen_bn == "train"
    torch.testing.assert_close(z_glob, _features(model, layout, g, x, train), rtol=0, atol=0)
    torch.testing.assert_close(z_prev, _features(model, layout, prev, x, train), rtol=0, atol=0)
    other = _features(model, layout, g, x, not train)
    assert float((z_glob - other).abs().max()) > 1e-2  # the two modes differ on these statistics
    for frozen in (obj.glob, obj.prev):
        assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
        bn_buffers = [n for n, _ in frozen.named_buffers() if n.rsplit(".", 1)[-1].startswith(("running_", "num_"))]
        assert (bn_buffers == []) if train else len(bn_buffers) == 3 * sum(
            isinstance(m, torch.nn.BatchNorm2d) for m in frozen.modules())
    for _ in range(3):  # repeated passes: the same numbers, nothing written back
        again = obj.representations(x)
        torch.testing.assert_close(again[0], z_glob, rtol=0, atol=0)
        torch.testing.assert_close(again[1], z_prev, rtol=0, atol=0)
    np.testing.assert_array_equal(layout.flatten(model), before)
    np.testing.assert_array_equal(plan.values, g)
    np.testing.assert_array_equal(plan.payload(HOOK).prev, prev)


def test_frozen_copies_in_train_mode_add_nothing_to_the_uploaded_statistics():
    """At mu = 0 (the loss is cross-entropy; both frozen copies still run forward on every batch) a client on a
    BatchNorm model uploads exactly what plain training uploads, running statistics included: the frozen copies'
    batch-statistics passes reach neither the trained model's statistics nor the upload."""
    model, layout, data = _bn_model()
    g = layout.flatten(model)
    prev = (g + 0.05 * np.random.default_rng(1).standard_normal(g.size)).astype(np.float32)
    plain = train_client(_plan(layout, g), copy.deepcopy(model), layout, data)
    moon = train_client(_plan(layout, g, mu=0.0, tau=0.5, prev=prev, frozen_bn="train"), copy.deepcopy(model),
                        layout, data)
    assert (~trainable_mask(layout, model)).sum() > 0  # the layout holds running statistics
    np.testing.assert_array_equal(moon.values, plain.values)


# --- public path ------------------------------------------------------------------------------
E2E = e2e_overrides("moon", "data.num_clients=4")
two_runs = two_runs_fixture(E2E)  # both finished with a finite final global accuracy


def test_run_finishes_with_finite_accuracy_and_sends_only_the_model(two_runs):
    res, _ = two_runs
    assert_finite_global_accuracy(res, 2)
    cfg = build_config(preset="smoke", overrides=E2E)
    fed = build_federation(cfg)  # the federation the runs used (built from the same config)
    g = global_rows(res).sort_values("round")
    # every client receives the global model (4 bytes per coordinate) and nothing else: its previous
    # model stays on the device in real MOON, so round 2 (when it exists) costs the same as round 1
    size = ParamLayout.from_model(build_context(cfg, fed).model).size
    down = g["bytes_down"].to_numpy(dtype=np.int64)
    assert down[0] == down[1] == len(fed.clients) * size * 4


def test_same_seed_gives_identical_tables(two_runs):
    assert_same_tables(*two_runs)
