"""Input a run cannot use exits 2 with one line naming the field, before any work and with nothing
written: seeds, tier shares, partitions the data cannot give, non-finite numbers, damaged dataset files."""
from __future__ import annotations

import os

import numpy as np
import pytest

from faultkit import cli


@pytest.mark.parametrize("args, needle", [
    (["--seed", "99999999999999999999999"], "invalid seed=99999999999999999999999: must be an integer in [0, 4294967295]"),
    (["--seed", "4294967296"], "invalid seed=4294967296"),
    (["--set", "capacity.tier_shares=[0,0,0,0]"], "invalid capacity.tier_shares=[0.0, 0.0, 0.0, 0.0]"),
    (["--set", "capacity.tier_shares=[-1,1,1,1]"], "invalid capacity.tier_shares=-1.0"),
    (["--set", "data.num_clients=1"], "invalid data.num_clients=1:"),
    (["--set", "data.num_clients=100000"], "invalid data.num_clients=100000:"),
    (["--set", "data.partition=iid", "--set", "data.num_clients=100000"], "invalid data.num_clients=100000:"),
    (["--set", "data.partition=dirichlet", "--set", "data.num_clients=100000"], "invalid data.num_clients=100000:"),
    (["--set", "data.partition=dirichlet", "--set", "data.min_samples=5000"], "invalid data.min_samples=5000:"),
    (["--set", "algorithm.name=fedprox", "--set", "algorithm.mu=.nan"], "invalid algorithm.mu=nan: must be a finite"),
    (["--set", "algorithm.temperature=.nan"], "invalid algorithm.temperature=nan"),
    (["--set", "training.lr=.inf"], "invalid training.lr=inf"),
    (["--set", "training.weight_decay=.inf"], "invalid training.weight_decay=inf"),
    (["--set", "model.width_mult=-.inf"], "invalid model.width_mult=-inf"),
    (["--set", "training.rounds=1e30"], "invalid training.rounds="),
    # a model that cannot take the dataset's inputs, and FedSAP's DGA layer on a model without it
    (["--set", "model.name=mlp"], "invalid model.name='mlp': mlp: input_shape must be (features,)"),
    (["--set", "model.name=cnn_small", "--set", "algorithm.dga_layer=layer3"],
     "invalid algorithm.dga_layer='layer3': model cnn_small has no such layer"),
])
def test_input_the_run_cannot_use_exits_2_naming_the_field(tmp_path, capsys, args, needle):
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path / "o"), *args)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("fedsap-ray: error: ") and needle in lines[0], lines
    assert "np.float64" not in lines[0]
    assert not (tmp_path / "o").exists()  # nothing written, not even the folder


def test_a_truncated_mnist_npz_names_the_file_and_says_to_fetch_it_again(tmp_path, capsys):
    f = tmp_path / "mnist" / "mnist.npz"
    f.parent.mkdir()
    z = np.zeros((30, 28, 28), np.uint8)
    np.savez(f, x_train=z, y_train=np.zeros(30, np.int64), x_test=z, y_test=np.zeros(30, np.int64))
    os.truncate(f, f.stat().st_size // 2)
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--out", str(tmp_path / "o"), "--set", "data.name=mnist",
                    "--set", "data.partition=iid", "--set", f"data.root={tmp_path}")
    assert rc == 2 and len(lines) == 1, lines
    assert "data.name='mnist'" in lines[0] and str(f) in lines[0] and "fetch it again" in lines[0], lines
    assert not (tmp_path / "o").exists()
