"""The ``deployed`` eval mode: each client's own model at its own mask, on its own domain.

The central check is by hand: for every registered strategy, a client's deployed accuracy equals
building its physically sliced sub-model (only the active channels, a smaller network) and evaluating
that directly. Also: the per-domain rows are the sample-weighted mean of the domain's clients with its
worst client, full-model methods deploy the global model, sub-model methods deploy something else, a
single-domain federation weights the test classes by the client's labels, and large federations are
sampled (and say so).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedsap_ray import algorithms, results
from fedsap_ray.config import ConfigError, build_config
from fedsap_ray.data.base import DomainData
from fedsap_ray.engine.evaluate import DeployedModel, calibrate_bn_, evaluate, evaluate_deployed
from fedsap_ray.experiment import run_experiment
from fedsap_ray.models.masks import channel_mask_counts, extract_substate, param_mask
from fedsap_ray.models import build_model
from fedsap_ray.engine.server import DEPLOYED, deployed_sample
from conftest import EvaluatedSizes, federation_fixture, make_strategy, run_rounds

# clients of 1% of their domain (40 samples, 14 of UCI digits): a deployed model's BN statistics are calibrated on
# them, once for each way it is evaluated
TINY = ["data.num_clients=5", "data.client_fraction=0.01", "data.max_test_per_domain=40", "model.width_mult=0.125",
        "training.local_epochs=1", "training.batch_size=16", "training.max_steps_per_epoch=2"]
fed = federation_fixture(TINY)
CPU = torch.device("cpu")

STRATEGIES = algorithms.names()
# at their defaults these train (and so deploy) the full model on every client; FedAvg / FedProx also run
# with width=capacity, which the second parametrisation covers
FULL_MODEL = {"fedavg", "fedprox", "moon", "fpl", "scaffold", "fedsr", "fedspu"}
# (NeFL's depth=true option skips residual branches, which no smaller dense network has: the masked
# evaluation runs a skipped branch as zero, i.e. as the identity, so it is not in this comparison)
# DapperFL prunes filters by l1 norm within each client's own kept set: no channel set need describe the
# parameter mask it deploys, so it may run masked (and still matches the hand-built network above)
UNSTRUCTURED = {"dapperfl"}
CASES = [(n, ()) for n in STRATEGIES] + [(n, ("algorithm.width=capacity",)) for n in ("fedavg", "fedprox")]


def channel_masks_of(space, layout, pmask: np.ndarray) -> dict[str, np.ndarray]:
    """The active channels of a parameter mask: channel c is active iff some entry of its slice of the
    layer's first output tensor is covered (an entry also needs its input channel active)."""
    out = {}
    for layer in space.layers:
        ax = layer.out[0]
        vec = layout.slice(ax.name, pmask)
        vec = vec.reshape(layout.shapes[layout.index(ax.name)])
        per_entry = np.moveaxis(vec, ax.axis, 0).reshape(vec.shape[ax.axis], -1).any(axis=1)
        out[layer.name] = np.array([per_entry[ax.indices(np.array([c]), layer.channels)].any()
                                    for c in range(layer.channels)])
    return out


def sliced_accuracy(ctx, params: np.ndarray, mask: np.ndarray | None, data: DomainData,
                    own: DomainData | None = None) -> float:
    """Accuracy of the physically sliced sub-model: a network built with only the active channels (with BN
    statistics recomputed on ``own`` first when given)."""
    full = build_model(ctx.cfg.model.name, num_classes=ctx.federation.num_classes,
                       input_shape=ctx.federation.input_shape, width_mult=ctx.cfg.model.width_mult,
                       vocab_size=ctx.federation.vocab_size)
    ctx.layout.load_into(full, params)
    if mask is None:
        if own is not None:
            calibrate_bn_(full, own, CPU)
        return evaluate(full, ctx.layout, ctx.layout.flatten(full), data, CPU)[0]
    cm = channel_masks_of(ctx.space, ctx.layout, mask)
    assert param_mask(ctx.space, ctx.layout, cm).sum() == mask.sum(), "the mask is not a channel sub-model"
    sub = build_model(ctx.cfg.model.name, num_classes=ctx.federation.num_classes,
                      input_shape=ctx.federation.input_shape, width_mult=ctx.cfg.model.width_mult,
                      vocab_size=ctx.federation.vocab_size, channels=channel_mask_counts(cm))
    sub.load_state_dict(extract_substate(ctx.space, full.state_dict(), cm))
    if own is not None:
        calibrate_bn_(sub, own, CPU)
    sub.eval()
    with torch.no_grad():
        from fedsap_ray.data.base import as_input
        pred = sub(as_input(data.x)).argmax(1)
    return float((pred == data.y).double().mean())


