"""Evaluation at the cost of the model evaluated (issue 27): the same figures, less work.

- (deployed sub-models run as dense sliced sub-networks give the masked full-size model's figures to
  float rounding: tests/engine/test_deployed_eval.py, for every registered strategy);
- a parameter vector is evaluated once per domain however many clients deploy it (with the client's
  own BN statistics only when the model has BatchNorm) and however many eval modes share it;
- a round's time is split into training, evaluation and server work that add up to its wall time.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsap_ray.engine import evaluate as ev
from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.engine.evaluate import DeployedModel, evaluate_deployed, evaluate_modes
from fedsap_ray.experiment import run_experiment
from conftest import EvaluatedSizes, federation_fixture, make_strategy

TINY = ["data.num_clients=5", "data.max_test_per_domain=40", "model.width_mult=0.125", "training.local_epochs=1",
        "training.batch_size=16", "training.max_steps_per_epoch=2"]
fed = federation_fixture(TINY)
CPU = torch.device("cpu")


def test_a_model_without_batchnorm_is_evaluated_once_for_the_clients_that_deploy_it(fed, monkeypatch):
    """cnn_small has no BatchNorm: with ``deployed_bn=client`` the client's data cannot change its model, so
    FedAvg's one global model is evaluated once per domain, not once per client."""
    cfg = build_config(preset="smoke", overrides=["algorithm.name=fedavg", "model.name=cnn_small", *TINY])
    ctx, strat = make_strategy(cfg, fed)
    assert not ev.has_batchnorm(ctx.model)
    state = strat.init_state()
    models = [DeployedModel(c.client_id, c.domain, *strat.deployed_model(state, c.client_id)) for c in fed.clients]
    own = {c.client_id: fed.client_data(c.client_id) for c in fed.clients}
    count = EvaluatedSizes(monkeypatch, "evaluate_by_class")
    got = evaluate_deployed([ctx.model], ctx.layout, models, fed.test, CPU, fed.num_classes, bn_data=own)
    assert len(count.sizes) == len({c.domain for c in fed.clients}) < len(fed.clients)
    for m in models:  # ... with the figures of evaluating it directly
        assert got[m.client_id][0] == pytest.approx(ev.evaluate(ctx.model, ctx.layout, m.params,
                                                                 fed.test[m.domain], CPU)[0])


def test_a_model_with_batchnorm_is_recalibrated_per_client(fed, monkeypatch):
    cfg = build_config(preset="smoke", overrides=["algorithm.name=fedavg", *TINY])
    ctx, strat = make_strategy(cfg, fed)
    assert ev.has_batchnorm(ctx.model)
    state = strat.init_state()
    models = [DeployedModel(c.client_id, c.domain, *strat.deployed_model(state, c.client_id)) for c in fed.clients]
    own = {c.client_id: fed.client_data(c.client_id) for c in fed.clients}
    count = EvaluatedSizes(monkeypatch, "evaluate_by_class")
    evaluate_deployed([ctx.model], ctx.layout, models, fed.test, CPU, fed.num_classes, bn_data=own)
    assert len(count.sizes) == len(fed.clients)


def test_eval_modes_that_share_parameters_are_evaluated_once(fed, monkeypatch):
    cfg = build_config(preset="smoke", overrides=["algorithm.name=fedavg", *TINY])
    ctx, strat = make_strategy(cfg, fed)
    p = strat.init_state().params
    q = p.copy()
    q[:100] += 0.5  # a different model
    domains = list(fed.test)
    sets = {"a": {d: p for d in domains}, "b": {d: p.copy() for d in domains},  # equal values, another array
            "c": {d: (q if i == 0 else p) for i, d in enumerate(domains)}}
    count = EvaluatedSizes(monkeypatch, "evaluate")
    got = evaluate_modes([ctx.model], ctx.layout, sets, fed.test, CPU)
    assert len(count.sizes) == len(domains) + 1  # p on every domain, and q on the first
    monkeypatch.undo()
    for mode, models in sets.items():
        for d in domains:
            assert got[mode][d] == ev.evaluate(ctx.model, ctx.layout, models[d], fed.test[d], CPU)
    assert got["a"] == got["b"] and got["c"][domains[0]] != got["a"][domains[0]]


