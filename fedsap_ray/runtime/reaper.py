"""Ends what a local Ray leaves behind when the process that started it dies without shutting it down.

``ray.init()`` without an address starts a local Ray whose GCS, raylet and workers die
with the driver, even on ``kill -9``. Its two per-node agents (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``, children of the raylet) do notice the raylet's death within
about 2 s, but then, finding no "SIGTERM" in the raylet's log, publish the error to the
GCS, which is dead too, with a timeout fixed at 60 s in Ray
(``ray/_private/process_watcher.py`` -> ``publish_error_to_driver(..., 60)``; no setting
changes it): after a ``kill -9`` of a sweep driver they live on, orphaned, for about a
minute. Nothing inside the killed driver can run, so a small watcher process does it:

``start()`` (called right after a local ``ray.init()``) spawns ``python -m
fedsap_ray.runtime.reaper <driver pid>`` in its own session (a ``killpg`` of the driver's
group does not take it along). It notes the driver's descendants once a second; when the
driver is gone it gives them a short grace period to exit on their own, then SIGKILLs
those still alive (matched by pid and start time, so a reused pid is never hit) and exits.
Linux only (``/proc``); elsewhere ``start()`` does nothing. No Ray import here.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 1.0  # how often the driver's descendants are noted
GRACE_S = 3.0  # after the driver's death: time for Ray's own fate-sharing before the SIGKILLs

_watchers: dict[int, subprocess.Popen] = {}  # driver pid -> its watcher (one each, however often Ray restarts)


def start(driver_pid: int | None = None) -> subprocess.Popen | None:
    """Watch ``driver_pid`` (default: this process); None where /proc is missing."""
    pid = driver_pid or os.getpid()
    running = _watchers.get(pid)
    if running is not None and running.poll() is None:
        return running
    if not Path("/proc/self/stat").is_file():
        return None
    _watchers[pid] = subprocess.Popen([sys.executable, "-m", "fedsap_ray.runtime.reaper", str(pid)],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    return _watchers[pid]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, None when it is gone or a zombie."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    if rest[0] == "Z":
        return None
    return int(rest[1]), int(rest[19])


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of ``root``."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                children.setdefault(st[0], []).append((int(entry.name), st[1]))
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if pid not in out:
                out[pid] = started
                todo.append(pid)
    return out


def _alive(pid: int, started: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == started


def watch(driver: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> list[int]:
    """Block until ``driver`` is gone, then end its leftover descendants; return the pids killed."""
    st = _stat(driver)
    if st is None:
        return []
    driver_start, me = st[1], os.getpid()
    known: dict[int, int] = {}
    while _alive(driver, driver_start):
        known = {p: s for p, s in known.items() if _alive(p, s)}
        known.update(descendants(driver))
        known.pop(me, None)
        time.sleep(poll_s)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in known.items()):
        time.sleep(0.2)
    killed = []
    for pid, started in known.items():
        if _alive(pid, started):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:  # gone meanwhile, or not ours to signal
                pass
    return killed


if __name__ == "__main__":  # pragma: no cover - run as a separate process by start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]))
