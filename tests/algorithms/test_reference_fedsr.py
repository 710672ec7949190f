"""FedSR against an independent plain-PyTorch reference (issue 55, item 3): the official code's rule
(atuannguyen/FedSR ``src/methods/FedSR.py`` ``Model.train_client``, ``src/methods/base.py`` ``Base.communicate``)
and the paper's, driven on the same initial weights, batches, noise and sizes as ours, compared coordinate by
coordinate after two rounds; and the two options that select between them (``l2r_form``, ``weighting``)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import federation_fixture, run_rounds_with_plans, tiny_overrides
from fedsap_ray.cli import main
from fedsap_ray.config import build_config

# Generated four-domain blobs and the MLP: five clients of 200 or 400 samples, so sample and count weights differ
BASE = tiny_overrides("fedsr", "data.name=generated_blobs", "model.name=mlp", "data.partition=iid",
                      "data.num_clients=5", "data.max_train_per_domain=400", "training.rounds=2",
                      "training.local_epochs=2", "algorithm.alpha_l2r=0.5", "algorithm.alpha_cmi=0.1")
OFFICIAL = ("algorithm.l2r_form=norm", "algorithm.weighting=count")

fed = federation_fixture(BASE)


# --- the reference: plain PyTorch, nothing of fedsap_ray ------------------------------------------------
def ref_features(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The MLP's encoder relu(fc2(relu(fc1(x)))): mu(x), the representation's mean."""
    return F.relu(F.linear(F.relu(F.linear(x, w["fc1.weight"], w["fc1.bias"])), w["fc2.weight"], w["fc2.bias"]))


