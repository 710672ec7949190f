"""DapperFL (Jia et al. 2024): the fusion schedule, Model Fusion Pruning on hand-built models, the client's
one-epoch-then-prune loop, DAR, reconstruction with the previous global model, and runs."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import (assert_finite_global_accuracy, assert_options_rejected, assert_same_tables, e2e_overrides,
                      federation_fixture, make_strategy, run_rounds_with_plans, run_twice, tiny_overrides)
from fedsap_ray.algorithms import parse_options
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.algorithms.representation import HOOK as REP_NORM
from fedsap_ray.algorithms.representation import RepresentationNorm
from fedsap_ray.algorithms.dapperfl import (HOOK, MASK_KEY, DapperFL, ModelFusionPruning, dar_loss, first_epoch_samples, fusion_alpha,
                                            fusion_prune, pack_channel_masks, unpack_channel_masks)
from fedsap_ray.algorithms.pruning import l1_channel_masks
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import DomainData
from fedsap_ray.models.masks import ParamLayout, nested_channel_masks, nested_count, param_mask, trainable_mask
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState
from fedsap_ray.models import build_model

TINY = tiny_overrides("dapperfl", "data.num_clients=4", "training.rounds=2", "training.local_epochs=2")
# smoke's cyclic pruning ratios: clients 0-3 keep 1.0, 0.8, 0.6, 0.4 of every layer

fed = federation_fixture(TINY)


def _mlp(inp: int, c1: int, c2: int, classes: int = 2, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", num_classes=classes, input_shape=(inp,), channels={"fc1": c1, "fc2": c2})


# --- fusion schedule ---------------------------------------------------------------------------
def test_fusion_alpha_follows_its_schedule_with_the_floor(fed):
    """alpha_t = max(0.9 * 0.8^(t-1), alpha_min), by hand for t = 1..10 (defaults) and with a floor that binds."""
    want = [0.9, 0.72, 0.576, 0.4608, 0.36864, 0.294912, 0.2359296, 0.18874368, 0.150994944, 0.1207959552]
    got = [fusion_alpha(t, 0.9, 0.2, 0.1) for t in range(1, 11)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert fusion_alpha(11, 0.9, 0.2, 0.1) == 0.1  # 0.0966 < alpha_min
    floored = [fusion_alpha(t, 0.9, 0.2, 0.2) for t in range(1, 11)]
    np.testing.assert_allclose(floored, want[:7] + [0.2, 0.2, 0.2], rtol=1e-12)

    _, strat = make_strategy(build_config(preset="smoke", overrides=TINY + ["algorithm.alpha_min=0.2"]), fed)
    state = strat.init_state()
    assert strat.alpha_at(1) == 0.0  # round 1: no fusion with the random initialisation
    for t in range(2, 11):
        assert strat.alpha_at(t) == pytest.approx(floored[t - 1], rel=1e-12)
        assert all(p.payload(HOOK).alpha == strat.alpha_at(t) for p in strat.configure_round(state, t).values())


# --- Model Fusion Pruning on a hand-built model -------------------------------------------------
def _hand_vectors(layout: ParamLayout) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative weights, so a fused filter's l1 norm is alpha * global + (1 - alpha) * local.

    fc1 filter l1 norms: global [5, 0, 3], local [0, 6, 4]; fc2: global [4, 1], local [0, 5].
    """
    g = np.full(layout.size, 1.0, dtype=np.float32)
    w = np.full(layout.size, 3.0, dtype=np.float32)
    layout.slice("fc1.weight", g)[:] = [[2.5, 2.5], [0.0, 0.0], [1.5, 1.5]]
    layout.slice("fc1.weight", w)[:] = [[0.0, 0.0], [3.0, 3.0], [2.0, 2.0]]
    layout.slice("fc2.weight", g)[:] = [[2.0, 1.0, 1.0], [0.5, 0.0, 0.5]]
    layout.slice("fc2.weight", w)[:] = [[0.0, 0.0, 0.0], [2.0, 2.0, 1.0]]
    return g, w


