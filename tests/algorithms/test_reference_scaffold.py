"""SCAFFOLD against a plain-PyTorch reference of Karimireddy et al. 2020, Algorithm 1 with option II.

Written from the paper, and shaped as the widely used NIID-Bench implementation (Li et al. 2022,
``experiments.py`` ``train_net_scaffold`` / ``local_train_net_scaffold``) applies it: a plain SGD step on the
client's loss, then the weights moved by -lr (c - c_i) after the step; c_i+ = c_i - c + (x - y_i) / (K lr) from the
client's K steps; the server moves x by eta_g times the mean of (y_i - x) over the sampled clients and c by |S|/N
times the mean of (c_i+ - c_i). The reference keeps its own controls; it shares nothing with ours but the
inputs: the initial weights, each client's tensors, the sampled clients and their batch seeds.
"""
from __future__ import annotations

import pytest
import torch

from plainref import batches, local_sgd
from refdrive import client_data, config, drive, max_difference

ROUNDS, SIZES, ETA_G, N = 3, [13, 20, 9, 16], 0.5, 4
TOL = 1e-5


def reference(w, data, sampled, seeds, *, eta_g, lr=0.1, weight_decay=5e-4, grad_clip=1.0, epochs=2, batch=8, cap=3):
    """Per round, SCAFFOLD's model after round t (``sampled[t-1]``: the clients of round t, ``seeds[t-1][i]``: client
    i's batch seed then); weight decay and clipping act on the client's own gradient, before the correction."""
    zero = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in w.items()}
    c, c_i = dict(zero), {}
    out = []
    for clients, round_seeds in zip(sampled, seeds):
        deltas, dcs = [], []
        for i in clients:
            x, y = data[i]
            corr = {k: (c[k] - c_i.get(i, zero)[k]).float() for k in w}

            def correct(p, corr=corr):
                for k in p:
                    p[k] -= lr * corr[k]

            y_i, steps = local_sgd(w, x, y, batches(len(y), batch, round_seeds[i], epochs, cap), lr=lr,
                                   weight_decay=weight_decay, grad_clip=grad_clip, after_step=correct)
            plus = {k: c_i.get(i, zero)[k] - c[k] + (w[k].double() - y_i[k].double()) / (steps * lr) for k in w}
            dcs.append({k: plus[k] - c_i.get(i, zero)[k] for k in w})
            deltas.append({k: y_i[k].double() - w[k].double() for k in w})
            c_i[i] = plus
        w = {k: (w[k].double() + eta_g * sum(d[k] for d in deltas) / len(clients)).float() for k in w}
        c = {k: c[k] + len(clients) / N * sum(d[k] for d in dcs) / len(clients) for k in w}
        out.append(w)
    return out


@pytest.fixture(scope="module")
def ours(single_thread):
    cfg = config("scaffold", N, f"algorithm.global_lr={ETA_G}", "training.participation=0.5",
                 "training.weight_decay=0.0005", "training.grad_clip=1.0")
    return drive(cfg, client_data(SIZES), ROUNDS)


def inputs(ours):
    sampled = [sorted(p) for p in ours.plans]
    seeds = [{c: p[c].seed for c in p} for p in ours.plans]
    return sampled, seeds


def test_scaffold_equals_algorithm_1_option_ii(ours):
    """Three rounds, two of four clients a round (|S|/N = 1/2; a client comes back with its own c_i), eta_g = 0.5:
    every coordinate within 1e-5 of the reference (measured: at most 8.9e-8: the correction is added to the
    gradient before the step in ours, after it in the reference, and the server step is written another way)."""
    sampled, seeds = inputs(ours)
    assert len(set(map(tuple, sampled))) > 1 and all(len(s) == 2 for s in sampled)
    ref = reference(ours.weights(ours.states[0].params), client_data(SIZES), sampled, seeds, eta_g=ETA_G)
    for t in range(1, ROUNDS + 1):
        assert max_difference(ours.round_weights(t), ref[t - 1]) < TOL, f"round {t}"


def test_the_reference_tells_a_missing_correction_apart(ours):
    """The check has teeth: with c forced to stay 0 (no correction: FedAvg with an unweighted mean and a server
    step) the reference misses ours by far more than TOL from round 2, the first with a nonzero c."""
    sampled, seeds = inputs(ours)
    data = client_data(SIZES)
    ref = reference(ours.weights(ours.states[0].params), data, sampled, seeds, eta_g=ETA_G)
    flat = [ours.weights(ours.states[0].params)]
    for clients, round_seeds in zip(sampled, seeds):  # the uncorrected rounds, from the same start
        w = flat[-1]
        ys = [local_sgd(w, *data[i], batches(len(data[i][1]), 8, round_seeds[i], 2, 3), lr=0.1, weight_decay=5e-4,
                        grad_clip=1.0)[0] for i in clients]
        flat.append({k: (w[k].double() + ETA_G * sum(y[k].double() - w[k].double() for y in ys) / len(ys)).float()
                     for k in w})
    assert max_difference(ref[0], flat[1]) < TOL  # round 1: c = c_i = 0, the correction is zero in both
    assert max_difference(ours.round_weights(2), flat[2]) > 100 * TOL