def ref_client(w: dict[str, torch.Tensor], head: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
               x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], noise_seed: int, *, lr: float,
               momentum: float, weight_decay: float, alpha_l2r: float, alpha_cmi: float, l2r_form: str):
    """One client's local training as the official ``train_client`` computes a step: z = mu + sigma eps with
    sigma = softplus(scale head(mu)); CE(cls(z)) + a_L2R * L2R(z) + a_CMI * KL(N(mu, sigma^2) || N(r_mu[y],
    softplus(r_sigma)[y]^2)) summed over dimensions, batch means; one SGD step of the network and one of the
    scale head and reference per batch. The official learnable scale C is left out (C = 1), as in ours.
    Returns the trained network, scale head and reference (plain tensors)."""
    w = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    head = {k: v.clone().requires_grad_(True) for k, v in head.items()}
    ref = {k: v.clone().requires_grad_(True) for k, v in ref.items()}
    net_opt = torch.optim.SGD(list(w.values()), lr=lr, momentum=momentum, weight_decay=weight_decay)
    side_opt = torch.optim.SGD([*head.values(), *ref.values()], lr=lr, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(noise_seed)
    for idx in batches:
        xb, yb = x[idx], y[idx]
        mu = ref_features(w, xb)
        sigma = F.softplus(F.linear(mu, head["w"], head["b"]))
        z = mu + sigma * torch.randn(mu.shape, generator=gen)
        loss = F.cross_entropy(F.linear(z, w["fc3.weight"], w["fc3.bias"]), yb)
        l2r = z.norm(dim=1).mean() if l2r_form == "norm" else z.pow(2).sum(dim=1).mean()
        r_mu, r_sigma = ref["mu"][yb], F.softplus(ref["rho"])[yb]
        kl = torch.log(r_sigma) - torch.log(sigma) + (sigma ** 2 + (mu - r_mu) ** 2) / (2 * r_sigma ** 2) - 0.5
        loss = loss + alpha_l2r * l2r + alpha_cmi * kl.sum(dim=1).mean()
        net_opt.zero_grad()
        side_opt.zero_grad()
        loss.backward()
        net_opt.step()
        side_opt.step()
    return ({k: v.detach() for k, v in w.items()}, {k: v.detach() for k, v in head.items()},
            {k: v.detach() for k, v in ref.items()})


def ref_mean(trees: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """The server's weighted mean of each array, in float64 (``Base.communicate`` with weights 1: sum / count)."""
    total = sum(weights)
    return {k: (sum(wt * t[k].double() for wt, t in zip(weights, trees)) / total).float() for k in trees[0]}


# --- glue: the inputs ours used, as plain tensors --------------------------------------------------------
def client_batches(n: int, seed: int, epochs: int, batch: int, max_steps: int | None) -> list[torch.Tensor]:
    """The batch index lists a client trains on (a seeded permutation per epoch, as the simulator's loop)."""
    gen, out = torch.Generator().manual_seed(seed), []
    for _ in range(epochs):
        order, steps = torch.randperm(n, generator=gen), 0
        for s in range(0, n, batch):
            if n - s < 2 <= n:
                continue
            out.append(order[s:s + batch])
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
    return out


def run_both(fed, *extra: str):
    """Two rounds of ours and of the reference from the same start: (ours' final state, the reference's
    network, scale head and per-client references, the model as a state_dict template)."""
    cfg = build_config(preset="smoke", overrides=[*BASE, *extra])
    ctx, strat, states, plans, _ = run_rounds_with_plans(cfg, fed, 2)
    o = cfg.algorithm.opts
    model = copy.deepcopy(ctx.model)
    ctx.layout.load_into(model, states[0].params)
    w = {k: v.detach().clone() for k, v in model.state_dict().items()}
    head = {"w": torch.from_numpy(states[0].strategy_state["scale_w"]), "b": torch.from_numpy(states[0].strategy_state["scale_b"])}
    refs: dict[int, dict[str, torch.Tensor]] = {}
    for round_plans in plans:
        trained = []
        for cid in sorted(round_plans):
            plan, data = round_plans[cid], fed.client_data(cid)
            payload = plan.hooks[0].payload
            start = refs.get(cid, {"mu": torch.from_numpy(payload.r_mu), "rho": torch.from_numpy(payload.r_rho)})
            batches = client_batches(len(data.y), plan.seed, plan.local_epochs, plan.batch_size, plan.max_steps_per_epoch)
            trained.append(ref_client(w, head, start, data.x.float(), data.y, batches, payload.noise_seed, lr=plan.lr,
                                      momentum=plan.momentum, weight_decay=plan.weight_decay, alpha_l2r=o.alpha_l2r,
                                      alpha_cmi=o.alpha_cmi, l2r_form=o.l2r_form))
            refs[cid] = trained[-1][2]
        weights = [1.0 if o.weighting == "count" else float(fed.clients[c].n_samples) for c in sorted(round_plans)]
        w, head = ref_mean([t[0] for t in trained], weights), ref_mean([t[1] for t in trained], weights)
    model.load_state_dict(w)
    return ctx, states[-1], ctx.layout.flatten(model), head, refs


@pytest.mark.parametrize("extra", [(), OFFICIAL], ids=["paper-defaults", "official-code"])
def test_two_rounds_equal_the_plain_pytorch_reference(fed, extra):
    """Ours equals the reference coordinate by coordinate: the global model, the averaged scale head and every
    client's own reference distribution. Measured max |difference| 0.0 in both readings (the same float32
    operations in the same order, one torch thread); the tolerance 1e-5 leaves room for float rounding on
    another thread count. Planted in ours, the squared form under ``l2r_form=norm`` moved the model by 0.153 and
    sample weights under ``weighting=count`` by 0.0116 (both caught; checked when this test was written)."""
    sizes = {c.n_samples for c in fed.clients}
    assert len(sizes) > 1  # unequal clients: the two weightings are different rules here
    ctx, state, ref_params, head, refs = run_both(fed, *extra)
    np.testing.assert_allclose(state.params, ref_params, rtol=0, atol=1e-5)
    np.testing.assert_allclose(state.strategy_state["scale_w"], head["w"].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(state.strategy_state["scale_b"], head["b"].numpy(), rtol=0, atol=1e-5)
    for cid, r in refs.items():
        np.testing.assert_allclose(state.strategy_state["r_mu"][cid], r["mu"].numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(state.strategy_state["r_rho"][cid], r["rho"].numpy(), rtol=0, atol=1e-5)


def test_each_option_alone_changes_the_model(fed):
    """The two options are separate rules: each alone moves the trained model away from the defaults'."""
    cfg = build_config(preset="smoke", overrides=BASE)
    base = run_rounds_with_plans(cfg, fed, 2)[2][-1].params
    for opt in OFFICIAL:
        other = run_rounds_with_plans(build_config(preset="smoke", overrides=[*BASE, opt]), fed, 2)[2][-1].params
        assert np.abs(other - base).max() > 1e-4, opt


def test_default_options_keep_the_config_hash():
    """The options left at their defaults change no config hash (the hash of this config before they existed)."""
    assert build_config(preset="smoke", overrides=["algorithm.name=fedsr"]).config_hash() == "11fbdda93cd5"


@pytest.mark.parametrize("opt", ["algorithm.l2r_form=cubed", "algorithm.weighting=uniform"])
def test_a_bad_value_exits_2_naming_the_option(capsys, tmp_path, opt):
    rc = main(["run", "--preset", "smoke", "--set", "algorithm.name=fedsr", "--set", opt, "--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and opt.split("=")[0] in err[0], err
    assert not (tmp_path / "o").exists()
