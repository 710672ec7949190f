"""FedProx against a plain-PyTorch reference of Li et al. 2020 (their Algorithm 2 and Eq. 2).

Each client minimises F_k(w) + (mu/2)||w - w^t||^2 from the server's model w^t by local SGD, and the server
averages as FedAvg does (sample-weighted). The reference writes the proximal term itself over every weight
tensor; it shares nothing with ours but the inputs (initial weights, each client's tensors, its batch seed).
"""
from __future__ import annotations

import pytest
import torch.nn.functional as F

from plainref import batches, forward, local_sgd, sample_mean
from refdrive import client_data, config, drive, max_difference

ROUNDS, SIZES, MU = 3, [13, 20, 9, 16], 0.5
TOL = 1e-5


def reference(w, data, seeds, *, mu, lr=0.1, epochs=2, batch=8, cap=3):
    """Per round, FedProx's model after round t = 1..len(seeds)."""
    out = []
    for round_seeds in seeds:
        anchor = {k: v.clone() for k, v in w.items()}

        def objective(p, xb, yb, anchor=anchor):
            prox = sum(((p[k] - anchor[k]) ** 2).sum() for k in p)
            return F.cross_entropy(forward(p, xb), yb) + 0.5 * mu * prox

        trained = [local_sgd(w, x, y, batches(len(y), batch, round_seeds[i], epochs, cap), lr=lr, loss_fn=objective)[0]
                   for i, (x, y) in enumerate(data)]
        w = sample_mean(trained, [len(y) for _, y in data])
        out.append(w)
    return out


@pytest.fixture(scope="module")
def ours(single_thread):
    return drive(config("fedprox", len(SIZES), f"algorithm.mu={MU}"), client_data(SIZES), ROUNDS)


@pytest.fixture(scope="module")
def seeds(ours):
    return [[p[c].seed for c in sorted(p)] for p in ours.plans]


def test_fedprox_equals_the_papers_local_objective(ours, seeds):
    """Three rounds at mu = 0.5: every coordinate within 1e-5 of the reference (measured: 0.0, bit for bit on this
    machine; the tolerance leaves room for another machine's kernels)."""
    ref = reference(ours.weights(ours.states[0].params), client_data(SIZES), seeds, mu=MU)
    for t in range(1, ROUNDS + 1):
        assert max_difference(ours.round_weights(t), ref[t - 1]) < TOL, f"round {t}"


def test_the_reference_tells_the_proximal_term_apart(ours, seeds):
    """The check has teeth: the reference without the term (mu = 0, FedAvg) misses ours by far more than TOL."""
    ref = reference(ours.weights(ours.states[0].params), client_data(SIZES), seeds[:1], mu=0.0)
    assert max_difference(ours.round_weights(1), ref[0]) > 100 * TOL
