"""GPU smoke test (``-m gpu``): one round on CUDA where a device is present, skipped with the reason elsewhere.

The CPU half (same numbers after the loss moved onto the device) is the determinism tests of
test_run.py and test_ray.py; here only what needs a GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.experiment import run_experiment

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: this smoke test runs a round on a GPU where one is present")

TINY = ["data.num_clients=4", "data.max_test_per_domain=40", "model.width_mult=0.0625", "training.rounds=1",
        "training.local_epochs=1", "training.batch_size=16", "training.max_steps_per_epoch=3"]


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fedavg", "fedsap"])
def test_one_round_on_cuda(tmp_path, algorithm):
    cfg = build_config(preset="smoke", overrides=[f"algorithm.name={algorithm}", *TINY, "resources.device=cuda"])
    outcome = run_experiment(cfg, tmp_path, run_id="g")
    assert outcome.status == "finished"
    res = results.load(tmp_path)
    assert len(res.clients) > 0 and np.isfinite(res.clients["train_loss"]).all()
    assert math.isfinite(outcome.final_global_accuracy)
    # the same round on CPU: float tolerance (CUDA kernels sum in another order), never bits
    cpu = build_config(preset="smoke", overrides=[f"algorithm.name={algorithm}", *TINY, "resources.device=cpu"])
    run_experiment(cpu, tmp_path / "cpu", run_id="c")
    ref = results.load(tmp_path / "cpu")
    np.testing.assert_allclose(res.clients["train_loss"], ref.clients["train_loss"], rtol=1e-3, atol=1e-4)
