"""DapperFL's server step against an independent plain-PyTorch reference (issue 55, item 3), in both readings of
step 7: ``refill=global`` (pruned coordinates from W^{t-1}, the paper) and ``refill=zero`` (what the released code,
jyzgh/DapperFL ``models/utils/federated_model.py`` ``aggregate_nets``, averages: its refill is discarded by
``prune.remove``); and ``alpha_0=0 alpha_min=0``, its fusion that never takes effect."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import federation_fixture, run_rounds_with_plans, tiny_overrides
from fedsap_ray.cli import main
from fedsap_ray.config import build_config

# Generated blobs and the MLP: five clients of 200 or 400 samples, capacities 1, 0.8, 0.6, 0.4, 0.2
BASE = tiny_overrides("dapperfl", "data.name=generated_blobs", "model.name=mlp", "data.partition=iid",
                      "data.num_clients=5", "data.max_train_per_domain=400", "training.rounds=2",
                      "training.local_epochs=2")

fed = federation_fixture(BASE)


def ref_server(prev: torch.Tensor, pruned: list[torch.Tensor], masks: list[torch.Tensor], sizes: list[float],
               is_param: torch.Tensor, refill: str) -> torch.Tensor:
    """The weighted mean of the clients' pruned models, each brought to full size first: with ``global`` the
    pruned coordinates take the previous global model's values (the paper's reconstruction); with ``zero`` the
    pruned parameters stay 0, as the released code's ``weight_orig * mask`` after ``prune.remove`` (buffers,
    which it never prunes, from the previous model). float64 sums, float32 result."""
    fill = torch.where(is_param, torch.zeros_like(prev), prev) if refill == "zero" else prev
    total = sum(sizes)
    acc = torch.zeros(prev.shape, dtype=torch.float64)
    for w, m, n in zip(pruned, masks, sizes):
        acc += n * torch.where(m, w, fill).double()
    return (acc / total).float()


@pytest.mark.parametrize("refill", ["global", "zero"])
def test_two_rounds_of_aggregation_equal_the_plain_pytorch_reference(fed, refill):
    """Each round's new global model equals the reference's mean of the same uploads (the clients' pruned
    values at their kept coordinates, as plain tensors), round 2 starting from round 1's model. Measured max
    |difference| 0.0 (the same float64 sums in the same order); tolerance 1e-6. Planting the other refill in
    ours fails it (a difference of 0.01 or more, checked when this test was written)."""
    cfg = build_config(preset="smoke", overrides=[*BASE, f"algorithm.refill={refill}"])
    ctx, _, states, plans, outs = run_rounds_with_plans(cfg, fed, 2)
    is_param = torch.from_numpy(ctx.layout.param_coords())
    for t in (1, 2):
        prev = torch.from_numpy(states[t - 1].params)
        results = sorted(outs[t - 1], key=lambda r: r.client_id)
        pruned, masks = [], []
        for r in results:
            m = torch.from_numpy(np.asarray(r.mask))
            full = torch.zeros_like(prev)
            full[m] = torch.from_numpy(r.values)
            pruned.append(full)
            masks.append(m)
        assert not all(bool(m.all()) for m in masks)  # some client really pruned: the readings differ
        want = ref_server(prev, pruned, masks, [float(r.n_samples) for r in results], is_param, refill)
        np.testing.assert_allclose(states[t].params, want.numpy(), rtol=0, atol=1e-6)


def test_the_two_refills_give_different_models(fed):
    a = run_rounds_with_plans(build_config(preset="smoke", overrides=BASE), fed, 1)[2][-1].params
    b = run_rounds_with_plans(build_config(preset="smoke", overrides=[*BASE, "algorithm.refill=zero"]), fed, 1)[2][-1].params
    assert np.abs(a - b).max() > 1e-3


def test_zero_fusion_weights_never_fuse(fed):
    """``alpha_0=0 alpha_min=0``, the released code's effective fusion: alpha_t = 0 in every round."""
    cfg = build_config(preset="smoke", overrides=[*BASE, "algorithm.alpha_0=0", "algorithm.alpha_min=0"])
    ctx, strat, _ = run_rounds_with_plans(cfg, fed, 1)[:3]
    assert [strat.alpha_at(t) for t in range(1, 8)] == [0.0] * 7


def test_default_options_keep_the_config_hash():
    """``refill`` left at its default changes no config hash (the hash of this config before the option)."""
    assert build_config(preset="smoke", overrides=["algorithm.name=dapperfl"]).config_hash() == "119793f29fe1"


@pytest.mark.parametrize("extra", [("algorithm.refill=half",), ("algorithm.refill=zero", "devices.mode=async")],
                         ids=["bad-value", "zero-in-async"])
def test_refused_exits_2_naming_the_option(capsys, tmp_path, extra):
    sets = [a for opt in ("algorithm.name=dapperfl", *extra) for a in ("--set", opt)]
    rc = main(["run", "--preset", "smoke", *sets, "--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "algorithm.refill" in err[0], err
    assert not (tmp_path / "o").exists()