@pytest.mark.parametrize("name,extra", CASES)
def test_deployed_accuracy_equals_the_sliced_sub_model(name, extra, fed, monkeypatch):
    """Both ways a deployed model runs (the dense sliced sub-network, the default; the masked full-size
    model, the reference) give the accuracy of a sub-network built here by hand, and the same loss to
    float rounding."""
    cfg = build_config(preset="smoke", overrides=[f"algorithm.name={name}", *TINY, *extra])
    # one trained round: its aggregate gives every method's deployed models (a trained W, each client's own mask); a
    # second round (as here until issue 57) cost a quarter of the module and checked nothing more
    ctx, strat, states = run_rounds(cfg, fed, 1)
    state = states[-1]
    models = [DeployedModel(c.client_id, c.domain, *strat.deployed_model(state, c.client_id)) for c in fed.clients]
    own = {c.client_id: fed.client_data(c.client_id) for c in fed.clients}
    sizes = EvaluatedSizes(monkeypatch, "evaluate_by_class").sizes  # of every network the default (sliced) ran
    got = evaluate_deployed([ctx.model], ctx.layout, models, fed.test, CPU, fed.num_classes, bn_data=own)
    agg = evaluate_deployed([ctx.model], ctx.layout, models, fed.test, CPU, fed.num_classes)
    monkeypatch.undo()
    # the reference: the masked full-size model (training.submodel=masked)
    got_m = evaluate_deployed([ctx.model], ctx.layout, models, fed.test, CPU, fed.num_classes, bn_data=own,
                              sliced=False)
    agg_m = evaluate_deployed([ctx.model], ctx.layout, models, fed.test, CPU, fed.num_classes, sliced=False)
    for m in models:  # the default: BN statistics of the client's own data; and the aggregated ones
        want = sliced_accuracy(ctx, m.params, m.mask, fed.test[m.domain], own[m.client_id])
        for figures in (got, got_m):
            assert figures[m.client_id][0] == pytest.approx(want, abs=1e-9), (name, m.client_id)
        assert got[m.client_id][1] == pytest.approx(got_m[m.client_id][1], rel=1e-4, abs=1e-5)
        want = sliced_accuracy(ctx, m.params, m.mask, fed.test[m.domain])
        for figures in (agg, agg_m):
            assert figures[m.client_id][0] == pytest.approx(want, abs=1e-9), (name, m.client_id)
        assert agg[m.client_id][1] == pytest.approx(agg_m[m.client_id][1], rel=1e-4, abs=1e-5)
    small = [c.client_id for c in fed.clients if c.capacity < 1]
    masks = [models[c].mask for c in small]
    if name in FULL_MODEL and "algorithm.width=capacity" not in extra:  # full-model methods deploy the full model
        assert all(mk is None for mk in masks)
    else:  # sub-model methods: a client below full capacity deploys a strict sub-model
        assert small and all(mk is not None and mk.sum() < ctx.layout.size for mk in masks), name
        if name not in UNSTRUCTURED:  # ... and it ran as the smaller dense network (issue 27)
            assert min(sizes) < ctx.layout.size, name


def test_a_narrow_clients_deployed_model_is_its_width_not_the_global_model(fed):
    """HeteroFL at round 0: the global model and a 0.2-width client's model give different predictions."""
    cfg = build_config(preset="smoke", overrides=["algorithm.name=heterofl", *TINY])
    ctx, strat = make_strategy(cfg, fed)
    state = strat.init_state()
    cid = min(fed.clients, key=lambda c: c.capacity).client_id
    params, mask = strat.deployed_model(state, cid)
    assert mask is not None
    width = strat.width_for(state, cid, 1)
    assert mask.sum() == strat.nested_mask(width)[0].sum()


