"""HeteroFL's readings of its authors' code as options: refused values, config hashes, the label mask's client
hook and aggregation rule, and the asynchronous mode (the rules themselves: test_reference_heterofl.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_strategy
from faultkit import cli
from fedsap_ray import results
from fedsap_ray.algorithms.heterofl import CLASSES, LabelMask
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import DomainData
from fedsap_ray.experiment import run_experiment
from fedsap_ray.common.messages import ClientResult
from fedsap_ray.config.registry import STRATEGIES
from refdrive import config

AUTHORS = ["algorithm.weighting=count", "algorithm.label_mask=true"]  # the documented --set line


@pytest.mark.parametrize("override, allowed", [("algorithm.weighting=size", "allowed values are samples, count"),
                                               ("algorithm.label_mask=2", "must be true or false")])
def test_a_bad_value_exits_2_with_one_line_naming_the_option(tmp_path, capsys, override, allowed):
    out = tmp_path / "o"
    rc, err = cli(capsys, "run", "--preset", "smoke", "--out", str(out), "--set", "algorithm.name=heterofl",
                  "--set", override)
    assert rc == 2 and len(err) == 1, err
    assert f"invalid {override.split('=')[0]}=" in err[0] and allowed in err[0]
    assert not out.exists()


def test_default_options_leave_the_config_hash_as_it_was():
    """A run that does not set them has no new key in its stored config, so its hash is computed exactly as before
    the options existed, under every preset (no preset fills them in)."""
    for preset in ("smoke", "laptop", "paper"):
        cfg = build_config(preset=preset, overrides=["algorithm.name=heterofl"])
        assert dict(cfg.algorithm.options) == {} and cfg.to_dict()["algorithm"] == {"name": "heterofl", "options": {}}
        assert cfg.algorithm.opts == STRATEGIES.get("heterofl").Options()
    assert STRATEGIES.get("heterofl").preset_options == {}
    authors = build_config(preset="smoke", overrides=["algorithm.name=heterofl", *AUTHORS])
    assert authors.config_hash() != build_config(preset="smoke", overrides=["algorithm.name=heterofl"]).config_hash()


def test_label_mask_zero_fills_the_absent_classes_logits(single_thread):
    """The hook masks the logits of the classes absent from the client's data, so their classifier rows get no
    gradient from the loss, and reports the classes it held (that the fill is 0, not -inf, as the authors' code:
    test_reference_heterofl.py, which fails with -inf)."""
    cfg = config("heterofl", 4, "capacity.scheme=full", "algorithm.label_mask=true", "training.local_epochs=1",
                 "training.max_steps_per_epoch=1", "training.batch_size=16")
    ctx, strat = make_strategy(cfg, build_federation(cfg))
    plan = strat.configure_round(strat.init_state(), 1)[0]
    assert plan.hooks == (call(LabelMask),)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 32, generator=g), torch.tensor([1, 4] * 8)
    model = ctx.model
    r = train_client(plan, model, ctx.layout, DomainData(x, y))
    assert r.stats[CLASSES].tolist() == [c in (1, 4) for c in range(10)]
    assert r.mask is None  # the full model: values are every coordinate
    lo, hi = ctx.layout.span("fc3.weight")
    moved = (r.values[lo:hi] != plan.params[lo:hi]).reshape(10, -1).any(axis=1)
    assert moved.tolist() == [c in (1, 4) for c in range(10)]  # no weight decay here: only the held rows move


def test_a_result_without_its_classes_is_refused_by_name(single_thread):
    cfg = config("heterofl", 4, "capacity.scheme=full", "algorithm.label_mask=true")
    _, strat = make_strategy(cfg, build_federation(cfg))
    state = strat.init_state()
    bad = ClientResult(client_id=2, round=1, values=state.params.copy(), n_samples=3, train_loss=0.0,
                       stats={CLASSES: np.ones(3, dtype=np.bool_)})
    with pytest.raises(ValueError, match=r"client 2 \(HeteroFL, label_mask\): stats\['held_classes'\] must be a bool vector of the 10"):
        strat.merge(state, {}, [bad], 1)


def test_the_authors_reading_runs_asynchronously_and_resumes(tmp_path, single_thread):
    """Both readings live in the strategy's merge, which the asynchronous engine calls on its buffer (count: each
    buffered update weighs 1; label mask: the classes travel in the update's stats, also through a checkpoint of
    updates in flight). Interrupted after step 2 and resumed, the run equals one never interrupted."""
    cfg = config("heterofl", 4, *AUTHORS, "devices.mode=async", "asynchronous.concurrency=3",
                 "asynchronous.buffer_size=2", "data.partition=dirichlet", "training.rounds=3",
                 "training.eval_deployed=false", "capacity.scheme=explicit", "capacity.keep_ratios=[1,0.5,0.25,0.5]")

    def stop(summary):
        if summary.round == 2:
            raise KeyboardInterrupt

    run_experiment(cfg, tmp_path / "a", run_id="x")
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "b", run_id="x", progress=stop)
    run_experiment(cfg, tmp_path / "b", run_id="x", resume=True)
    a, b = results.load(tmp_path / "a"), results.load(tmp_path / "b")
    assert a.runs.status.tolist() == b.runs.status.tolist() == ["finished"]
    cols = ["round", "domain", "eval_mode", "accuracy", "loss"]
    key = cols[:3]
    assert a.rounds[cols].sort_values(key).reset_index(drop=True).equals(b.rounds[cols].sort_values(key).reset_index(drop=True))
    assert a.clients.staleness.max() > 0  # asynchronous: some update was applied to a newer model than it trained
