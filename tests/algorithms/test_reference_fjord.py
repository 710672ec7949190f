"""FjORD against an independent plain-PyTorch reference (issue 55, item 3), under both ``od_sampling`` readings.

The reference (:func:`local_train` and :func:`fjord_average`) is written in this file from the semantics of Flower's FjORD
baseline (adap/flower, ``baselines/fjord/fjord/models.py`` ``train``: one SGD optimizer over the whole
model's tensors, each forward pass run at the width its ``ODSampler`` drew, ``od/layers``' ``weight[:out,
:in]`` slices; ``strategy.py`` ``fjord_average``: for every tier p, the leading [:ceil(p C_out),
:ceil(p C_in)] block of a tensor averaged, sample-weighted, over the clients whose maximum width is at
least p, the smaller tiers last, and a block nobody holds kept). It imports nothing of fedsap_ray: it
takes the initial weights, each client's batches (its samples and the batch order) and the widths of
its steps as plain tensors and floats. ``round`` is that code with one width per client per round (its
maximum is the drawn tier, papers/003 section 4.2); ``batch`` draws a width per step up to p_max.

Ours runs the strategy and the client loop on the same inputs (the model is the MLP, two sliced hidden
layers, so the reference's forward pass is three slices; clients of 11, 7, 9 and 6 samples so weighting
matters; momentum and weight decay on, so the untouched coordinates' decay between a step's width and
p_max counts).

``od_bn=per_width`` has its own reference (:func:`bn_forward`, :func:`bn_local_train`, :func:`bn_average`), on the
``cnn_cifar`` CNN (six conv-BatchNorm layers): ``ODBatchNorm2d`` (an affine-free BatchNorm per width over its
leading channels, the one affine weight and bias sliced to it) and ``fjord_average``'s ``layer_p`` branch (each
width's statistics averaged over the clients whose p_max reaches it, sample-weighted); the reference's test-time
forward pass at width p (``models.py`` ``test``) is compared with ours' deployed evaluation network.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsap_ray.algorithms.fjord import HOOK, step_widths, tier_key
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.run.session import build_context
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import DomainData
from fedsap_ray.engine.evaluate import DeployedModel, deployed_network, masked
from fedsap_ray import algorithms

FEATURES, CLASSES = 32, 10  # generated_blobs
SIZES = (11, 7, 9, 6)  # samples per client
KEEP = (1.0, 0.5, 0.25, 0.5)  # p_max per client (three tiers)
ROUNDS = 3
SETTINGS = dict(lr=0.05, momentum=0.9, weight_decay=0.01, batch_size=4, epochs=2)
BASE = ["algorithm.name=fjord", "data.name=generated_blobs", "model.name=mlp", "model.width_mult=0.03125",
        "data.partition=iid", f"data.num_clients={len(SIZES)}", "capacity.scheme=explicit",
        f"capacity.keep_ratios=[{','.join(map(str, KEEP))}]", "training.participation=1.0",
        f"training.local_epochs={SETTINGS['epochs']}", f"training.batch_size={SETTINGS['batch_size']}",
        f"training.lr={SETTINGS['lr']}", f"training.momentum={SETTINGS['momentum']}",
        f"training.weight_decay={SETTINGS['weight_decay']}", "training.grad_clip=null", "training.lr_decay=1.0",
        "training.max_steps_per_epoch=null", f"training.rounds={ROUNDS}"]
TOL = 1e-6  # float rounding; the measured max |ours - reference| is in each test's docstring


# --- the reference: plain PyTorch, nothing of fedsap_ray ------------------------------------------------

def width_of(p: float, channels: int) -> int:
    """ceil(p C): the reference's ``int(np.ceil(width * p))``."""
    return max(1, math.ceil(round(p * channels, 9)))


