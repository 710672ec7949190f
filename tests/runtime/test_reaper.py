"""The reaper: what a killed driver's local Ray would leave behind is ended (Linux /proc)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsap_ray.runtime import reaper


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_the_reaper_ends_what_a_killed_driver_left_behind():
    if not Path("/proc/self/stat").is_file():
        pytest.skip("the reaper needs /proc (Linux)")
    # a "driver" whose child outlives it unless someone ends it (like Ray's agents after a kill -9)
    code = ("import subprocess, sys, time; c = subprocess.Popen(['sleep', '600'], start_new_session=True); "
            "print(c.pid, flush=True); time.sleep(600)")
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    orphan = int(driver.stdout.readline())
    watcher = reaper.start(driver.pid)
    try:
        time.sleep(2 * reaper.POLL_S + 0.5)  # the watcher has noted the child
        driver.kill()
        driver.wait()
        watcher.wait(timeout=60)  # it exits once it has ended the leftovers
        assert _gone(orphan)
    finally:
        with contextlib.suppress(OSError):
            os.kill(orphan, signal.SIGKILL)
        reaper._watchers.pop(driver.pid, None)
