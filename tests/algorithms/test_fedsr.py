"""FedSR (Nguyen et al. 2022): L2R and CMI terms by hand, the sigma -> 0 limit, the shared reference
distributions, runs."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import (assert_finite_global_accuracy, assert_options_rejected, assert_same_tables, e2e_overrides,
                      federation_fixture, run_rounds_with_plans, tiny_mlp, tiny_overrides, two_runs_fixture)
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.algorithms.fedsr import EXTRA_KEYS, HOOK, FedSRObjective, gaussian_kl, l2r_term
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan

TINY = tiny_overrides("fedsr", "data.num_clients=4", "training.rounds=1")


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.log1p(np.exp(x))


def _np_kl(mu, sigma, r_mu, r_sigma) -> float:
    """KL(N(mu, sigma^2) || N(r_mu, r_sigma^2)) per dimension in closed form, summed over d, mean over the batch."""
    kl = 0.5 * (np.log(r_sigma ** 2 / sigma ** 2) + (sigma ** 2 + (mu - r_mu) ** 2) / r_sigma ** 2 - 1.0)
    return float(kl.sum(axis=1).mean())


# --- the two regularisers on fixed tensors ----------------------------------------------------
def test_kl_term_equals_closed_form_gaussian_kl():
    mu = np.array([[0.5, -1.0, 2.0], [0.0, 0.3, -0.7]])
    sigma = np.array([0.2, 1.5, 0.9])  # input-independent, broadcast over the batch
    r_mu = np.array([[0.0, 0.0, 1.0], [1.0, -0.5, 0.0]])
    r_sigma = np.array([[1.0, 0.5, 2.0], [0.3, 1.0, 1.2]])
    got = gaussian_kl(*(torch.tensor(a) for a in (mu, sigma, r_mu, r_sigma)))
    assert float(got) == pytest.approx(_np_kl(mu, sigma, r_mu, r_sigma), rel=1e-12)
    # one coordinate by hand: mu=0.5, s=0.2, r_mu=0, r_s=1 -> log(1/0.2) + (0.04 + 0.25)/2 - 0.5
    one = gaussian_kl(*(torch.tensor([[v]], dtype=torch.float64) for v in (0.5, 0.2, 0.0, 1.0)))
    assert float(one) == pytest.approx(np.log(5.0) + 0.29 / 2 - 0.5, rel=1e-12)
    same = gaussian_kl(torch.tensor(r_mu), torch.tensor(r_sigma), torch.tensor(r_mu), torch.tensor(r_sigma))
    assert float(same) == pytest.approx(0.0, abs=1e-12)  # KL of a distribution to itself


def test_l2r_term_equals_mean_squared_norm():
    z = np.array([[1.0, 2.0, -2.0], [0.0, -3.0, 4.0]])  # squared norms 9 and 25
    assert float(l2r_term(torch.tensor(z))) == pytest.approx(17.0, rel=1e-12)


def _extras(model, rng: np.random.Generator | None = None, rho: float | None = None, **kw) -> dict:
    d, c = model.feature_dim, getattr(model, model.classifier).out_features
    rng = rng or np.random.default_rng(3)
    out = {"rho": np.full(d, rho, np.float32) if rho is not None else rng.normal(-1.0, 0.5, d).astype(np.float32),
           "r_mu": rng.normal(0.0, 0.5, (c, d)).astype(np.float32),
           "r_rho": rng.normal(0.5, 0.3, (c, d)).astype(np.float32),
           "alpha_l2r": 0.01, "alpha_cmi": 0.001, "noise_seed": 1234}
    out.update(kw)
    return out


def _plan(layout: ParamLayout, model, **payload) -> ClientPlan:
    """A plan with the fedsr hook when a payload is given (:func:`_extras`), else a plain one."""
    return ClientPlan(client_id=0, round=1, params=layout.flatten(model), mask=None, local_epochs=2, batch_size=6,
                      lr=0.1, momentum=0.9, weight_decay=1e-3, seed=7,
                      hooks=(call(FedSRObjective, **payload),) if payload else ())


def test_objective_terms_match_hand_computation_on_a_model():
    """The client's loss: z = mu(x) + softplus(rho) * eps with eps from the plan's noise seed; the classifier
    sees z; L2R is the mean ||z||^2 and CMI the closed-form KL to N(r_mu[y], softplus(r_rho)[y]^2)."""
    model, layout, data = tiny_mlp()
    ex = _extras(model, alpha_l2r=0.3, alpha_cmi=0.2)
    obj = FedSRObjective(_plan(layout, model, **ex), model, layout, torch.device("cpu"))
    with torch.no_grad():
        terms = obj.terms(model, data.x, data.y)
        mu = model.forward_features(data.x).double().numpy()
        eps = torch.randn(mu.shape, generator=torch.Generator().manual_seed(1234)).double().numpy()
        sigma = _softplus(ex["rho"].astype(np.float64))
        z = mu + sigma * eps
        y = data.y.numpy()
        logits = model.fc3(torch.tensor(z, dtype=torch.float32))
        ce = float(F.cross_entropy(logits, data.y))
    assert float(terms["l2r"]) == pytest.approx(float((z ** 2).sum(1).mean()), rel=1e-5)
    want_kl = _np_kl(mu, sigma, ex["r_mu"][y].astype(np.float64), _softplus(ex["r_rho"][y].astype(np.float64)))
    assert float(terms["cmi"]) == pytest.approx(want_kl, rel=1e-5)
    assert float(terms["ce"]) == pytest.approx(ce, rel=1e-5)
    obj2 = FedSRObjective(_plan(layout, model, **ex), model, layout, torch.device("cpu"))  # same noise again
    with torch.no_grad():
        total = obj2.loss(model, data.x, data.y)
    assert float(total) == pytest.approx(ce + 0.3 * float((z ** 2).sum(1).mean()) + 0.2 * want_kl, rel=1e-5)


def test_zero_weights_and_vanishing_sigma_train_exactly_like_fedavg():
    """alpha_L2R = alpha_CMI = 0 and sigma = softplus(-50) ~ 2e-22: z = mu(x), so every gradient is plain
    cross-entropy's and the trained model equals the built-in loop's (FedAvg client) to float tolerance;
    with sigma = log 2 the noise really enters the loss and training differs."""
    model, layout, data = tiny_mlp()
    plain = train_client(_plan(layout, model), copy.deepcopy(model), layout, data)
    limit = train_client(_plan(layout, model, **_extras(model, rho=-50.0, alpha_l2r=0.0, alpha_cmi=0.0)),
                         copy.deepcopy(model), layout, data)
    np.testing.assert_allclose(limit.values, plain.values, rtol=0, atol=1e-6)
    assert limit.train_loss == pytest.approx(plain.train_loss, rel=1e-6)
    noisy = train_client(_plan(layout, model, **_extras(model, rho=0.0, alpha_l2r=0.0, alpha_cmi=0.0)),
                         copy.deepcopy(model), layout, data)
    assert np.abs(noisy.values - plain.values).max() > 1e-4
    # one batch: the gradients themselves agree
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    obj = FedSRObjective(_plan(layout, model, **_extras(model, rho=-50.0, alpha_l2r=0.0, alpha_cmi=0.0)), a, layout,
                         torch.device("cpu"))
    obj.loss(a, data.x, data.y).backward()
    F.cross_entropy(b(data.x), data.y).backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=1e-7)


def test_client_trains_and_returns_the_extra_parameters():
    model, layout, data = tiny_mlp()
    ex = _extras(model)
    res = train_client(_plan(layout, model, **ex), copy.deepcopy(model), layout, data)
    assert set(res.stats) == set(EXTRA_KEYS)
    for k in EXTRA_KEYS:
        assert res.stats[k].dtype == np.float32 and res.stats[k].shape == ex[k].shape
        assert np.abs(res.stats[k] - ex[k]).max() > 0  # trained, not echoed
    assert res.bytes_up == res.values.nbytes + sum(ex[k].nbytes for k in EXTRA_KEYS)
    again = train_client(_plan(layout, model, **ex), copy.deepcopy(model), layout, data)
    np.testing.assert_array_equal(again.values, res.values)  # seeded noise: deterministic
    other = train_client(_plan(layout, model, **{**ex, "noise_seed": 99}), copy.deepcopy(model), layout, data)
    assert not np.array_equal(other.values, res.values)


# --- the server: shared reference distributions ------------------------------------------------
tiny_fed = federation_fixture(TINY, "tiny_fed")


def test_reference_parameters_change_and_are_sample_weighted_averages(tiny_fed):
    """The earlier reading, kept as options: one shared sigma vector and a reference averaged like the model."""
    cfg = build_config(preset="smoke", overrides=TINY + ["algorithm.scale=shared", "algorithm.reference=averaged"])
    ctx, strat, states, plan_sets, outs_sets = run_rounds_with_plans(cfg, tiny_fed, 1)
    state0, state1, plans, outs = states[0], states[1], plan_sets[0], outs_sets[0]
    d, c = ctx.model.feature_dim, tiny_fed.num_classes
    assert state0.strategy_state["rho"].shape == (d,) and state0.strategy_state["r_mu"].shape == (c, d)
    s0 = state0.strategy_state
    assert (s0["rho"] == 0).all() and (s0["r_mu"] == 0).all() and (s0["r_rho"] == 1).all()
    seeds = set()
    for p in plans.values():
        assert [c.name for c in p.hooks] == [HOOK] and p.payload(HOOK).alpha_l2r == 0.01
        assert p.payload(HOOK).alpha_cmi == 0.001
        assert p.side_bytes_down == sum(state0.strategy_state[k].nbytes for k in EXTRA_KEYS)
        for k in EXTRA_KEYS:
            np.testing.assert_array_equal(getattr(p.payload(HOOK), k), state0.strategy_state[k])
        seeds.add(p.payload(HOOK).noise_seed)
    assert len(seeds) == len(plans)  # every client draws its own noise
    n = np.array([r.n_samples for r in outs], dtype=np.float64)
    assert len(set(n)) > 1  # unequal client sizes: a plain mean would differ
    for k in EXTRA_KEYS:
        vals = np.stack([r.stats[k].astype(np.float64) for r in outs])
        assert all(np.abs(v - state0.strategy_state[k]).max() > 0 for v in vals)  # every client trained them
        want = np.tensordot(n / n.sum(), vals, axes=1)
        np.testing.assert_allclose(state1.strategy_state[k], want, rtol=1e-6, atol=1e-7)
        assert np.abs(state1.strategy_state[k] - state0.strategy_state[k]).max() > 0
        if np.abs(vals.mean(0) - want).max() > 1e-6:
            assert not np.allclose(state1.strategy_state[k], vals.mean(0), rtol=0, atol=1e-7)
    want_params = sum(w * r.values.astype(np.float64) for w, r in zip(n, outs)) / n.sum()
    np.testing.assert_allclose(state1.params, want_params, rtol=1e-6, atol=1e-6)
    plans2 = strat.configure_round(state1, 2)  # the next round sends the averaged values
    for p in plans2.values():
        for k in EXTRA_KEYS:
            np.testing.assert_array_equal(getattr(p.payload(HOOK), k), state1.strategy_state[k])


def test_default_predicts_the_scale_per_input():
    """scale=input (official method): sigma(x) = softplus(W_s mu(x) + b_s) differs between inputs, the KL uses it,
    and the head is trained; with W_s = 0 it is the shared scale softplus(b_s) (the earlier reading's form)."""
    model, layout, data = tiny_mlp()
    d = model.feature_dim
    rng = np.random.default_rng(5)
    ex = _extras(model, rng)
    del ex["rho"]
    ex.update(scale_w=rng.normal(0, 0.5, (d, d)).astype(np.float32), scale_b=rng.normal(0, 0.5, d).astype(np.float32))
    obj = FedSRObjective(_plan(layout, model, **ex), model, layout, torch.device("cpu"))
    x = data.x[:6]
    with torch.no_grad():
        mu = model.forward_features(x)
        sig = obj.sigma(mu).numpy().astype(np.float64)
        want = _softplus(mu.numpy().astype(np.float64) @ ex["scale_w"].T.astype(np.float64) + ex["scale_b"])
    np.testing.assert_allclose(sig, want, rtol=1e-5, atol=1e-6)
    assert sig.shape == (6, d) and np.abs(sig[0] - sig[1]).max() > 1e-3  # per input
    zero = {**ex, "scale_w": np.zeros((d, d), np.float32)}
    flat = FedSRObjective(_plan(layout, model, **zero), model, layout, torch.device("cpu")).sigma(mu).detach().numpy()
    np.testing.assert_allclose(flat, np.broadcast_to(_softplus(ex["scale_b"].astype(np.float64)), (6, d)), rtol=1e-5)
    res = train_client(_plan(layout, model, **ex), copy.deepcopy(model), layout, data)
    assert set(res.stats) == {"scale_w", "scale_b", "r_mu", "r_rho"}
    assert np.abs(res.stats["scale_w"] - ex["scale_w"]).max() > 0


def test_default_keeps_the_reference_per_client_and_averages_the_scale_head(tiny_fed):
    """reference=client (official method): every client gets back its own trained r_mu, r_rho (initial values
    before its first round), they are never averaged nor counted in bytes_down; the scale head is averaged."""
    cfg = build_config(preset="smoke", overrides=TINY)
    ctx, strat, states, plan_sets, outs_sets = run_rounds_with_plans(cfg, tiny_fed, 2)
    s0, s1, outs1, plans1, plans2 = states[0], states[1], outs_sets[0], plan_sets[0], plan_sets[1]
    d = ctx.model.feature_dim
    assert s0.strategy_state["r_mu"] == {} and s0.strategy_state["scale_w"].shape == (d, d) and not s0.strategy_state["scale_w"].any()
    for p in plans1.values():
        assert (p.payload(HOOK).r_mu == 0).all() and (p.payload(HOOK).r_rho == 1).all()
        assert p.side_bytes_down == s0.strategy_state["scale_w"].nbytes + s0.strategy_state["scale_b"].nbytes
    for r in outs1:
        np.testing.assert_array_equal(s1.strategy_state["r_mu"][r.client_id], r.stats["r_mu"])
        np.testing.assert_array_equal(plans2[r.client_id].payload(HOOK).r_rho, r.stats["r_rho"])
    a, b = outs1[0].stats["r_mu"], outs1[1].stats["r_mu"]
    assert np.abs(a - b).max() > 0  # per client, not one shared value
    n = np.array([r.n_samples for r in outs1], dtype=np.float64)
    want = np.tensordot(n / n.sum(), np.stack([r.stats["scale_w"].astype(np.float64) for r in outs1]), axes=1)
    np.testing.assert_allclose(s1.strategy_state["scale_w"], want, rtol=1e-6, atol=1e-7)
    # the option differs: an averaged reference is the same for every client of round 2
    _, _, st, ps, _ = run_rounds_with_plans(build_config(preset="smoke", overrides=TINY + ["algorithm.reference=averaged"]),
                                            tiny_fed, 2)
    refs = [p.payload(HOOK).r_mu for p in ps[1].values()]
    assert all(np.array_equal(refs[0], r) for r in refs) and not np.array_equal(refs[0], a)
    # train_macs: one forward pass plus the d x d scale head per sample
    r = outs1[0]
    assert strat.train_macs(plans1[r.client_id], r) == r.samples_seen * (strat.compute.mask_macs(None) + d * d)


def test_options_are_validated():
    assert_options_rejected(TINY, "algorithm.alpha_l2r=-0.1", "algorithm.alpha_cmi=-1", "algorithm.scale=both",
                            "algorithm.reference=server")


# --- public path ------------------------------------------------------------------------------
two_runs = two_runs_fixture(e2e_overrides("fedsr", "data.num_clients=4"))  # both finished, finite accuracy


def test_run_finishes_with_finite_accuracy(two_runs):
    res, _ = two_runs
    assert_finite_global_accuracy(res, 2)
    assert (res.clients["bytes_up"] > 0).all() and res.clients["macs_per_sample"].gt(0).all()


def test_same_seed_gives_identical_tables(two_runs):
    assert_same_tables(*two_runs)