def test_fedsaps_warm_up_modes_are_evaluated_once_per_domain(tmp_path, monkeypatch):
    """FedSAP's ``group`` and ``global_only`` modes evaluate the same model until its groups form: one
    evaluation per domain per round, and both modes' rows hold the same figures."""
    count = EvaluatedSizes(monkeypatch, "evaluate")
    out = tmp_path / "w"
    run_experiment(build_config(preset="smoke", overrides=["algorithm.name=fedsap", *TINY, "training.rounds=1",
                                                           "training.eval_deployed=false"]), out=out, run_id="w")
    r = results.load(out).rounds
    modes = sorted(r.eval_mode.dropna().unique())
    assert len(modes) == 2, modes
    by = r[r.domain != results.GLOBAL_DOMAIN].pivot(index="domain", columns="eval_mode", values="accuracy")
    assert (by[modes[0]] == by[modes[1]]).all()
    assert len(count.sizes) == len(by)


def test_a_rounds_time_is_split_into_its_phases(tmp_path, capsys):
    out = tmp_path / "p"
    from fedsap_ray.run.progress import ProgressPrinter

    run_experiment(build_config(preset="smoke", overrides=["algorithm.name=heterofl", *TINY, "training.rounds=3",
                                                           "training.eval_every=2"]),
                   out=out, run_id="p", progress=ProgressPrinter(3))
    r = results.load(out).rounds.drop_duplicates("round").set_index("round")
    assert (r[["train_s", "eval_s", "server_s"]] >= 0).all().all()
    assert np.allclose(r.train_s + r.eval_s + r.server_s, r.round_wall_s)
    assert (r.train_s > 0).all()
    assert r.loc[1, "eval_s"] == 0.0 and not r.loc[1, "evaluated"]  # round 1 is not evaluated (eval_every=2)
    assert r.loc[2, "eval_s"] > 0 and r.loc[3, "eval_s"] > 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("round ")]
    assert len(lines) == 3 and all(" (train " in ln and " eval " in ln and " server " in ln for ln in lines), lines


@pytest.mark.parametrize("name", ["resnet10", "cnn_cifar"])
def test_evaluation_folds_each_listed_bn_into_its_conv_and_computes_the_same_logits(name):
    """inference_module: every (conv, BN) pair the model lists becomes one convolution (no BatchNorm runs), the
    logits equal the model's own eval-mode logits to float rounding, and the scratch model is untouched. The BN
    statistics and affine parameters are made non-trivial first, so a fold that dropped either would differ."""
    from fedsap_ray.models import build_model

    torch.manual_seed(0)
    model = build_model(name, num_classes=10, input_shape=(3, 32, 32), width_mult=0.25)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.3, 0.3)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    net, fmt = ev.inference_module(model, torch.device("cpu"))
    assert net is not model and fmt == torch.channels_last
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
    assert len(model.conv_bn_pairs()) == sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    x = torch.rand(16, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        ref, got = model(x), net(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the scratch model untouched


def test_a_model_in_training_mode_or_without_pairs_is_evaluated_as_it_is():
    """Nothing is folded in train mode (BN then normalises with the batch's statistics) nor for a model that lists
    no pairs (cnn_small has no BatchNorm): the module itself is returned."""
    from fedsap_ray.models import build_model

    small = build_model("cnn_small", num_classes=10, input_shape=(3, 32, 32)).eval()
    assert ev.inference_module(small, torch.device("cpu"))[0] is small
    res = build_model("resnet10", num_classes=10, input_shape=(3, 32, 32), width_mult=0.125).train()
    net, _ = ev.inference_module(res, torch.device("cpu"))
    assert net is res and any(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
