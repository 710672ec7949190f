"""FedAvg against a plain-PyTorch reference of McMahan et al. 2017, Algorithm 1 (FederatedAveraging).

The reference (:func:`reference`) is written from the paper: every client runs local SGD from the server's
model on its own batches, and the server takes the sample-weighted mean w <- sum_k n_k w_k / sum_k n_k. It
shares nothing with ours but the inputs: the initial weights, each client's tensors and its plan's batch seed.
"""
from __future__ import annotations

import pytest
import torch

from plainref import batches, local_sgd, sample_mean
from refdrive import client_data, config, drive, max_difference

ROUNDS, SIZES = 3, [13, 20, 9, 16]  # unequal sizes: a count-weighted mean differs from the sample-weighted one
LOCAL = dict(lr=0.1, momentum=0.9, weight_decay=5e-4, grad_clip=1.0)
TOL = 1e-5


def reference(w, data, seeds, *, lr, momentum, weight_decay, grad_clip, lr_decay=0.5, epochs=2, batch=8, cap=3):
    """Per round, the model after FedAvg's round t = 1..len(seeds) (``seeds[t-1][i]``: client i's batch seed)."""
    out = []
    for t, round_seeds in enumerate(seeds):
        trained = [local_sgd(w, x, y, batches(len(y), batch, round_seeds[i], epochs, cap), lr=lr * lr_decay ** t,
                             momentum=momentum, weight_decay=weight_decay, grad_clip=grad_clip)[0]
                   for i, (x, y) in enumerate(data)]
        w = sample_mean(trained, [len(y) for _, y in data])
        out.append(w)
    return out


@pytest.fixture(scope="module")
def ours(single_thread):
    cfg = config("fedavg", len(SIZES), "training.momentum=0.9", "training.weight_decay=0.0005",
                 "training.grad_clip=1.0", "training.lr_decay=0.5")
    return drive(cfg, client_data(SIZES), ROUNDS)


def test_fedavg_equals_the_papers_algorithm_1(ours):
    """Three rounds, momentum, weight decay, clipping and a decaying learning rate: every coordinate of every
    round's model within 1e-5 of the reference (measured: 0.0, bit for bit on this machine, as both run torch's SGD on
    the same float32 tensors; the tolerance leaves room for another machine's kernels)."""
    seeds = [[p[c].seed for c in sorted(p)] for p in ours.plans]
    ref = reference(ours.weights(ours.states[0].params), client_data(SIZES), seeds, **LOCAL)
    for t in range(1, ROUNDS + 1):
        assert max_difference(ours.round_weights(t), ref[t - 1]) < TOL, f"round {t}"
    assert max_difference(ours.round_weights(ROUNDS), ours.round_weights(0)) > 1e-2  # it trained


def test_the_reference_tells_a_count_weighted_mean_apart(ours):
    """The check has teeth: the same reference with every client weighted 1 misses ours by far more than TOL."""
    seeds = [[p[c].seed for c in sorted(p)] for p in ours.plans]
    data = client_data(SIZES)
    w = ours.weights(ours.states[0].params)
    trained = [local_sgd(w, x, y, batches(len(y), 8, seeds[0][i], 2, 3), **LOCAL)[0] for i, (x, y) in enumerate(data)]
    count = {k: torch.stack([wi[k] for wi in trained]).double().mean(0).float() for k in w}
    assert max_difference(ours.round_weights(1), count) > 100 * TOL
