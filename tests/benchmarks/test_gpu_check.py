"""benchmarks/gpu_check.sh on a machine without CUDA: it says so, exits 0 and measures nothing (the GPU steps
themselves are checked by running the script with GPU_CHECK_DEVICE=cpu by hand; benchmarks/README.md)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    # the interpreter is a stand-in that answers the script's torch.cuda.is_available() as a machine without CUDA
    # does (importing torch in a subprocess would cost this tier seconds); it fails on anything else it is asked
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$2" in *cuda.is_available*) echo False; exit 0;; esac\nexit 3\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "TMPDIR": str(tmp_path)}
    env.pop("GPU_CHECK_DEVICE", None)
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "figures.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu_check: no CUDA device here"), done.stdout
    assert "(at most" not in done.stdout  # no step started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python"]  # no JSON, no work folder