def test_fusion_prune_keeps_the_largest_l1_filters_of_the_fused_model():
    """alpha = 0.5: fused fc1 norms [2.5, 3, 3.5] keep channel 2 where the global model would keep 0 and the
    local model 1; fused fc2 norms [2, 3] keep 1 where the global keeps 0. alpha = 0.9 weights the GLOBAL
    model: fc1 norms [4.5, 0.6, 3.1] keep 0 (alpha on the local model would keep 1)."""
    model = _mlp(2, 3, 2)
    layout, space = ParamLayout.from_model(model), model.channel_space()
    g, w = _hand_vectors(layout)
    keep = 1 / 3  # ceil(1/3 * 3) = 1 and ceil(1/3 * 2) = 1 channel per layer
    assert l1_channel_masks(space, layout, g, keep)["fc1"].tolist() == [True, False, False]
    assert l1_channel_masks(space, layout, w, keep)["fc1"].tolist() == [False, True, False]
    assert l1_channel_masks(space, layout, g, keep)["fc2"].tolist() == [True, False]

    fused, cmasks, pmask = fusion_prune(space, layout, g, w, 0.5, keep)
    assert cmasks["fc1"].tolist() == [False, False, True] and cmasks["fc2"].tolist() == [False, True]
    np.testing.assert_array_equal(pmask, param_mask(space, layout, cmasks))
    np.testing.assert_array_equal(layout.slice("fc1.weight", fused), [[0, 0], [0, 0], [1.75, 1.75]])
    np.testing.assert_array_equal(layout.slice("fc1.bias", fused), [0, 0, 2.0])
    np.testing.assert_array_equal(layout.slice("fc2.weight", fused), [[0, 0, 0], [0, 0, 0.75]])  # (0.5 + 1) / 2
    np.testing.assert_array_equal(layout.slice("fc2.bias", fused), [0, 2.0])
    np.testing.assert_array_equal(layout.slice("fc3.weight", fused), [[0, 2.0], [0, 2.0]])
    np.testing.assert_array_equal(layout.slice("fc3.bias", fused), [2.0, 2.0])
    np.testing.assert_array_equal(fused[pmask], (0.5 * g + 0.5 * w)[pmask])  # alpha * global + (1 - alpha) * local
    assert not fused[~pmask].any()

    fused9, cmasks9, pmask9 = fusion_prune(space, layout, g, w, 0.9, keep)
    assert cmasks9["fc1"].tolist() == [True, False, False]
    np.testing.assert_allclose(fused9[pmask9], (0.9 * g + 0.1 * w)[pmask9], rtol=1e-6)
    np.testing.assert_allclose(layout.slice("fc1.weight", fused9)[0], [2.25, 2.25], rtol=1e-6)


# --- the client: one full epoch, fusion, pruning, masked epochs ---------------------------------
def _client_setup() -> tuple[torch.nn.Module, ParamLayout, DomainData]:
    """A 6-8-8-3 MLP whose hidden filters have nearly tied l1 norms (1 + 1e-5 i for filter i), so the
    first local epoch reorders them: pruning the global model and pruning the fusion keep different filters."""
    model = _mlp(6, 8, 8, classes=3)
    with torch.no_grad():
        for lin in (model.fc1, model.fc2):
            w = lin.weight
            w.div_(w.abs().sum(dim=1, keepdim=True)).mul_(1 + 1e-5 * torch.arange(w.shape[0]).unsqueeze(1))
    g = torch.Generator().manual_seed(0)
    return model, ParamLayout.from_model(model), DomainData(torch.randn(12, 6, generator=g),
                                                           torch.randint(0, 3, (12,), generator=g))


def _plan(values: np.ndarray, epochs: int, gamma: float = 0.01, form: str = "squared",
          mfp: dict | None = None) -> ClientPlan:
    """The shared rep_norm hook alone (Eq. 7, squared by default), or before MFP's when given :func:`_mfp`'s."""
    hooks = (call(RepresentationNorm, gamma=gamma, form=form),)
    if mfp is not None:
        hooks += (call(ModelFusionPruning, **mfp),)
    return ClientPlan(client_id=0, round=3, params=values, mask=None, local_epochs=epochs, batch_size=6, lr=0.1,
                      momentum=0.9, weight_decay=1e-3, seed=7, hooks=hooks)


def _mfp(alpha: float = 0.6, keep: float = 0.5, steps: int = 2, dar_form: str = "norm", **more) -> dict:
    return {"form": dar_form, "mfp": {"alpha": alpha, "keep_ratio": keep, "prune_after_steps": steps, **more}}