@pytest.fixture(scope="module")
def every_3(tmp_path_factory, fed):
    """The rounds table of one HeteroFL run of 4 rounds with ``training.deployed_every=3`` (the deployed models
    evaluated at rounds 3 and 4), which the two tests below read."""
    out = tmp_path_factory.mktemp("every_3") / "k"
    run_experiment(build_config(preset="smoke", overrides=[*TINY, "algorithm.name=heterofl", "training.rounds=4",
                                                           "training.deployed_every=3"]), out=out, run_id="k",
                   federation=fed)
    return results.load(out).rounds


def test_domain_rows_are_the_sample_weighted_mean_with_the_worst_client(every_3):
    rounds = every_3  # the last round's deployed rows (issue 57: one run shared with the deployed_every test)
    last = rounds[(rounds["round"] == 4) & (rounds.eval_mode == DEPLOYED)].set_index("domain")
    other = rounds[(rounds["round"] == 4) & (rounds.eval_mode == "global")]
    assert len(other) and len(last) == len(other)  # one row per domain + the global row, like every mode
    assert not last.eval_clients_sampled.any()
    assert last.loc[results.GLOBAL_DOMAIN, "n_eval_clients"] == 5
    assert last.drop(results.GLOBAL_DOMAIN).n_eval_clients.sum() == 5
    dom = last.drop(results.GLOBAL_DOMAIN)
    assert last.loc[results.GLOBAL_DOMAIN, "accuracy"] == pytest.approx(dom.accuracy.mean())
    assert (dom.worst_client_accuracy <= dom.accuracy + 1e-12).all()
    assert last.loc[results.GLOBAL_DOMAIN, "worst_client_accuracy"] == pytest.approx(dom.worst_client_accuracy.min())


def test_the_per_domain_figure_weights_clients_by_their_samples():
    """Two clients of one domain with different models: 3 x 1.0 and 1 x 0.0 samples -> 0.75."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    from fedsap_ray.models.masks import ParamLayout
    layout = ParamLayout.from_model(model)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    data = DomainData(x=x, y=torch.tensor([0, 1]))
    right = np.array([10, 0, 0, 10, 0, 0], dtype=np.float32)  # identity: both right
    wrong = np.array([0, 10, 10, 0, 0, 0], dtype=np.float32)  # swapped: both wrong
    got = evaluate_deployed([model], layout, [DeployedModel(0, "d", right, None), DeployedModel(1, "d", wrong, None)],
                            {"d": data}, CPU, 2)
    assert got[0][0] == 1.0 and got[1][0] == 0.0


def test_single_domain_clients_are_judged_on_their_own_label_mix():
    """One domain: class 0 always right, class 1 always wrong; a client holding only class 0 gets 1.0, one
    holding 1:3 of classes 0:1 gets 0.25, whatever the test split's own class balance."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    from fedsap_ray.models.masks import ParamLayout
    layout = ParamLayout.from_model(model)
    params = np.array([10, 0, 10, 0, 0, 0], dtype=np.float32)  # always predicts class 0
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    data = DomainData(x=x, y=torch.tensor([0, 1, 1, 1]))
    models = [DeployedModel(0, "d", params, None), DeployedModel(1, "d", params, None)]
    weights = {0: np.array([5, 0]), 1: np.array([1, 3])}
    got = evaluate_deployed([model], layout, models, {"d": data}, CPU, 2, weights)
    assert got[0][0] == pytest.approx(1.0)
    assert got[1][0] == pytest.approx(0.25)
    plain = evaluate_deployed([model], layout, models, {"d": data}, CPU, 2)
    assert plain[0][0] == pytest.approx(0.25)  # unweighted: the split's own balance (1 of 4 right)


def test_large_federations_evaluate_a_fixed_stratified_sample(fed):
    cfg = build_config(preset="smoke", overrides=[*TINY, "training.eval_clients=2"])
    ctx, _ = make_strategy(cfg, fed)
    ids, sampled = deployed_sample(ctx)
    assert sampled and 2 <= len(ids) < len(fed.clients)
    assert ids == deployed_sample(ctx)[0]  # seeded: the same clients every round
    doms = {fed.clients[i].domain for i in ids}
    assert doms == set(fed.domains)  # every domain keeps at least one client
    cfg_all = build_config(preset="smoke", overrides=TINY)
    assert deployed_sample(make_strategy(cfg_all, fed)[0]) == (list(range(len(fed.clients))), False)


