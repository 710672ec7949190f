"""The command line as a subprocess, what only a subprocess shows: the installed ``fedsap-ray`` console script
(its entry point, exit status 0, a local Ray it starts itself), ``python -m fedsap_ray`` (a refusal's exit
status 2 and its one line reaching the shell) and a run killed with SIGKILL at any moment, then ``--resume``d.
Everything else about the command line runs in-process, in the
fast tier: tests/test_cli.py and the tests that use ``faultkit.cli``."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import steady, tiny_overrides
from faultkit import kill_once_checkpointed, runs_row
from fedsap_ray import results
from fedsap_ray.persist import checkpoint
from fedsap_ray.config import build_config
from fedsap_ray.experiment import run_experiment
from test_cli import BAD_INPUT, one_line_refusal


def cli_subprocess(*args, timeout=300, console_script=False):
    """``python -m fedsap_ray ARGS``, or the ``fedsap-ray`` console script installed beside this interpreter."""
    if console_script:
        exe = shutil.which("fedsap-ray", path=str(Path(sys.executable).parent))
        assert exe, f"the fedsap-ray console script is not installed in {Path(sys.executable).parent} (pip install -e .)"
        cmd = [exe, *args]
    else:
        cmd = [sys.executable, "-m", "fedsap_ray", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_a_refusal_exits_2_with_one_line_from_the_shell(tmp_path):
    """The exit status and the one line reach the shell through ``python -m fedsap_ray`` (a config refusal, and
    one from argparse)."""
    for args, needle in (BAD_INPUT[0], BAD_INPUT[4]):
        r = cli_subprocess("run", "--preset", "smoke", "--out", str(tmp_path), *args)
        one_line_refusal(r, needle, tmp_path)


def test_ray_backend_smoke_from_the_console_script(tmp_path):
    """The installed ``fedsap-ray`` as a user runs it: it starts a local Ray of its own, runs, exits 0."""
    pytest.importorskip("ray")
    r = cli_subprocess("run", "--preset", "smoke", "--backend", "ray", "--out", str(tmp_path), "--set",
                       "training.rounds=2", "--set", "resources.cpus_per_worker=1", timeout=600, console_script=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "round 2/2" in r.stderr
    clients = pd.read_parquet(tmp_path / "clients")
    assert clients["worker"].str.startswith("fedsap-").all()
    assert pd.read_parquet(tmp_path / "runs").loc[0, "backend"] == "ray"


def test_an_async_run_killed_mid_run_and_resumed_equals_the_run_never_killed(tmp_path):
    """kill -9 of ``fedsap-ray run`` with ``devices.mode=async`` (issue 44) once it has checkpointed step 3 of 12:
    wherever in a step the kill lands (training, writing rows, writing the checkpoint), ``--resume`` continues
    from the last checkpoint, whose engine state holds the updates in flight, and every table equals the
    uninterrupted run's (tests/engine/test_asyncmode_resume.py checks the engine's state in-process)."""
    trace = tmp_path / "trace.csv"
    pd.DataFrame({"client_id": range(6), "speed": [0.5e9, 1e9, 0.6e9, 0.8e9, 0.45e9, 1e9], "down_bytes_s": 1e12,
                  "up_bytes_s": 1e12}).to_csv(trace, index=False)
    overrides = tiny_overrides("heterofl", "data.num_clients=6", "training.eval_deployed=false", "devices.mode=async",
                               f"devices.trace={trace}", "asynchronous.concurrency=5", "asynchronous.buffer_size=2",
                               "asynchronous.staleness=polynomial", "asynchronous.server_lr=0.7",
                               "asynchronous.max_staleness=2", "training.rounds=12", "training.eval_every=3",
                               "training.keep_model=final+best")
    cut = tmp_path / "cut"
    done, code = kill_once_checkpointed(cut, "r", overrides, 3, tmp_path / "log")
    assert done >= 3 and code == -signal.SIGKILL, (tmp_path / "log").read_text()[-3000:]
    row = runs_row(cut, "r")
    assert row["status"] == "running" and row["rounds_done"] < 12  # killed mid-run, its row says so
    resumed = subprocess.run([sys.executable, "-m", "fedsap_ray", "run", "--quiet", "--out", str(cut), "--resume", "r"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_experiment(build_config(preset="smoke", overrides=overrides), tmp_path / "whole", run_id="r")
    a, b = results.load(cut), results.load(tmp_path / "whole")
    assert a.runs.loc[0, "status"] == "finished" and a.clients["staleness"].max() > 0
    placement = ["worker", "gpu_id", "node"]  # where it ran (this process's node is Ray's when a test started Ray)
    for table in ("rounds", "clients", "layers", "allocations"):
        pd.testing.assert_frame_equal(steady(getattr(a, table)).drop(columns=placement, errors="ignore"),
                                      steady(getattr(b, table)).drop(columns=placement, errors="ignore"))
    # the kept models too (issue 53), byte for byte: the best one written before its step's checkpoint is kept again
    kept = [p.name for p in results.kept_models(tmp_path / "whole", "r")]
    assert [p.name for p in results.kept_models(cut, "r")] == kept and len(kept) == 8
    for name in kept:
        assert (cut / "models" / "r" / name).read_bytes() == (tmp_path / "whole" / "models" / "r" / name).read_bytes()


def test_a_refused_async_resume_on_ray_is_one_line_and_exit_2_with_no_abort(tmp_path):
    """Issue 52: a resume the server's session refuses (here an asynchronous engine state of another version) was
    the Ray actor's death (a traceback, ``ActorDiedError``, exit 1) and once a SIGABRT at the interpreter's exit
    ("terminate called without an active exception"): the refusal comes back as itself, the command shuts down
    the Ray it started and exits 2 with the one line, nothing in the folder changed."""
    pytest.importorskip("ray")
    from fedsap_ray.common.messages import ServerState

    overrides = tiny_overrides("fedavg", "data.num_clients=4", "devices.mode=async", "asynchronous.concurrency=3",
                               "asynchronous.buffer_size=2", "training.rounds=3")

    def stop(summary):
        if summary.round == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(build_config(preset="smoke", overrides=overrides), tmp_path, run_id="r", progress=stop)
    ck = checkpoint.load(tmp_path, "r")
    ck["engine"]["version"] = 2
    st = ck["state"]
    checkpoint.save(tmp_path, "r", ServerState(st.round, st.params, st.strategy_state), ck["server"],
                    tables=ck["tables"], rows=ck["rows"], engine=ck["engine"])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r = cli_subprocess("run", "--quiet", "--out", str(tmp_path), "--resume", "r", "--backend", "ray", timeout=600)
    ours = [line for line in r.stderr.splitlines() if line.startswith("fedsap-ray")]
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(ours) == 1 and ours[0].startswith("fedsap-ray: error: invalid --resume='r': checkpoint "), ours
    assert "engine is format 'fedbuff' version 2" in ours[0]
    assert "Traceback" not in r.stderr and "terminate called" not in r.stderr, r.stderr[-3000:]
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
