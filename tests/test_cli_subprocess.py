"""The command line as a subprocess, what only a subprocess shows: the installed ``fedsap-ray`` console script
(its entry point, exit status 0, a local Ray it starts itself) and ``python -m fedsap_ray`` (a refusal's exit
status 2 and its one line reaching the shell). Everything else about the command line runs in-process, in the
fast tier: tests/test_cli.py and the tests that use ``faultkit.cli``."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

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