def forward(w: dict[str, torch.Tensor], x: torch.Tensor, p: float) -> torch.Tensor:
    """The MLP at width p: each hidden layer's leading ceil(p C) units, the classifier's inputs cut to match."""
    h1 = width_of(p, w["fc1.weight"].shape[0])
    h2 = width_of(p, w["fc2.weight"].shape[0])
    a = F.relu(F.linear(x, w["fc1.weight"][:h1], w["fc1.bias"][:h1]))
    a = F.relu(F.linear(a, w["fc2.weight"][:h2, :h1], w["fc2.bias"][:h2]))
    return F.linear(a, w["fc3.weight"][:, :h2], w["fc3.bias"])


def local_train(w0: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                widths: list[float]) -> dict[str, torch.Tensor]:
    """SGD (momentum, weight decay) over the whole model's tensors; step k runs ``forward`` at ``widths[k]``."""
    w = {k: v.clone().requires_grad_(True) for k, v in w0.items()}
    opt = torch.optim.SGD(list(w.values()), lr=SETTINGS["lr"], momentum=SETTINGS["momentum"],
                          weight_decay=SETTINGS["weight_decay"])
    for idx, p in zip(batches, widths, strict=True):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(forward(w, x[idx], p), y[idx]).backward()
        opt.step()
    return {k: v.detach() for k, v in w.items()}


def block(name: str, p: float, shape: torch.Size) -> tuple[slice, ...]:
    """The leading block of tensor ``name`` a width-p model holds (the classifier's rows and the inputs whole)."""
    if name.startswith("fc3"):
        return (slice(None), slice(0, width_of(p, shape[1]))) if len(shape) == 2 else (slice(None),)
    out = slice(0, width_of(p, shape[0]))
    if len(shape) == 1 or name.startswith("fc1"):
        return (out,) if len(shape) == 1 else (out, slice(None))
    return out, slice(0, width_of(p, shape[1]))


def fjord_average(w0: dict[str, torch.Tensor], uploads: list[tuple[dict[str, torch.Tensor], int, float]],
                  tiers: list[float]) -> dict[str, torch.Tensor]:
    """Per tensor, per tier from the widest down: the block averaged over the uploads whose max width >= p,
    weighted by samples (float64); a block no upload holds keeps its value."""
    new = {k: v.clone() for k, v in w0.items()}
    for name in new:
        for p in sorted(tiers, reverse=True):
            held = [(u[name].double(), n) for u, n, p_max in uploads if p_max >= p]
            if not held:
                continue
            b = block(name, p, new[name].shape)
            total = sum(n for _, n in held)
            new[name][b] = (sum(v[b] * n for v, n in held) / total).float()
    return new


def batch_order(n: int, seed: int, batch_size: int, epochs: int) -> list[torch.Tensor]:
    """The batches both sides train on, in order (an input, as the reference's DataLoader would give them): each
    epoch a permutation of the samples from one generator seeded with the plan's seed, cut into batches, a
    size-1 batch left out (what the client loop documents)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        out += [order[i:i + batch_size] for i in range(0, n, batch_size) if min(batch_size, n - i) >= 2]
    return out


def reference_macs(w: dict[str, torch.Tensor], p: float) -> int:
    """Multiply-accumulates of one sample through the width-p MLP: the three sliced weight blocks' entries."""
    return sum(int(np.prod(w[k][block(k, p, w[k].shape)].shape)) for k in ("fc1.weight", "fc2.weight", "fc3.weight"))


