"""fedsap_ray.runtime.allocator: with glibc's thresholds fixed, a round's large blocks are reused, not returned to
the OS and faulted in again (the mechanism, counted in minor page faults of a fresh process, never timed)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A fresh process allocates and frees two 16 MiB arrays 40 times (as a round allocates its vectors), once to
# warm up and once counted; argv[1]: "tune" calls tune_malloc first, "local" starts a LocalBackend (which must
# tune), anything else nothing. Prints what tune_malloc reported and the counted minor faults.
CHURN = r"""
import resource, sys
import numpy as np
from fedsap_ray.runtime import allocator

if sys.argv[1] == "tune":
    allocator.tune_malloc()
elif sys.argv[1] == "local":
    from fedsap_ray.config import build_config
    from fedsap_ray.runtime.local import LocalBackend
    from fedsap_ray.run.session import build_context
    LocalBackend("cpu", num_workers=1).start(build_context(build_config(preset="smoke")))

def churn():
    for _ in range(40):
        a = np.ones(4 << 20, np.float32); b = np.ones(4 << 20, np.float32); del a; del b

churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(allocator._applied is not None, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")


def _churn(how: str, **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("FEDSAP_RAY_MALLOC", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", CHURN, how], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_tuned_process_reuses_freed_blocks_instead_of_faulting_them_in_again():
    tuned, faults = _churn("tune")
    untuned_flag, untuned = _churn("none")
    assert tuned and not untuned_flag
    assert untuned > 20_000  # glibc's adaptive trim hands each round's 32 MiB back: ~8,192 pages faulted per pass
    assert faults < untuned / 100


def test_local_backend_tunes_its_process():
    tuned, faults = _churn("local")
    assert tuned and faults < 1_000


def test_users_choice_is_left_alone():
    """FEDSAP_RAY_MALLOC=default, or glibc's own settings (a MALLOC_*_ variable, a malloc tunable), and nothing is
    changed."""
    for env in ({"FEDSAP_RAY_MALLOC": "default"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}):
        tuned, faults = _churn("tune", **env)
        assert not tuned and faults > 20_000, env