def test_own_bn_statistics_are_the_clients_data_and_change_the_figure(fed):
    """calibrate_bn_ sets a BN layer's running mean to the mean of the client's own activations (and leaves the
    parameters alone); a client's deployed figure with its own statistics differs from the aggregated one."""
    cfg = build_config(preset="smoke", overrides=["algorithm.name=heterofl", *TINY])
    ctx, strat, states = run_rounds(cfg, fed, 1)
    model = build_model(cfg.model.name, num_classes=fed.num_classes, input_shape=fed.input_shape,
                        width_mult=cfg.model.width_mult)
    ctx.layout.load_into(model, states[-1].params)
    params_before = [p.detach().clone() for p in model.parameters()]
    data = fed.client_data(0)
    from fedsap_ray.data.base import as_input
    with torch.no_grad():
        model.train()
        stem = model.bn1(model.conv1(as_input(data.x)))  # one batch: its own mean is the running mean
    assert calibrate_bn_(model, data, CPU, batch_size=len(data))
    bn = model.bn1
    with torch.no_grad():
        pre = model.conv1(as_input(data.x))
    torch.testing.assert_close(bn.running_mean, pre.mean(dim=(0, 2, 3)), atol=1e-5, rtol=1e-5)
    assert not bn.training and bn.momentum == 0.1 and stem.shape[1] == bn.num_features
    for a, b in zip(params_before, model.parameters()):
        assert torch.equal(a, b)
    cid = min(fed.clients, key=lambda c: c.capacity).client_id
    m = [DeployedModel(cid, fed.clients[cid].domain, *strat.deployed_model(states[-1], cid))]
    own = evaluate_deployed([ctx.model], ctx.layout, m, fed.test, CPU, fed.num_classes,
                            bn_data={cid: fed.client_data(cid)})[cid]
    agg = evaluate_deployed([ctx.model], ctx.layout, m, fed.test, CPU, fed.num_classes)[cid]
    assert own[1] != agg[1]  # the losses differ: the statistics really changed


def test_deployed_evaluation_can_be_switched_off(tmp_path):
    out = tmp_path / "r"
    run_experiment(build_config(preset="smoke", overrides=[*TINY, "algorithm.name=fedavg", "training.rounds=1",
                                                           "training.eval_deployed=false"]), out=out, run_id="n")
    rounds = results.load(out).rounds
    assert DEPLOYED not in set(rounds.eval_mode.dropna())
    assert isinstance(rounds, pd.DataFrame)


def test_deployed_every_evaluates_the_deployed_models_at_its_multiples_and_the_last_round(every_3):
    rounds = every_3
    assert sorted(rounds[rounds.eval_mode == DEPLOYED]["round"].unique()) == [3, 4]
    assert sorted(rounds[rounds.eval_mode == "global"]["round"].unique()) == [1, 2, 3, 4]  # the others every round
    with pytest.raises(ConfigError, match="training.deployed_every"):
        build_config(preset="smoke", overrides=["training.deployed_every=0"])


@pytest.mark.parametrize("name", ["fedsap", "fpl", "feddrop"])
def test_every_client_row_says_what_one_forward_pass_of_its_model_costs(name, tmp_path):
    """macs_per_sample is recorded for every method (FedSAP and FPL used to leave it null): the sub-model's
    MACs, below the full model's for a client that trains a sub-model."""
    out = tmp_path / name
    run_experiment(build_config(preset="smoke", overrides=[f"algorithm.name={name}", *TINY, "training.rounds=1",
                                                           "training.eval_deployed=false"]), out=out, run_id=name)
    clients = results.load(out).clients
    assert clients.macs_per_sample.notna().all() and (clients.macs_per_sample > 0).all()
    full = clients[clients.capacity_used >= 1].macs_per_sample
    narrow = clients[clients.capacity_used < 1].macs_per_sample
    if name != "fpl":  # FPL trains the full model everywhere
        assert len(narrow) and narrow.max() < clients.macs_per_sample.max()
    assert full.nunique() <= 1
