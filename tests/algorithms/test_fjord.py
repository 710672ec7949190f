"""FjORD's options: validation, the config hash at their defaults, and ``od_sampling=batch`` in whole runs
(synchronous and asynchronous). Its arithmetic against a reference is tests/algorithms/test_reference_fjord.py."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_options_rejected, tiny_overrides
from faultkit import cli
from fedsap_ray import results
from fedsap_ray.algorithms.fjord import step_sizes
from fedsap_ray.config import build_config
from fedsap_ray.experiment import run_experiment

TINY = tiny_overrides("fjord", "data.num_clients=4", "training.rounds=2", "training.local_epochs=2",
                      "training.eval_deployed=false")
BATCH = [*TINY, "algorithm.od_sampling=batch"]


def test_bad_values_are_refused_naming_the_option():
    assert_options_rejected(TINY, "algorithm.od_sampling=step", "algorithm.od_bn=layer", "algorithm.od_sampling=1")


def test_per_width_batchnorm_is_refused_by_name_with_one_line_and_exit_2(tmp_path, capsys):
    """Not a stub: the refusal names the option and says what blocks it; the command writes nothing."""
    out = tmp_path / "out"
    rc, err = cli(capsys, "run", "--preset", "smoke", "--out", str(out),
                  *[a for o in [*TINY, "algorithm.od_bn=per_width"] for a in ("--set", o)])
    assert rc == 2 and len(err) == 1, err
    assert "invalid algorithm.od_bn='per_width': not built" in err[0] and err[0].endswith("use shared")
    assert not out.exists()


def test_options_at_their_defaults_keep_the_config_hash():
    """A run that names the defaults is the run it was before the options existed (same hash, same run id prefix);
    ``batch`` is another run."""
    plain = build_config(preset="smoke", overrides=TINY).config_hash()
    named = build_config(preset="smoke", overrides=[*TINY, "algorithm.od_sampling=round", "algorithm.od_bn=shared"])
    assert named.config_hash() == plain
    assert build_config(preset="smoke", overrides=BATCH).config_hash() != plain


def test_step_sizes_follow_the_client_loop():
    """13 samples in batches of 4 (the size-1 remainder skipped), at most 2 steps an epoch, 2 epochs."""
    assert step_sizes(13, 4, 2, None) == [4, 4, 4] * 2
    assert step_sizes(13, 4, 2, 2) == [4, 4] * 2
    assert step_sizes(14, 4, 1, None) == [4, 4, 4, 2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, single_thread):
    """Two-round runs of ``batch``: synchronous and asynchronous (FjORD declares an asynchronous reading)."""
    out = tmp_path_factory.mktemp("fjord")
    run_experiment(build_config(preset="smoke", overrides=BATCH), out / "sync", run_id="s")
    run_experiment(build_config(preset="smoke", overrides=[*BATCH, "devices.mode=async", "asynchronous.concurrency=2",
                                                               "asynchronous.buffer_size=2"]), out / "async", run_id="a")
    return results.load(out / "sync"), results.load(out / "async")


@pytest.mark.parametrize("mode", [0, 1], ids=["sync", "async"])
def test_batch_sampling_trains_p_max_and_counts_each_steps_width(runs, mode):
    """Every client trains (and uploads) its p_max sub-model; a client with tiers below p_max spends fewer MACs
    than one forward pass of that sub-model per sample (its steps ran narrower ones), never more; a client at the
    lowest tier has nothing to draw and spends exactly that."""
    res = runs[mode]
    assert (res.runs["status"] == "finished").all()
    c = res.clients
    assert np.allclose(c["capacity_used"], c["capacity_max"])
    seen = c["n_samples"].map(lambda n: sum(step_sizes(int(n), 16, 2, 3)))  # TINY_BASE's batches, 2 epochs
    full = seen * c["macs_per_sample"]
    lowest = c["capacity_max"] == c["capacity_max"].min()
    assert (c["train_macs"] <= full).all()
    assert (c.loc[lowest, "train_macs"] == full[lowest]).all()
    assert (c.loc[~lowest, "train_macs"] < full[~lowest]).any()
