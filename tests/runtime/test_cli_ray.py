"""``fedsap-ray run --backend ray`` from the command line: the CLI starts its own local Ray and trains in actors."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

pytestmark = pytest.mark.ray  # starts Ray: the one xdist group that runs such tests (tests/conftest.py)


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fedsap_ray", *args], capture_output=True, text=True, timeout=timeout)


def test_ray_backend_smoke_from_the_cli(tmp_path):
    pytest.importorskip("ray")
    r = _cli("run", "--preset", "smoke", "--backend", "ray", "--out", str(tmp_path), "--set", "training.rounds=2",
            "--set", "resources.cpus_per_worker=1", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "round 2/2" in r.stderr
    clients = pd.read_parquet(tmp_path / "clients")
    assert clients["worker"].str.startswith("fedsap-").all()
    assert pd.read_parquet(tmp_path / "runs").loc[0, "backend"] == "ray"
