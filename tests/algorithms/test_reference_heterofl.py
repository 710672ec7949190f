"""HeteroFL against a plain-PyTorch reference of its authors' code, under each reading ours offers.

The reference follows the official repository (diaoenmao/HeteroFL-Computation-and-Communication-Efficient-
Federated-Learning-for-Heterogeneous-Clients): ``src/fed.py`` ``Federation.split_model`` (a width-p client
holds the leading ceil(p C) channels of every hidden layer and every classifier row) and ``combine`` (each
coordinate is the sum of the values of the clients holding it over their COUNT; coordinates nobody holds keep
their value), and, with its ``mask`` control on, ``src/models/*.py`` ``forward`` (a client's logits of the
classes outside its label split are filled with 0 before the cross-entropy) and ``combine``'s classifier rule
(each classifier row summed over the clients whose label split holds its class). ``weighting=samples`` is the
same sum weighted by sample counts (papers/003 Algorithm 1 line 18, ours by default). It shares nothing with
ours but the inputs: the initial weights, each client's tensors, its width and its batch seed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_strategy
from fedsap_ray.data import build_federation
from fedsap_ray.common.messages import ClientResult
from plainref import batches, extract, forward, local_sgd, sub_indices
from refdrive import CLASSES, client_data, config, drive, max_difference

ROUNDS, SIZES, RATES = 3, [13, 20, 9, 16], [1.0, 0.5, 0.25, 0.5]
# the classes each client's labels are drawn from: every client lacks some, nobody holds class 9
HELD = [[0, 1, 2], [2, 3, 4, 5], [0, 5, 6, 7], [7, 8]]
LOCAL = dict(lr=0.1, momentum=0.5, grad_clip=1.0)
TOL = 1e-5


def reference(w, data, rates, seeds, *, count, label_mask, lr, momentum, grad_clip, epochs=2, batch=8, cap=3):
    """Per round, the global model after HeteroFL's round t = 1..len(seeds) under the given reading."""
    out = []
    for round_seeds in seeds:
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in w.items()}
        weight = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in w.items()}
        for i, (x, y) in enumerate(data):
            split = torch.unique(y)
            absent = torch.ones(CLASSES, dtype=torch.bool)
            absent[split] = False

            def objective(p, xb, yb, absent=absent):
                return F.cross_entropy(forward(p, xb).masked_fill(absent, 0.0), yb)

            local, _ = local_sgd(extract(w, rates[i]), x, y, batches(len(y), batch, round_seeds[i], epochs, cap), lr=lr,
                                 momentum=momentum, grad_clip=grad_clip, loss_fn=objective if label_mask else None)
            n = 1.0 if count else float(len(y))
            for k, (rows, cols) in sub_indices(w, rates[i]).items():
                v = local[k].double()
                holds = torch.ones_like(v)
                if label_mask and k.startswith("fc3."):  # the classifier: only the rows of the client's classes
                    holds[absent] = 0.0
                at = (rows, cols) if v.dim() == 2 else rows
                total[k][at] += n * v * holds
                weight[k][at] += n * holds
        w = {k: torch.where(weight[k] > 0, total[k] / weight[k].clamp_min(1e-300), w[k].double()).float() for k in w}
        out.append(w)
    return out


def heterofl(*options: str):
    return config("heterofl", len(SIZES), "capacity.scheme=explicit",
                  f"capacity.keep_ratios=[{','.join(map(str, RATES))}]", "training.momentum=0.5",
                  "training.grad_clip=1.0", *options)


READINGS = [("samples", False), ("count", False), ("samples", True), ("count", True)]


@pytest.fixture(scope="module")
def runs(single_thread):
    data = client_data(SIZES, classes=HELD)
    return {(wt, lm): drive(heterofl(f"algorithm.weighting={wt}", f"algorithm.label_mask={str(lm).lower()}"), data, ROUNDS)
            for wt, lm in READINGS}


@pytest.mark.parametrize("weighting,label_mask", READINGS)
def test_heterofl_equals_its_authors_rules(runs, weighting, label_mask):
    """Three rounds of four clients at widths 1, 1/2, 1/4, 1/2, each lacking classes: every coordinate of every
    round's model within 1e-5 of the reference (measured: 0.0, bit for bit, under all four readings on this
    machine; the tolerance leaves room for another machine's kernels)."""
    ours = runs[(weighting, label_mask)]
    assert [p.capacity_used for p in ours.plans[0].values()] == RATES
    seeds = [[p[c].seed for c in sorted(p)] for p in ours.plans]
    ref = reference(ours.weights(ours.states[0].params), client_data(SIZES, classes=HELD), RATES, seeds,
                    count=weighting == "count", label_mask=label_mask, **LOCAL)
    for t in range(1, ROUNDS + 1):
        assert max_difference(ours.round_weights(t), ref[t - 1]) < TOL, f"round {t}"
    if label_mask:  # class 9's classifier row: nobody holds it, so it keeps its initial value bit for bit
        final, start = ours.round_weights(ROUNDS), ours.round_weights(0)
        assert torch.equal(final["fc3.weight"][9], start["fc3.weight"][9]) and final["fc3.bias"][9] == start["fc3.bias"][9]