def test_client_fuses_the_one_epoch_model_with_the_global_one_and_prunes_the_fusion():
    """E = 1: the upload is exactly fusion_prune(W, w_hat) where w_hat is one plain epoch from W with the
    Eq. 7 loss (the same mini-batches; DAR in its squared form, which is Eq. 7), and the returned channel mask
    is the fused model's top-l1 one."""
    model, layout, data = _client_setup()
    space = model.channel_space()
    w_global = layout.flatten(model)
    plain = train_client(_plan(w_global, 1), copy.deepcopy(model), layout, data)  # rep_norm alone: the Eq. 7 loop
    got = train_client(_plan(w_global, 1, **_mfp(dar_form="squared")), copy.deepcopy(model), layout, data)
    assert plain.steps == got.steps == 2
    want, cmasks, pmask = fusion_prune(space, layout, w_global, plain.values, 0.6, 0.5)
    by_global = l1_channel_masks(space, layout, w_global, 0.5)
    assert any(not np.array_equal(by_global[k], cmasks[k]) for k in cmasks)  # the case tells them apart
    np.testing.assert_array_equal(got.values, want[pmask])  # only the pruned model's coordinates go up
    np.testing.assert_array_equal(got.stats[MASK_KEY], pack_channel_masks(space, cmasks))
    assert [int(m.sum()) for m in cmasks.values()] == [4, 4]
    assert plain.train_loss == got.train_loss


def test_pruned_filters_stay_zero_in_the_later_epochs_and_the_rest_trains():
    """E = 3: after the first epoch the client trains only the kept channels (momentum must not move the rest)."""
    model, layout, data = _client_setup()
    w_global = layout.flatten(model)
    one = train_client(_plan(w_global, 1, **_mfp()), copy.deepcopy(model), layout, data)
    three = train_client(_plan(w_global, 3, **_mfp()), copy.deepcopy(model), layout, data)
    assert three.steps == 6
    pmask = param_mask(model.channel_space(), layout, unpack_channel_masks(model.channel_space(), three.stats[MASK_KEY]))
    np.testing.assert_array_equal(three.stats[MASK_KEY], one.stats[MASK_KEY])  # same first epoch, same mask
    assert (~pmask).any() and three.values.size == one.values.size == int(pmask.sum())  # pruned model only
    assert (three.values != one.values).mean() > 0.9


def test_dar_enters_the_loss():
    """Default: gamma * mean ||f_enc(x)||_2 (reference code, unsquared) by hand; ``squared``: gamma * mean ||z||^2
    (papers/000 Eq. 7); the two differ, and gamma > 0 changes the trained model."""
    model, layout, data = _client_setup()
    x, y = data.x[:5], data.y[:5]
    with torch.no_grad():
        z = model.forward_features(x)
        ce = torch.nn.functional.cross_entropy(model.fc3(z), y)
        norm = ce + 0.01 * torch.sqrt((z ** 2).sum(dim=1)).mean()
        squared = ce + 0.01 * (z ** 2).sum(dim=1).mean()
        assert float(dar_loss(model, x, y, 0.01)) == pytest.approx(float(norm), rel=1e-6)
        assert float(dar_loss(model, x, y, 0.01, "squared")) == pytest.approx(float(squared), rel=1e-6)
        assert float(norm) != pytest.approx(float(squared), rel=1e-4)
        assert float(dar_loss(model, x, y, 0.01)) > float(dar_loss(model, x, y, 0.0))
    with pytest.raises(ValueError, match="form .cubed."):
        dar_loss(model, x, y, 0.01, "cubed")
    w_global = layout.flatten(model)
    on = train_client(_plan(w_global, 2, gamma=0.01, **_mfp()), copy.deepcopy(model), layout, data)
    off = train_client(_plan(w_global, 2, gamma=0.0, **_mfp()), copy.deepcopy(model), layout, data)
    assert on.values.size != off.values.size or not np.allclose(on.values, off.values)
    sq = train_client(_plan(w_global, 2, gamma=0.01, **_mfp(dar_form="squared")), copy.deepcopy(model), layout, data)
    assert on.values.size != sq.values.size or not np.array_equal(on.values, sq.values)  # the form matters


def test_capacity_respecting_option_trains_only_the_pruned_model():
    """full_first_epoch=false: the mask is the l1 top-kappa of W^{t-1}, chosen before training; the first epoch
    already trains only it (pruned coordinates never leave 0) and the upload is the same size as the default's."""
    model, layout, data = _client_setup()
    space = model.channel_space()
    w_global = layout.flatten(model)
    got = train_client(_plan(w_global, 2, **_mfp(full_first_epoch=False)), copy.deepcopy(model), layout, data)
    ref = train_client(_plan(w_global, 2, **_mfp()), copy.deepcopy(model), layout, data)
    want = l1_channel_masks(space, layout, w_global, 0.5)
    np.testing.assert_array_equal(got.stats[MASK_KEY], pack_channel_masks(space, want))
    assert not np.array_equal(got.stats[MASK_KEY], ref.stats[MASK_KEY])  # the default prunes the fusion instead
    assert got.values.size == ref.values.size
    # first epoch on the pruned model: loss of its first step differs from the full model's
    assert got.train_loss != ref.train_loss


