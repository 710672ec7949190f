"""A run that diverges says which setting to lower, and names the one that matters in its mode (issue 52): in
``devices.mode=async`` the server's step ``asynchronous.server_lr`` as well as ``training.lr``, and a strategy's
own step size (SCAFFOLD's ``algorithm.global_lr``); a server step that leaves a non-finite model stops the run there,
before its checkpoint (which a resume would refuse) and before clients train on it."""
from __future__ import annotations

import pytest

from faultkit import TINY, cli, runs_row, sets
from fedsap_ray.persist import checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
ASYNC = ["devices.mode=async", "asynchronous.concurrency=3", "asynchronous.buffer_size=2"]
CASES = {
    # the server's step overflows the model to infinity: stopped at that step
    "async-server-lr-1e300": ([*ASYNC, "asynchronous.server_lr=1e300"],
                              "round 1: the model holds", "asynchronous.server_lr=1e+300"),
    # a huge but finite model: the clients that train on it diverge
    "async-server-lr-1e20": ([*ASYNC, "asynchronous.server_lr=1e20"],
                             "FloatingPointError: training loss is nan", "asynchronous.server_lr=1e+20"),
    "scaffold-global-lr": (["algorithm.name=scaffold", "algorithm.global_lr=1e300"],
                           "round 1: the model holds", "algorithm.global_lr=1e+300"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_divergence_hint_names_the_step_size_of_the_runs_mode(tmp_path, capsys, case):
    extra, what, setting = CASES[case]
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path), "--run-id", "d",
                    *sets([*TINY, *extra]))
    assert rc == 1 and lines[0].startswith("fedsap-ray: run failed: "), lines
    assert what in lines[0] and f"(diverged; lower training.lr=0.05 or {setting}?)" in lines[0], lines
    row = runs_row(tmp_path, "d")
    assert row["status"] == "failed" and setting in row["error"]
    if "model holds" in what:  # never checkpointed: the checkpoint on disk, if any, is of a finite model
        assert row["rounds_done"] == 0 and not checkpoint.path_for(tmp_path, "d").exists()


def test_a_synchronous_run_names_only_training_lr(tmp_path, capsys):
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path), "--run-id", "d",
                    *sets([*TINY, "training.lr=1e30"]))
    assert rc == 1 and lines[0].endswith("training loss is nan (diverged; lower training.lr=1e+30?)"), lines