def test_each_reading_changes_the_model(runs):
    """The readings are not the same rule under other names: after three rounds every pair differs by far more
    than TOL, and a reading's reference misses the other readings' runs."""
    finals = {r: run.round_weights(ROUNDS) for r, run in runs.items()}
    for a in READINGS:
        for b in READINGS:
            if a < b:
                assert max_difference(finals[a], finals[b]) > 100 * TOL, (a, b)


def test_label_mask_sends_the_clients_classes(runs):
    """Each client reports the classes of its own data (one byte a class in ``bytes_up``), nothing without the
    option."""
    data = client_data(SIZES, classes=HELD)
    for (_, label_mask), run in runs.items():
        for r in run.results[0]:
            held = r.stats.get("held_classes")
            if not label_mask:
                assert held is None
                continue
            labels = set(data[r.client_id][1].tolist())
            assert held.tolist() == [c in labels for c in range(CLASSES)] and labels <= set(HELD[r.client_id])
            assert r.bytes_up == r.values.nbytes + CLASSES


@pytest.fixture(scope="module")
def hand_made(single_thread):
    """Three full-model clients of 1, 1 and 4 samples that uploaded 0, 0 and 4 everywhere; the strategy of each
    weighting (its own federation is only the config's: hand-made results)."""
    def merged(weighting: str):
        cfg = config("heterofl", 4, "capacity.scheme=full", f"algorithm.weighting={weighting}")
        ctx, strat = make_strategy(cfg, build_federation(cfg))
        state = strat.init_state()
        size = state.params.size
        results = [ClientResult(client_id=c, round=1, values=torch.full((size,), v).numpy(), n_samples=n, train_loss=0.0)
                   for c, n, v in ((0, 1, 0.0), (1, 1, 0.0), (2, 4, 4.0))]
        return strat.merge(state, {}, results, 1)
    return merged


def test_count_and_samples_differ_on_a_hand_made_case(hand_made):
    """By hand: samples (1*0 + 1*0 + 4*4) / 6 = 2.667, count (0 + 0 + 4) / 3 = 1.333: the readings differ by 1.333
    on every coordinate."""
    samples, count = hand_made("samples"), hand_made("count")
    assert samples == pytest.approx(16 / 6, rel=1e-6)
    assert count == pytest.approx(4 / 3, rel=1e-6)
    assert float((samples - count).max()) == pytest.approx(4 / 3, rel=1e-6)


@pytest.mark.parametrize("weighting", ["samples", "count"])
def test_nefl_width_only_equals_nefedavg(single_thread, weighting):
    """NeFL at its default (width-only, ``depth=false``) trains HeteroFL's sub-models, and the authors' NeFedAvg
    (honggkang/NeFL, ``utils/NeFedAvg.py``) averages each coordinate over the sub-models holding it, one weight a
    client: the reference above with ``count`` (``weighting=count``), or with sample weights (ours by default).
    Measured: 0.0 under both on this machine."""
    cfg = config("nefl", len(SIZES), "capacity.scheme=explicit", f"capacity.keep_ratios=[{','.join(map(str, RATES))}]",
                 "training.momentum=0.5", "training.grad_clip=1.0", f"algorithm.weighting={weighting}")
    ours = drive(cfg, client_data(SIZES, classes=HELD), ROUNDS)
    seeds = [[p[c].seed for c in sorted(p)] for p in ours.plans]
    ref = reference(ours.weights(ours.states[0].params), client_data(SIZES, classes=HELD), RATES, seeds,
                    count=weighting == "count", label_mask=False, **LOCAL)
    for t in range(1, ROUNDS + 1):
        assert max_difference(ours.round_weights(t), ref[t - 1]) < TOL, f"round {t}"
    other = reference(ours.weights(ours.states[0].params), client_data(SIZES, classes=HELD), RATES, seeds,
                      count=weighting != "count", label_mask=False, **LOCAL)
    assert max_difference(ours.round_weights(ROUNDS), other[-1]) > 100 * TOL  # the other weighting is another model