def test_first_epoch_samples_follow_the_client_loop():
    """Samples of the first epoch's steps: full batches, a last batch of >= 2, at most max_steps batches."""
    assert first_epoch_samples(12, 5, None) == 12  # 5 + 5 + 2
    assert first_epoch_samples(11, 5, None) == 10  # the size-1 batch is skipped
    assert first_epoch_samples(12, 5, 2) == 10
    assert first_epoch_samples(12, 6, 3) == 12


def test_train_macs_count_the_full_model_epoch_against_heterofl():
    """Issue 13: a capacity-0.2 DapperFL client's train_macs exceed a HeteroFL client's at the same capacity
    (same data, same steps) by exactly first-epoch samples x (full MACs - pruned MACs); params_trained is the full
    model's; with full_first_epoch=false both equal HeteroFL's."""
    over = tiny_overrides("dapperfl", "data.num_clients=5", "training.local_epochs=2", "training.max_steps_per_epoch=2")
    cfg = build_config(preset="smoke", overrides=over)
    fed5 = build_federation(cfg)
    assert fed5.clients[4].capacity == pytest.approx(0.2)
    runs = {}
    for name, extra in (("dap", []), ("fixed", ["algorithm.full_first_epoch=false"]),
                        ("het", ["algorithm.name=heterofl"])):
        c = build_config(preset="smoke", overrides=over + extra)
        _, strat, _, plans, outs = run_rounds_with_plans(c, fed5, 1)
        r = {o.client_id: o for o in outs[0]}[4]
        runs[name] = (strat, plans[0][4], r)
    (dap, dplan, dres), (fix, fplan, fres), (het, hplan, hres) = runs["dap"], runs["fixed"], runs["het"]
    assert dres.samples_seen == hres.samples_seen == fres.samples_seen > 0
    full, pruned = dap.compute.mask_macs(None), het.macs(0.2)
    assert dap.pruned_macs(0.2) == pruned < full
    first = first_epoch_samples(dres.n_samples, dplan.batch_size, dplan.max_steps_per_epoch)
    assert 0 < first < dres.samples_seen
    assert het.train_macs(hplan, hres) == hres.samples_seen * pruned
    assert dap.train_macs(dplan, dres) - het.train_macs(hplan, hres) == first * (full - pruned)
    assert fix.train_macs(fplan, fres) == het.train_macs(hplan, hres)
    assert dap.params_trained(dplan, dres) == int(dap.ctx.trainable.sum()) > het.params_trained(hplan, hres)
    assert fix.params_trained(fplan, fres) == het.params_trained(hplan, hres)


# --- server: reconstruction with the previous global model --------------------------------------
def test_reconstruction_fills_pruned_coordinates_with_the_previous_global_model(fed):
    """Two clients on a 2-2-2 MLP, W^{t-1} = 10 everywhere; A (n = 1) uploads 1.0, B (n = 3) uploads 4.0
    at their kept coordinates. Per coordinate, by hand:
    kept by both (1 + 12) / 4 = 3.25; by A only (1 + 30) / 4 = 7.75; by B only (10 + 12) / 4 = 5.5;
    by neither 10."""
    model = _mlp(2, 2, 2)
    layout = ParamLayout.from_model(model)
    cfg = build_config(preset="smoke", overrides=TINY)
    ctx = RunContext(cfg=cfg, federation=fed, model=model, layout=layout, space=model.channel_space())
    strat = DapperFL(ctx, parse_options("dapperfl", {}))
    prev = np.full(layout.size, 10.0, dtype=np.float32)
    a = {"fc1": np.array([True, False]), "fc2": np.array([True, False])}
    b = {"fc1": np.array([False, True]), "fc2": np.array([True, False])}
    n_a, n_b = (int(param_mask(ctx.space, layout, m).sum()) for m in (a, b))
    res = [ClientResult(client_id=1, round=1, values=np.full(n_b, 4.0, np.float32), n_samples=3, train_loss=0.0,
                        stats={MASK_KEY: pack_channel_masks(ctx.space, b)}),
           ClientResult(client_id=0, round=1, values=np.full(n_a, 1.0, np.float32), n_samples=1, train_loss=0.0,
                        stats={MASK_KEY: pack_channel_masks(ctx.space, a)})]
    new = strat.merge(ServerState(round=0, params=prev), {}, res, 1)
    np.testing.assert_array_equal(layout.slice("fc1.weight", new), [[7.75, 7.75], [5.5, 5.5]])
    np.testing.assert_array_equal(layout.slice("fc1.bias", new), [7.75, 5.5])
    np.testing.assert_array_equal(layout.slice("fc2.weight", new), [[7.75, 5.5], [10, 10]])
    np.testing.assert_array_equal(layout.slice("fc2.bias", new), [3.25, 10])
    np.testing.assert_array_equal(layout.slice("fc3.weight", new), [[3.25, 10], [3.25, 10]])
    np.testing.assert_array_equal(layout.slice("fc3.bias", new), [3.25, 3.25])


