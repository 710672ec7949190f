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
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsap_ray.algorithms.fjord import HOOK, step_widths
from fedsap_ray.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.session import build_context
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import DomainData
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


def run_both(fed, data, sampling: str) -> tuple[float, list[list[float]], dict[int, int], dict[int, int]]:
    """Three rounds of ours and of the reference from the same initial weights: (max |difference| over every
    round's global model, each round's widths per step of client 0, ours' and the reference's train MACs)."""
    cfg = build_config(preset="smoke", overrides=[*BASE, f"algorithm.od_sampling={sampling}"])
    ctx = build_context(cfg, fed)
    strat = algorithms.get("fjord")(ctx, cfg.algorithm.opts)
    layout, scratch = ctx.layout, copy.deepcopy(ctx.model)
    tiers = sorted({float(c.capacity) for c in fed.clients})
    state = strat.init_state()

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
