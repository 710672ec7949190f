"""Central DP on a model with BatchNorm (fedsap_ray/engine/privacy.py): the released running variances are kept >= 0.

Found by the privacy study (docs/studies/privacy.md): the Gaussian noise of the release lands on the BatchNorm running
variances too, so some went negative (9 of ResNet10's 12 variance buffers on the smoke preset at epsilon 2) and
every evaluation of the server's model gave a NaN loss and chance accuracy from round 1 on."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from fedsap_ray import results
from fedsap_ray.common.messages import RoundOutput, RoundRecords, ServerState
from fedsap_ray.config import build_config
from fedsap_ray.engine.privacy import PrivateRounds, variance_coordinates
from fedsap_ray.experiment import run_experiment
from fedsap_ray.models import build_model
from fedsap_ray.models.masks import ParamLayout
from conftest import tiny_overrides

PRIVATE = ["privacy.mode=central", "privacy.target_epsilon=2"]


def _layout() -> ParamLayout:
    return ParamLayout.from_model(build_model("resnet10", num_classes=10, input_shape=(3, 32, 32), width_mult=0.0625))


def test_the_variance_coordinates_are_exactly_the_running_variances():
    layout = _layout()
    var = variance_coordinates(layout)
    want = sum(s for n, s in zip(layout.names, layout.sizes) if n.endswith("running_var"))
    assert var is not None and int(var.sum()) == want > 0
    for name, off, size in zip(layout.names, layout.offsets, layout.sizes):
        assert var[off:off + size].all() == name.endswith("running_var")
    mlp = ParamLayout.from_model(build_model("cnn_small", num_classes=10, input_shape=(3, 32, 32), width_mult=0.25))
    assert variance_coordinates(mlp) is None  # no BatchNorm: nothing to keep


def test_record_sets_negative_released_variances_to_zero_and_nothing_else():
    layout = _layout()
    cfg = build_config(preset="smoke", overrides=tiny_overrides("fedavg", *PRIVATE, "model.width_mult=0.0625"))
    mech = PrivateRounds.for_config(cfg, layout)
    assert mech is not None and mech.variances is not None
    params = np.random.default_rng(0).standard_normal(layout.size).astype(np.float32)
    out = mech.record(1, RoundOutput(ServerState(round=1, params=params), RoundRecords()), {})
    got = out.state.params
    var = mech.variances
    assert (got[var] >= 0).all() and np.array_equal(got[var], np.maximum(params[var], 0))
    assert np.array_equal(got[~var], params[~var])  # weights, biases and running means are the release's
    assert params[var].min() < 0  # the input had some to fix; it is not changed in place
    ok = np.abs(params)
    same = mech.record(2, RoundOutput(ServerState(round=2, params=ok), RoundRecords()), {})
    assert same.state.params is ok  # nothing negative: the very array (a zero-noise run is unchanged)


def test_a_private_resnet_run_evaluates_its_server_model(tmp_path):
    cfg = build_config(preset="smoke", overrides=tiny_overrides("fedavg", *PRIVATE, "training.rounds=2"))
    run_experiment(dataclasses.replace(cfg), tmp_path, run_id="x")
    rounds = results.load(tmp_path).rounds
    glob = rounds[(rounds["eval_mode"] == "global") & (rounds["domain"] == "__global__")]
    assert len(glob) == 2 and all(math.isfinite(v) for v in glob["loss"])  # was NaN from round 1