# --- ours on the same inputs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(5)
    return [DomainData(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
            for n in SIZES]


@pytest.fixture(scope="module")
def fed(single_thread):
    return build_federation(build_config(preset="smoke", overrides=BASE))


def ours_at_start(fed, overrides: list[str]):
    """Our FjORD on ``fed`` before its first round: (context, strategy, a scratch model, the tiers, the state)."""
    cfg = build_config(preset="smoke", overrides=overrides)
    ctx = build_context(cfg, fed)
    strat = algorithms.get("fjord")(ctx, cfg.algorithm.opts)
    return ctx, strat, copy.deepcopy(ctx.model), sorted({float(c.capacity) for c in fed.clients}), strat.init_state()


def run_both(fed, data, sampling: str) -> tuple[float, list[list[float]], dict[int, int], dict[int, int]]:
    """Three rounds of ours and of the reference from the same initial weights: (max |difference| over every
    round's global model, each round's widths per step of client 0, ours' and the reference's train MACs)."""
    ctx, strat, scratch, tiers, state = ours_at_start(fed, [*BASE, f"algorithm.od_sampling={sampling}"])
    layout = ctx.layout

    def as_dict(flat: np.ndarray) -> dict[str, torch.Tensor]:
        return {n: torch.from_numpy(layout.slice(n, flat.copy()).copy()) for n in layout.names}

    ref, worst, drawn, macs_ours, macs_ref = as_dict(state.params), 0.0, [], {}, {}
    assert ctx.model.fc3.out_features == CLASSES and fed.input_shape == (FEATURES,)
    for t in range(1, ROUNDS + 1):
        plans = strat.configure_round(state, t)
        results = [train_client(plans[c], scratch, layout, data[c]) for c in sorted(plans)]
        out = strat.aggregate(state, plans, results, t)
        state = out.state
        uploads = []
        for c in sorted(plans):
            plan, n = plans[c], len(data[c].y)
            batches = batch_order(n, plan.seed, plan.batch_size, plan.local_epochs)
            if sampling == "batch" and plan.hooks:
                widths, p_max = step_widths(plan.payload(HOOK), len(batches)), float(fed.clients[c].capacity)
            else:  # one width for the round: the plan's (its maximum too)
                widths, p_max = [float(plan.capacity_used)] * len(batches), float(plan.capacity_used)
            if c == 0:
                drawn.append(widths)
            uploads.append((local_train(ref, data[c].x, data[c].y, batches, widths), n, p_max))
            macs_ours[(t, c)] = out.records.clients[c]["train_macs"]
            macs_ref[(t, c)] = sum(len(b) * reference_macs(ref, p) for b, p in zip(batches, widths))
        ref = fjord_average(ref, uploads, tiers)
        ours = as_dict(state.params)
        worst = max(worst, max(float((ours[k] - ref[k]).abs().max()) for k in ref))
    return worst, drawn, macs_ours, macs_ref


def test_round_sampling_equals_the_reference(fed, data):
    """``od_sampling=round`` (the default): one tier per client per round, trained as a sliced sub-network,
    equals the reference run with that tier as the round's only and maximum width. Measured max difference
    over 3 rounds: 0 (bit for bit)."""
    worst, drawn, macs_ours, macs_ref = run_both(fed, data, "round")
    assert all(len(set(w)) == 1 for w in drawn)  # one width a round
    assert worst < TOL, worst
    assert macs_ours == macs_ref


def test_batch_sampling_equals_the_reference(fed, data):
    """``od_sampling=batch``: a width per step up to p_max, the p_max sub-model uploaded and averaged over the
    clients whose p_max holds each block, equals the reference (Flower's ``train`` and ``fjord_average``) on
    the same batches and widths; the clients table's ``train_macs`` counts each step at the width it ran.
    Measured max difference over 3 rounds: 1.5e-8 (float rounding: the masked model sums zeros the slices leave out)."""
    worst, drawn, macs_ours, macs_ref = run_both(fed, data, "batch")
    assert any(len(set(w)) > 1 for w in drawn)  # client 0 (p_max 1) ran several widths within a round
    assert worst < TOL, worst
    assert macs_ours == macs_ref


# --- od_bn=per_width: Flower's ODBatchNorm2d, on a CNN with BatchNorm ------------------------------------
#
# The reference keeps, per width p, an affine-free BatchNorm over the leading ceil(p C) channels with its own
# running statistics (``od/layers/batch_norm.py`` ``ODBatchNorm2d``: ``F.batch_norm`` without affine, then the one
# shared ``weight[:C_p]``/``bias[:C_p]``); a forward pass at width p normalises with p's statistics and, in train
# mode, moves only them; the server averages p's statistics, sample-weighted, over the clients whose maximum width
# is at least p, a client that never ran p sending back what it received (``strategy.py`` ``fjord_average``, its
# ``layer_p`` branch); ``models.py`` ``test`` evaluates width p with p's statistics.

BN_BASE = ["algorithm.name=fjord", "algorithm.od_bn=per_width", "model.name=cnn_cifar", "model.width_mult=0.125",
           "data.partition=iid", f"data.num_clients={len(SIZES)}", "capacity.scheme=explicit",
           f"capacity.keep_ratios=[{','.join(map(str, KEEP))}]", "training.participation=1.0",
           f"training.local_epochs={SETTINGS['epochs']}", f"training.batch_size={SETTINGS['batch_size']}",
           f"training.lr={SETTINGS['lr']}", f"training.momentum={SETTINGS['momentum']}",
           f"training.weight_decay={SETTINGS['weight_decay']}", "training.grad_clip=null", "training.lr_decay=1.0",
           "training.max_steps_per_epoch=null", f"training.rounds={ROUNDS}", "training.eval_deployed=false"]
CONVS = 6
BN_TOL = 1e-5  # float rounding of conv sums and BatchNorm statistics; measured in the test's docstring


def bn_forward(w: dict[str, torch.Tensor], sets: dict[float, dict[int, tuple[torch.Tensor, torch.Tensor]]],
               x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """The CNN (six conv-BN-ReLU, a max-pool after every second, two linear layers) at width p, each BatchNorm
    the affine-free one of width p (its running statistics ``sets[p][i]``, moved in place in train mode) followed
    by the shared affine weight and bias sliced to the width."""
    c_in = x.shape[1]
    for i in range(1, CONVS + 1):
        out = width_of(p, w[f"conv{i}.weight"].shape[0])
        x = F.conv2d(x, w[f"conv{i}.weight"][:out, :c_in], w[f"conv{i}.bias"][:out], padding=1)
        mean, var = sets[p][i]
        x = F.batch_norm(x, mean, var, None, None, train, 0.1, 1e-5)
        x = F.relu(x * w[f"bn{i}.weight"][:out, None, None] + w[f"bn{i}.bias"][:out, None, None])
        if i % 2 == 0:
            x = F.max_pool2d(x, 2, ceil_mode=True)
        c_in = out
    hidden = width_of(p, w["fc1.weight"].shape[0])
    x = F.relu(F.linear(torch.flatten(x, 1), w["fc1.weight"][:hidden, :x[0].numel()], w["fc1.bias"][:hidden]))
    return F.linear(x, w["fc2.weight"][:, :hidden], w["fc2.bias"])


def bn_local_train(w0, sets0, x, y, batches, widths):
    """SGD (momentum, weight decay) over the whole model's tensors, step k at ``widths[k]``; returns the trained
    weights and the client's copy of every width's statistics."""
    w = {k: v.clone().requires_grad_(True) for k, v in w0.items()}
    sets = {p: {i: (m.clone(), v.clone()) for i, (m, v) in s.items()} for p, s in sets0.items()}
    opt = torch.optim.SGD(list(w.values()), lr=SETTINGS["lr"], momentum=SETTINGS["momentum"],
                          weight_decay=SETTINGS["weight_decay"])
    for idx, p in zip(batches, widths, strict=True):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(bn_forward(w, sets, x[idx], p, True), y[idx]).backward()
        opt.step()
    return {k: v.detach() for k, v in w.items()}, sets


def bn_block(name: str, p: float, shape: torch.Size) -> tuple[slice, ...]:
    """The leading block of tensor ``name`` a width-p model holds (the images' channels and the classes whole)."""
    out = slice(0, width_of(p, shape[0]))
    if name == "fc2.weight":
        return slice(None), slice(0, width_of(p, shape[1]))
    if name == "fc2.bias":
        return (slice(None),)
    if len(shape) == 1 or name == "conv1.weight":
        return (out,) if len(shape) == 1 else (out, slice(None))
    if name == "fc1.weight":  # its inputs: conv6's channels, 16 spatial positions each
        return out, slice(0, width_of(p, shape[1] // 16) * 16)
    return out, slice(0, width_of(p, shape[1]))


def bn_average(w0, sets0, uploads, tiers):
    """``fjord_average``: every weight's nested blocks (the widest tier first) over the uploads whose width holds
    them; every width's statistics over the clients whose p_max reaches it (the ``layer_p`` branch); both
    sample-weighted in float64, and what nobody holds kept. ``uploads``: (weights, statistics, samples, the width of
    the weights uploaded, p_max)."""
    new = {k: v.clone() for k, v in w0.items()}
    for name in new:
        for p in sorted(tiers, reverse=True):
            held = [(u[name].double(), n) for u, _, n, up, _ in uploads if up >= p]
            if held:
                b = bn_block(name, p, new[name].shape)
                new[name][b] = (sum(v[b] * n for v, n in held) / sum(n for _, n in held)).float()
    sets = {p: dict(s) for p, s in sets0.items()}
    for p in tiers:
        held = [(s[p], n) for _, s, n, _, p_max in uploads if p_max >= p]
        if held:
            total = sum(n for _, n in held)
            sets[p] = {i: tuple((sum(s[i][j].double() * n for s, n in held) / total).float() for j in (0, 1))
                       for i in sets0[p]}
    return new, sets


def flat_set(s: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A width's statistics in layout order: bn1's mean and variance, bn2's, ..."""
    return torch.cat([t for i in sorted(s) for t in s[i]])


@pytest.fixture(scope="module")
def bn_data():
    """Each client's images and labels, and a test batch (plain tensors)."""
    g = torch.Generator().manual_seed(11)
    train = [DomainData(torch.rand(n, 3, 32, 32, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
             for n in SIZES]
    return train, torch.rand(8, 3, 32, 32, generator=g)


@pytest.fixture(scope="module")
def bn_fed(single_thread):
    return build_federation(build_config(preset="smoke", overrides=BN_BASE))


def run_bn(fed, data, sampling: str, overrides: tuple[str, ...] = ()):
    """Three rounds of ours (``od_bn=per_width``) and of the reference from the same initial weights: the max
    |difference| of the weights, of every width's statistics and of the logits at each narrow width (ours
    through the deployed evaluation's network), and the steps' widths of client 0."""
    train, test_x = data
    ctx, strat, scratch, tiers, state = ours_at_start(fed, [*BN_BASE, f"algorithm.od_sampling={sampling}", *overrides])
    layout = ctx.layout

    def as_dict(flat: np.ndarray) -> dict[str, torch.Tensor]:
        return {n: torch.from_numpy(layout.slice(n, flat.copy()).copy()) for n in layout.names if "running" not in n}

    ref = as_dict(state.params)
    ref_sets = {p: {i: (torch.zeros(width_of(p, ref[f"bn{i}.weight"].shape[0])),
                        torch.ones(width_of(p, ref[f"bn{i}.weight"].shape[0]))) for i in range(1, CONVS + 1)}
                for p in tiers}
    worst_w = worst_bn = 0.0
    drawn = []
    for t in range(1, ROUNDS + 1):
        plans = strat.configure_round(state, t)
        results = [train_client(plans[c], scratch, layout, train[c]) for c in sorted(plans)]
        state = strat.aggregate(state, plans, results, t).state
        uploads = []
        for c in sorted(plans):
            plan, n, p_max = plans[c], len(train[c].y), float(fed.clients[c].capacity)
            batches = batch_order(n, plan.seed, plan.batch_size, plan.local_epochs)
            if sampling == "batch" and plan.hooks:
                widths, up = step_widths(plan.payload(HOOK), len(batches)), p_max
            else:
                widths, up = [float(plan.capacity_used)] * len(batches), float(plan.capacity_used)
            if c == 0:
                drawn.append(widths)
            uploads.append((*bn_local_train(ref, ref_sets, train[c].x, train[c].y, batches, widths), n, up, p_max))
        ref, ref_sets = bn_average(ref, ref_sets, uploads, tiers)
        ours = as_dict(state.params)
        worst_w = max(worst_w, max(float((ours[k] - ref[k]).abs().max()) for k in ref))
        top = state.params[np.concatenate([np.arange(*layout.span(n)) for n in layout.names if "running" in n])]
        ours_sets = {tiers[-1]: torch.from_numpy(top),
                     **{p: torch.from_numpy(state.strategy_state["bn"][tier_key(p)]) for p in tiers[:-1]}}
        worst_bn = max(worst_bn, max(float((ours_sets[p] - flat_set(ref_sets[p])).abs().max()) for p in tiers))
    # each client's deployed model (the width of its next round) and the global model at every width, as the
    # deployed evaluation runs them (the dense sliced sub-network)
    models = [(strat.width_for(state, c, state.round + 1), *strat.deployed_model(state, c)) for c in range(len(SIZES))]
    models += [(p, strat.width_params(state, p), None if p >= 1 else strat.nested_mask(p)[0]) for p in tiers]
    logits: dict[float, float] = {}
    for p, params, mask in models:
        job = DeployedModel(0, "d", masked(params, mask), mask)
        net, net_layout, vec = deployed_network(copy.deepcopy(ctx.model), layout, job, torch.device("cpu"))
        net_layout.load_into(net, vec)
        net.eval()
        with torch.no_grad():
            diff = float((net(test_x) - bn_forward(ref, ref_sets, test_x, p, False)).abs().max())
        logits[p] = max(logits.get(p, 0.0), diff)
    return worst_w, worst_bn, logits, drawn, strat, state


@pytest.mark.parametrize("sampling", ["round", "batch"])
def test_per_width_batchnorm_equals_the_reference(bn_fed, bn_data, sampling):
    """``od_bn=per_width`` under both samplings: the weights, every width's running statistics (the widest tier's
    in the flat layout, the others in the strategy state) and the logits of the model evaluated at every width with
    its own statistics (each client's deployed model, and the global model at each tier) equal the reference's over
    three rounds. Measured max differences (round, batch): weights 4.0e-7, 3.3e-7; statistics 3.9e-7, 2.4e-7;
    logits 6.0e-8, 4.8e-8. Planted changes fail by far more: each width averaged over every client (statistics
    0.41, 0.18), the plans and deployed models reading the widest set (0.31, 0.24), the batch steps not swapping
    their width's set in (batch: 0.23). At model.width_mult=0.0625 a width-0.25 client's one-channel BatchNorm made
    its training chaotic (a 1e-7 change of its start moved its weights by 6e-3), hence the wider model."""
    worst_w, worst_bn, logits, drawn, strat, state = run_bn(bn_fed, bn_data, sampling)
    assert set(logits) == {0.25, 0.5, 1.0}
    if sampling == "batch":
        assert any(len(set(w)) > 1 for w in drawn)  # client 0 (p_max 1) ran several widths within a round
    assert worst_w < TOL, worst_w
    assert worst_bn < BN_TOL, worst_bn
    assert max(logits.values()) < BN_TOL, logits
    # the narrow widths' statistics are not the widest's leading channels (what one shared set would give)
    assert np.abs(state.strategy_state["bn"][tier_key(0.25)] - state.params[strat.stat_coords(0.25)]).max() > 1e-3
