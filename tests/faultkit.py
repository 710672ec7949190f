"""Helpers of the fault tests: the CLI in-process, a tiny run, a small tmpfs."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fedsap_ray.cli import main
from fedsap_ray.config import build_config
from fedsap_ray.experiment import run_experiment
from fedsap_ray.persist import checkpoint
from fedsap_ray.common.messages import ClientPlan, ClientResult
from fedsap_ray.runtime.local import LocalBackend
from fedsap_ray.run.session import RunSession

# clients of 1% of their domain (40 samples; 14 of UCI digits), not 2%: each still trains up to three steps of 16,
# and each round's deployed models calibrate their BN statistics on half as many samples
TINY = ["algorithm.name=fedavg", "data.num_clients=4", "data.client_fraction=0.01", "data.max_test_per_domain=40",
        "model.width_mult=0.0625", "training.local_epochs=1", "training.batch_size=16", "training.max_steps_per_epoch=3",
        "training.rounds=3"]


def cli(capsys, *args: str) -> tuple[int, list[str]]:
    """``fedsap-ray ARGS`` in this process: (exit code, non-empty stderr lines)."""
    rc = main(list(args))
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.strip()]


def cli_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``fedsap_ray.cli.main(ARGS)`` in this process, as a CompletedProcess: the exit code a subprocess would
    give (argparse's ``SystemExit`` included), its captured stdout and stderr."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["fedsap-ray", *args], code, out.out, out.err)


def tiny_run(out: Path, run_id: str, *extra: str, stop_after: int | None = None, **kw):
    """A tiny run (3 rounds); ``stop_after``: interrupted (like Ctrl-C) after that round."""
    cfg = build_config(preset="smoke", overrides=[*TINY, *extra])

    def stop(summary):
        if summary.round == stop_after:
            raise KeyboardInterrupt

    if stop_after is None:
        return run_experiment(cfg, out, run_id=run_id, **kw)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out, run_id=run_id, progress=stop, **kw)
    return None


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and (p.name.endswith(".tmp") or ".tmp" in p.suffixes)]


def runs_row(out: Path, run_id: str) -> dict:
    return pq.read_table(out / "runs" / f"{run_id}.parquet").to_pylist()[0]


@contextlib.contextmanager
def tmpfs(where: Path, options: str):
    """A tmpfs mounted at ``where`` (skips the test, with the reason, where mounting is not permitted)."""
    where.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here; the test needs a small tmpfs")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip() or r.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def sets(overrides: list[str]) -> list[str]:
    """``--set`` arguments for ``overrides``."""
    return [a for o in overrides for a in ("--set", o)]


def kill_once_checkpointed(out: Path, run_id: str, overrides: list[str], rounds: int, log: Path) -> tuple[int, int]:
    """``fedsap-ray run`` (smoke preset, ``overrides``) in a subprocess, killed with SIGKILL once its checkpoint holds
    round ``rounds`` (or after 300 s, or when it ended): (the checkpoint's round when killed, the return code)."""
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "fedsap_ray", "run", "--preset", "smoke", "--quiet", "--out",
                                 str(out), "--run-id", run_id, *sets(overrides)], stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline, done = time.time() + 300, 0
            while done < rounds and time.time() < deadline and proc.poll() is None:
                time.sleep(0.02)
                try:
                    done = checkpoint.load(out, run_id)["state"].round
                except (FileNotFoundError, OSError, ValueError):  # not written yet
                    pass
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=60)
    return done, proc.returncode


class Recording:
    """The local backend, keeping every ``train`` call's plans and results."""

    name = "local"

    def __init__(self) -> None:
        self.inner = LocalBackend("cpu", num_workers=1)
        self.calls: list[tuple[dict[int, ClientPlan], list[ClientResult]]] = []

    @property
    def plans(self) -> list[ClientPlan]:
        """Every plan sent, in the order sent."""
        return [p for plans, _ in self.calls for p in plans.values()]

    def start(self, ctx) -> None:
        self.inner.start(ctx)

    def train(self, plans: dict[int, ClientPlan]) -> list[ClientResult]:
        out = self.inner.train(plans)
        self.calls.append((dict(plans), list(out)))
        return out

    def close(self) -> None:
        self.inner.close()


def stepped_run(tmp_path: Path, cfg, federation) -> tuple[list, Recording]:
    """Run ``cfg`` in-process round by round (or step by step, asynchronously) on a :class:`Recording` backend:
    the server state after each (index 0: before the first) and the backend's calls."""
    backend = Recording()
    session = RunSession(cfg, tmp_path, "r", backend=backend, federation=federation)
    session.start()
    states = [session.state]
    for t in range(1, cfg.training.rounds + 1):
        session.step(t)
        states.append(session.state)
    session.finish("finished")
    return states, backend
