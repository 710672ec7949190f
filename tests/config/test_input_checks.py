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
    # simulated devices (issue 28)
    (["--set", "devices.policy=fastest"], "invalid devices.policy='fastest'"),
    (["--set", "devices.policy=deadline"], "invalid devices.deadline_s=None: must be a number of seconds > 0"),
    (["--set", "devices.speed_full=0"], "invalid devices.speed_full=0"),
    (["--set", "devices.availability=0"], "invalid devices.availability=0"),
    (["--set", "devices.trace=devices.txt"], "invalid devices.trace='devices.txt': must be a .csv or .parquet file"),
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


# ---------------------------------------------------------------------------------------------
# Issue 25: the last bad inputs that crashed or ran silently wrong, each now one line and exit 2
# ---------------------------------------------------------------------------------------------
def _file(tmp_path, name: str, data: bytes) -> str:
    f = tmp_path / name
    f.write_bytes(data)
    return str(f)


@pytest.mark.parametrize("make_args, needle", [
    # exit 1 with a traceback before
    (lambda t: ["--set", "algorithm.options=[1,2]"], "invalid algorithm.options=[1, 2] (--set algorithm.options=[1,2]): must be a mapping"),
    (lambda t: ["--set", "algorithm=fedprox"], "invalid algorithm='fedprox': must be a mapping; the method is chosen "
                                              "with algorithm.name=fedprox"),
    (lambda t: ["--set", "algorithm.options=abc"], "invalid algorithm.options='abc' (--set algorithm.options=abc): must be a mapping"),
    (lambda t: ["--config", _file(t, "c.yaml", b"training:\n  rounds: 2\n  x: \"\xff\xfe\"\n")],
     "c.yaml': not UTF-8 text (byte 0xff at offset 28)"),
    (lambda t: ["--config", _file(t, "c.yaml", b"algorithm: {name: {a: 1}}\n")],
     "invalid algorithm.name={'a': 1}: must be a string"),
    (lambda t: ["--config", _file(t, "c.yaml", b"1: 2\n")], "invalid 1=2: unknown key; allowed keys under the top level"),
    (lambda t: ["--config", _file(t, "c.yaml", b"training: {7: 1}\n")], "invalid training.7=1: unknown key"),
    (lambda t: ["--config", str(t)], "it is a folder, not a file"),
    # exit 1 without a traceback before
    (lambda t: ["--backend", "ray", "--address", "not a host"], "invalid resources.address='not a host': must be auto, "
                                                                "local, HOST:PORT or ray://HOST:PORT"),
    # exit 0 on bad input before
    (lambda t: ["--set", "preset=bogus"], "invalid --set preset='bogus': the preset is chosen with --preset NAME"),
    (lambda t: ["--config", _file(t, "c.yaml", b"preset: bogus\n")], "invalid preset='bogus': allowed values are smoke"),
    (lambda t: ["--config", _file(t, "c.yaml", b"preset: laptop\n")], "invalid preset='laptop': the config file asks for "
                                                                      "preset laptop but --preset smoke was given"),
    (lambda t: ["--set", "capacity.keep_ratios=[1,1,1,1,1,1,1,1,1,1]"],
     "invalid capacity.keep_ratios=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]: used only by "
     "capacity.scheme=explicit (the scheme is cyclic)"),
    (lambda t: ["--set", f"data.root={_file(t, 'afile', b'x')}"], "it is a file; data.root is the folder"),
    (lambda t: ["--set", "training.participation=0.05"], "invalid training.participation=0.05: with data.num_clients=10 "
                                                         "it samples round(0.05 * 10) = 0 clients a round; must be > 0.05"),
    (lambda t: ["--out", "s3://bucket/x"], "invalid --out='s3://bucket/x': fedsap-ray run writes to a local folder"),
    (lambda t: ["--out", ""], "invalid --out='': must name a folder (--out . for the current one)"),
    (lambda t: ["--out", "  "], "invalid --out='  ': must name a folder"),
])
def test_issue_25_bad_inputs_exit_2_with_one_line_naming_field_value_and_allowed(tmp_path, capsys, monkeypatch,
                                                                                   make_args, needle):
    monkeypatch.chdir(tmp_path)  # --out '' would have written here
    args = make_args(tmp_path)
    if "--out" not in args:
        args = ["--out", str(tmp_path / "o"), *args]
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", *args)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("fedsap-ray: error: ") and needle in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written: no o/, no s3:/, no runs/
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--print-config", *args)  # refused even when nothing would run
    assert rc == 2 and needle in lines[0], lines


def test_random_budget_p_low_above_p_min_is_legal_and_documented(capsys):
    from fedsap_ray.config import build_config

    cfg = build_config(preset="smoke", overrides=["algorithm.name=random_budget", "algorithm.p_low=0.9",
                                                  "algorithm.p_min=0.4"])
    assert cfg.algorithm.options["p_low"] == 0.9
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "algorithms.md").read_text()
    assert "Above p_min is legal" in page


