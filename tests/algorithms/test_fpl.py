"""FPL (Huang et al., CVPR 2023): FINCH partitions, the two prototype losses, the server's
cluster/unbiased prototypes and their trip to the next round's plans, end-to-end runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import (assert_finite_global_accuracy, assert_options_rejected, assert_same_tables, federation_fixture,
                      run_rounds_with_plans, run_twice, tiny_overrides)
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.algorithms.fpl import (HOOK, FPLObjective, class_prototypes, cpcl_loss, finch, first_neighbour_partition,
                                       fpl_regulariser, last_epoch_start, server_prototypes, upcr_loss)
from fedsap_ray.config import build_config
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan, ClientResult
from fedsap_ray.models import build_model

TINY = tiny_overrides("fpl", "data.num_clients=4", "training.rounds=2", "training.local_epochs=2")

tiny_fed = federation_fixture(TINY, "tiny_fed")


def _unit(deg: float, r: float = 1.0) -> np.ndarray:
    a = np.deg2rad(deg)
    return r * np.array([np.cos(a), np.sin(a)])


# --- FINCH ------------------------------------------------------------------------------------
def test_finch_first_partition_on_hand_built_points():
    """First neighbours by cosine (lengths must not matter): a0<->a1, a2->a1 (shared neighbour chains
    a2 in), b0<->b1, c0<->c1, c2->c1: three clusters, numbered by first appearance; the next level
    would merge everything into one cluster, so FINCH stops and FPL keeps these three."""
    pts = {"a0": _unit(0, 1), "b0": _unit(60, 5), "c0": _unit(150, 2), "a1": _unit(4, 9), "b1": _unit(66, 1),
           "c1": _unit(155, 3), "a2": _unit(10, 0.5), "c2": _unit(165, 7)}
    x = np.stack(list(pts.values()))
    np.testing.assert_array_equal(first_neighbour_partition(x), [0, 1, 2, 0, 1, 2, 0, 2])
    parts = finch(x)
    assert len(parts) == 1


def test_finch_keeps_the_coarsest_partition_before_one_cluster():
    """Four tight pairs at 0/20/100/120 degrees: partition 0 = the pairs; their means pair up as
    (0,20) and (100,120): partition 1 = two clusters; merging those two would give one cluster, so
    the hierarchy ends there and FPL's level (the last) is the two-cluster partition."""
    x = np.stack([_unit(d) for d in (0, 2, 20, 22, 100, 102, 120, 122)])
    parts = finch(x)
    assert len(parts) == 2
    np.testing.assert_array_equal(parts[0], [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(parts[1], [0, 0, 0, 0, 1, 1, 1, 1])
    clusters, unbiased = class_prototypes(x)
    want = np.stack([x[:4].mean(0), x[4:].mean(0)])
    np.testing.assert_allclose(clusters, want, rtol=1e-6)
    np.testing.assert_allclose(unbiased, want.mean(0), rtol=1e-6)


# --- local losses -----------------------------------------------------------------------------
def _np_cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a @ b.T) / (np.linalg.norm(a, axis=1)[:, None] * np.linalg.norm(b, axis=1)[None, :])


@pytest.mark.parametrize("tau", [0.5, 0.02])
def test_losses_equal_hand_computed_numpy(tau):
    """L_CPCL: -log(sum_pos exp(cos/tau) / sum_all exp(cos/tau)) over cluster prototypes of every class;
    L_UPCR: mean over features of (z - u_y)^2; batch mean with class-2 samples (no prototype) adding 0."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((4, 5)).astype(np.float32)
    y = np.array([0, 1, 2, 0])
    protos = rng.standard_normal((4, 5)).astype(np.float32)
    labels = np.array([0, 0, 1, 1])  # two cluster prototypes for classes 0 and 1, none for class 2
    unbiased = rng.standard_normal((3, 5)).astype(np.float32)
    has = np.array([True, True, False])

    s = _np_cos(z.astype(np.float64), protos.astype(np.float64)) / tau
    e = np.exp(s - s.max(axis=1, keepdims=True))
    cpcl = np.array([-np.log(e[i, labels == y[i]].sum() / e[i].sum()) if has[y[i]] else 0.0 for i in range(4)])
    upcr = ((z - unbiased[y]) ** 2).mean(axis=1)
    total = (cpcl + upcr)[has[y]].sum() / 4

    t = lambda a: torch.from_numpy(a)  # noqa: E731
    valid = has[y]
    got_cpcl = cpcl_loss(t(z[valid]), t(y[valid]), t(protos), t(labels), tau)
    np.testing.assert_allclose(got_cpcl.numpy(), cpcl[valid], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(upcr_loss(t(z), t(unbiased[y])).numpy(), upcr, rtol=1e-6)
    zt = t(z).requires_grad_(True)
    got = fpl_regulariser(zt, t(y), t(protos), t(labels), t(unbiased), t(has), tau)
    assert got.item() == pytest.approx(total, rel=1e-4)
    got.backward()
    assert torch.isfinite(zt.grad).all() and not zt.grad[2].any()  # the class-2 sample gets no gradient


def _mlp_objective(extra: dict, collect_from: int = 0):
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=3, input_shape=(6,), width_mult=1 / 32)
    layout = ParamLayout.from_model(model)
    plan = ClientPlan(client_id=0, round=2, params=layout.flatten(model), mask=None, local_epochs=1, batch_size=4,
                      lr=0.1, hooks=(call(FPLObjective, tau=0.02, num_classes=3, collect_from=collect_from,
                                          **{k.removeprefix("fpl_"): v for k, v in extra.items()}),))
    return model, FPLObjective(plan, model, layout, torch.device("cpu"))


def test_objective_is_ce_plus_regulariser_and_prototypes_are_last_epoch_class_means():
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)
    y1, y2 = torch.tensor([0, 1, 1, 0, 2, 1]), torch.tensor([1, 1, 0, 1, 0, 1])  # class 2 absent from batch 2
    model, obj = _mlp_objective({}, collect_from=1)
    ce = F.cross_entropy(model(x1), y1)
    assert obj.loss(model, x1, y1).item() == pytest.approx(ce.item())  # round 1: plain CE, not collected
    obj.loss(model, x2, y2)  # collected (the model did not move in between)
    out = obj.result(model)
    with torch.no_grad():
        z2 = model.forward_features(x2).double().numpy()
    np.testing.assert_array_equal(out["fpl_counts"], [2, 4, 0])
    np.testing.assert_allclose(out["fpl_protos"][0], z2[[2, 4]].mean(0), rtol=1e-6)
    np.testing.assert_allclose(out["fpl_protos"][1], z2[[0, 1, 3, 5]].mean(0), rtol=1e-6)
    assert not out["fpl_protos"][2].any()

    rng = np.random.default_rng(2)
    dim = out["fpl_protos"].shape[1]
    payload = {"fpl_cluster_protos": rng.random((3, dim), dtype=np.float32), "fpl_cluster_labels": np.array([0, 0, 1]),
               "fpl_unbiased": rng.random((3, dim), dtype=np.float32), "fpl_has_proto": np.array([True, True, False])}
    model, obj = _mlp_objective(payload)
    z = model.forward_features(x1)
    want = F.cross_entropy(getattr(model, model.classifier)(z), y1)
    keys = ("fpl_cluster_protos", "fpl_cluster_labels", "fpl_unbiased", "fpl_has_proto")
    want = want + fpl_regulariser(z, y1, *(torch.from_numpy(payload[k]) for k in keys), 0.02)
    assert obj.loss(model, x1, y1).item() == pytest.approx(want.item(), rel=1e-6)


# --- server -----------------------------------------------------------------------------------
def _result(cid: int, protos: np.ndarray, counts: list[int]) -> ClientResult:
    return ClientResult(client_id=cid, round=1, values=np.zeros(1, np.float32), n_samples=10, train_loss=0.0,
                        stats={"fpl_protos": protos.astype(np.float32), "fpl_counts": np.array(counts, np.int64)})


def test_server_unbiased_prototype_is_the_mean_of_cluster_means():
    """Class 0: three clients near 0 degrees and two near 90 (lengths differ) form two FINCH clusters, so the
    unbiased prototype is the mean of the two cluster means, not the mean of the five prototypes; a client
    with no class-0 samples (count 0) is left out. Class 1: one holder, its prototype is the only cluster.
    Class 2: nobody has it."""
    def p3(deg, r):
        return np.append(_unit(deg, r), 0.0)

    class0 = {0: p3(0, 1), 1: p3(2, 3), 2: p3(4, 2), 3: p3(90, 1), 4: p3(93, 4)}
    res = []
    for cid in range(6):
        protos = np.zeros((3, 3))
        counts = [0, 0, 0]
        if cid in class0:
            protos[0], counts[0] = class0[cid], 5
        if cid == 5:
            protos[0] = p3(45, 100)  # garbage with count 0: must be ignored
            protos[1], counts[1] = p3(30, 2), 7
        res.append(_result(cid, protos, counts))
    out = server_prototypes(res[::-1], 3)  # arrival order must not matter
    a, b = np.mean([class0[i] for i in (0, 1, 2)], 0), np.mean([class0[i] for i in (3, 4)], 0)
    np.testing.assert_allclose(out["fpl_cluster_protos"], np.stack([a, b, p3(30, 2)]), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out["fpl_cluster_labels"], [0, 0, 1])
    np.testing.assert_allclose(out["fpl_unbiased"][0], (a + b) / 2, rtol=1e-6)
    assert not np.allclose(out["fpl_unbiased"][0], np.mean(list(class0.values()), 0), rtol=1e-3)
    np.testing.assert_allclose(out["fpl_unbiased"][1], p3(30, 2), rtol=1e-6)
    np.testing.assert_array_equal(out["fpl_has_proto"], [True, True, False])
    assert not out["fpl_unbiased"][2].any()


def test_round_two_plans_carry_the_prototypes(tiny_fed):
    """Round 1: CE only, no prototypes sent; the server builds them from the clients' last-epoch prototypes;
    round 2's plans carry exactly those arrays (counted in bytes_down) and the model is FedAvg's."""
    cfg = build_config(preset="smoke", overrides=TINY)
    _, _, (_, s1, _), (p1, p2), (r1, r2) = run_rounds_with_plans(cfg, tiny_fed, 2)
    assert all(p.side_bytes_down == 0 and p.payload(HOOK).cluster_protos is None for p in p1.values())
    for r in r1:  # last local epoch: min(batches, 3) batches of 16 (client 1 has 29 samples: 16 + 13)
        n = tiny_fed.clients[r.client_id].n_samples
        assert p1[r.client_id].payload(HOOK).collect_from == last_epoch_start(n, 16, 2, 3) == r.steps // 2
        assert int(r.stats["fpl_counts"].sum()) == min(n, 48)
    want = server_prototypes(r1, tiny_fed.num_classes)  # from the results in the order aggregate received them
    for k, v in want.items():
        np.testing.assert_array_equal(s1.strategy_state[k], v)
    assert s1.strategy_state["fpl_has_proto"].all() and len(s1.strategy_state["fpl_cluster_labels"]) >= tiny_fed.num_classes
    n_w = np.array([r.n_samples for r in r1], dtype=np.float64)
    fedavg = (np.stack([r.values for r in r1]).astype(np.float64) * n_w[:, None]).sum(0) / n_w.sum()
    np.testing.assert_allclose(s1.params, fedavg, rtol=1e-5, atol=1e-6)
    for p in p2.values():
        for k, v in want.items():
            np.testing.assert_array_equal(getattr(p.payload(HOOK), k.removeprefix("fpl_")), v)
        assert p.side_bytes_down == sum(v.nbytes for v in want.values()) > 0
        assert [c.name for c in p.hooks] == [HOOK] and p.payload(HOOK).tau == 0.02
    assert all(np.isfinite(r.train_loss) for r in r2)


def test_tau_is_validated():
    assert_options_rejected(TINY, "algorithm.tau=0")


# --- end to end -------------------------------------------------------------------------------
def test_run_finishes_and_is_deterministic(tmp_path, tiny_fed):
    a, b = run_twice(TINY, tmp_path, tiny_fed)
    assert_finite_global_accuracy(a, 2)
    r2 = a.rounds[(a.rounds["round"] == 2)]
    assert (r2["bytes_down"] > a.rounds[a.rounds["round"] == 1]["bytes_down"].iloc[0]).all()  # prototypes go down
    assert_same_tables(a, b)