# --- strategy in the loop -------------------------------------------------------------------------
def test_rounds_send_the_global_model_prune_to_kappa_and_aggregate_by_reconstruction(fed):
    """Round 2's plans carry W^1 in full with alpha_2 = 0.72 and kappa_i; every client prunes after its first
    epoch (steps = E * prune_after_steps) to ceil(kappa_i C_l) channels per layer, not the nested ones; the
    server state is the sample-weighted mean of the reconstructed models; the only per-client state is each
    client's last kept channels (what it deploys), exactly those it reported."""
    cfg = build_config(preset="smoke", overrides=TINY)
    ctx, _, states, (_, plans), (_, outs) = run_rounds_with_plans(cfg, fed, 2)
    assert set(states[2].strategy_state) == {"kept"}
    for r in outs:
        np.testing.assert_array_equal(states[2].strategy_state["kept"][r.client_id], r.stats["channel_mask"])
    keeps = [c.capacity for c in fed.clients]
    assert keeps == [1.0, 0.8, 0.6, 0.4]
    nested_differs = False
    hand = np.zeros(ctx.layout.size)
    for r in outs:
        p = plans[r.client_id]
        assert p.mask is None and p.values is states[1].params
        assert p.payload(HOOK).alpha == pytest.approx(0.72) and p.payload(HOOK).keep_ratio == keeps[r.client_id]
        assert p.payload(REP_NORM).gamma == 0.01 and [c.name for c in p.hooks] == [REP_NORM, HOOK]
        assert r.steps == 2 * p.payload(HOOK).prune_after_steps
        cm = unpack_channel_masks(ctx.space, r.stats[MASK_KEY])
        for layer in ctx.space.layers:
            assert cm[layer.name].sum() == nested_count(keeps[r.client_id], layer.channels)
        nested = nested_channel_masks(ctx.space, keeps[r.client_id])
        nested_differs |= any(not np.array_equal(cm[k], nested[k]) for k in cm)
        pm = param_mask(ctx.space, ctx.layout, cm)
        full = states[1].params.copy()
        full[pm] = r.values
        hand += r.n_samples * full
    assert nested_differs
    hand /= sum(r.n_samples for r in outs)
    np.testing.assert_allclose(states[2].params, hand, rtol=1e-6, atol=1e-7)
    trained = trainable_mask(ctx.layout, ctx.model)
    assert (states[2].params[trained] != states[1].params[trained]).mean() > 0.5


def test_options_are_validated():
    assert_options_rejected(TINY, "algorithm.alpha_0=1.5", "algorithm.epsilon=-0.1", "algorithm.gamma=-1",
                            "algorithm.alpha_min=0.95", "algorithm.dar_form=cubed", "algorithm.full_first_epoch=3")


# --- end to end -------------------------------------------------------------------------------------
def test_run_finishes_with_finite_accuracy_and_is_deterministic(tmp_path, fed):
    """run_twice checks that both runs finish with a finite final global accuracy."""
    a, b = run_twice(e2e_overrides("dapperfl", *TINY[1:]), tmp_path, fed, run_id="d")
    assert_finite_global_accuracy(a, 2)
    macs = a.clients.groupby("client_id")["macs_per_sample"].first()
    assert (macs > 0).all() and macs.is_monotonic_decreasing and macs.iloc[0] > macs.iloc[-1]  # kappa 1 -> 0.4
    # the full-model first epoch: every client trains (and runs) more than its pruned model
    cl = a.clients
    assert (cl["train_macs"] > 0).all()
    assert (cl["params_trained"] == cl["params_trained"].max()).all()
    assert_same_tables(a, b)