def test_participation_at_one_client_a_round_is_accepted():
    from fedsap_ray.config import build_config

    assert build_config(preset="smoke", overrides=["training.participation=0.06"]).training.participation == 0.06


def test_resume_of_a_run_that_failed_before_its_first_checkpoint_says_overwrite_starts_it_again(tmp_path, capsys,
                                                                                               monkeypatch):
    from faultkit import TINY, sets
    from fedsap_ray.engine.server import Server

    def fails(self, state, t):
        raise RuntimeError("boom in round 1")

    monkeypatch.setattr(Server, "round", fails)
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path), "--run-id", "f", *sets(TINY))
    assert rc == 1
    monkeypatch.undo()
    rc, lines = cli(capsys, "run", "--quiet", "--out", str(tmp_path), "--resume", "f")
    assert rc == 2 and len(lines) == 1, lines
    assert "no checkpoint at" in lines[0] and "status 'failed'" in lines[0], lines
    assert lines[0].endswith("start it again with --run-id f --overwrite"), lines
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path), "--run-id", "f",
                    "--overwrite", *sets(TINY))
    assert rc == 0, lines


def test_resume_of_a_run_that_is_still_running_names_its_pid(tmp_path, capsys):
    import subprocess
    import sys

    from faultkit import tiny_run

    tiny_run(tmp_path, "r", stop_after=1)
    code = ("import sys; from fedsap_ray.run.guard import RunClaim; c = RunClaim(sys.argv[1], sys.argv[2]); "
            "c.acquire(); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), "r"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, lines = cli(capsys, "run", "--quiet", "--out", str(tmp_path), "--resume", "r")
        assert rc == 2 and len(lines) == 1, lines
        assert f"the run is running right now in {tmp_path} (pid {holder.pid})" in lines[0], lines
    finally:
        holder.kill()
        holder.wait()
    rc, lines = cli(capsys, "run", "--quiet", "--out", str(tmp_path), "--resume", "r")  # free again: it resumes
    assert rc == 0, lines


@pytest.mark.parametrize("shared", ["empty", "missing"])
def test_an_empty_or_missing_shared_data_folder_is_named(tmp_path, capsys, monkeypatch, shared):
    from fedsap_ray.data.federation import clear_split_cache

    folder = tmp_path / "shared"
    if shared == "empty":
        folder.mkdir()
    monkeypatch.setenv("FEDSAP_SHARED_DATA", str(folder))
    monkeypatch.setenv("FEDSAP_RAY_DATA", str(tmp_path / "cache"))
    clear_split_cache()
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path / "o"),
                    "--set", "data.name=mnist", "--set", "data.partition=iid")
    assert rc == 2 and len(lines) == 1, lines
    state = "is empty" if shared == "empty" else "does not exist"
    assert lines[0].endswith(f"nor under FEDSAP_SHARED_DATA={folder}: that folder {state}"), lines


# ---------------------------------------------------------------------------------------------
# Sweep flags: refused before Ray starts
# ---------------------------------------------------------------------------------------------
def _ablation():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "sweeps" / "ablation.py"
    spec = importlib.util.spec_from_file_location("sweep_ablation_checks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("flags, needle", [
    (["--seeds", "0", "0"], "invalid --seeds=[0, 0]: each seed at most once"),
    (["--max-concurrent", "0"], "invalid --max-concurrent=0: must be an integer >= 1"),
    (["--server-cpus", "nan"], "invalid --server-cpus=nan: must be a positive finite number"),
    (["--server-cpus", "-1"], "invalid --server-cpus=-1.0"),
    (["--max-failures", "-5"], "invalid --max-failures=-5: must be an integer >= 0"),
    (["--workers-per-trial", "-1"], "invalid --workers-per-trial=-1"),
    (["--address", "not a host"], "invalid --address='not a host'"),
    (["--out", "AFILE"], "it is a file, not a folder"),
    (["--out", "AFILE/sub"], "is a file, so the folder cannot be created"),
    (["--out", ""], "invalid --out='': must name a folder or a URI"),
    (["--out", "nosuchscheme://x/y"], "invalid --out='nosuchscheme://x/y'"),
])
def test_bad_sweep_flags_exit_2_before_ray_starts(tmp_path, capsys, flags, needle):
    ray = pytest.importorskip("ray")
    afile = tmp_path / "afile"
    afile.write_text("x")
    flags = [f.replace("AFILE", str(afile)) for f in flags]
    out = [] if "--out" in flags else ["--out", str(tmp_path / "sweep")]
    rc = _ablation().main(["--smoke-test", *out, *flags])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not ray.is_initialized() and not (tmp_path / "sweep").exists()


def test_a_sweep_into_a_read_only_folder_exits_2_before_ray_starts(tmp_path, capsys):
    ray = pytest.importorskip("ray")
    from faultkit import tmpfs

    with tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        rc = _ablation().main(["--smoke-test", "--out", str(ro / "sweep")])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and f"invalid --out='{ro / 'sweep'}'" in lines[0], lines
        assert "is not writable" in lines[0] and not ray.is_initialized()
