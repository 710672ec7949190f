"""Compiled runs are deterministic in their mode (issue 56, item 2): with ``resources.compile`` on, the Ray backend's
tables equal the local backend's (and the eager run's within float reordering), a run killed with SIGKILL and
resumed equals the run never killed, and a method whose client hook cannot be compiled records ``fallback`` and
equals its eager run; all under real Inductor.

One node cache folder for the module (``FEDSAP_RAY_CACHE``, set after the session's Ray started, as a script may
set it after connecting): the first run compiles cold, every later process loads the generated code from there.
The Ray workers and the server actor compile into it because the driver hands them its cache settings
(:func:`fedsap_ray.runtime.ray.adopt_driver_cache`). Integration tier (tests/conftest.py): Inductor's first compile
costs tens of seconds on a loaded 2-core machine."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.engine import compiled
from fedsap_ray.experiment import run_experiment
from tests.conftest import start_session_ray
from faultkit import kill_once_checkpointed

pytest.importorskip("ray")

TINY = ["algorithm.name=fedavg", "data.num_clients=4", "data.client_fraction=0.01", "data.max_test_per_domain=40",
        "model.name=cnn_small", "model.width_mult=0.25", "training.local_epochs=1", "training.batch_size=16",
        "training.max_steps_per_epoch=3", "training.rounds=3"]
PLACEMENT = ["worker", "gpu_id", "node"]  # where a client ran, not what it computed
COMPILED = {"hit", "miss"}
# against eager, 3 rounds of 3 steps: float reordering inside the network; the largest differences seen were ~1e-6
LOSS_ATOL = 1e-4
ACC_ATOL = 1 / 40  # at most one test image of a domain's 40 may flip

# the session's local Ray (tests/conftest.py), started before the module's cache folder is set: its raylet's
# environment does not name that folder, so only the driver's hand-over puts the actors' compiles there
pytestmark = pytest.mark.usefixtures("session_ray")


@pytest.fixture(scope="module")
def node_cache(_session_ray_owner, tmp_path_factory):
    """The module's node cache folder (``FEDSAP_RAY_CACHE``), a fresh process-wide compile cache, restored after;
    set once the session's Ray runs."""
    start_session_ray()
    folder = tmp_path_factory.mktemp("node")
    saved = {name: os.environ.get(name) for name in compiled.CACHE_VARS}
    forwards = compiled._FORWARDS
    os.environ.pop(compiled.ENV, None)
    os.environ["FEDSAP_RAY_CACHE"] = str(folder)
    compiled._FORWARDS = None
    yield folder
    compiled._FORWARDS = forwards
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def fed(single_thread):
    return build_federation(build_config(preset="smoke", overrides=TINY))


def run(out, fed, *extra: str) -> results.Results:
    cfg = build_config(preset="smoke", overrides=[*TINY, *extra])
    assert run_experiment(cfg, out, run_id="r", federation=fed).status == "finished"
    return results.load(out)


def frame(table: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    return table.drop(columns=[*results.WALL_CLOCK, *PLACEMENT], errors="ignore").sort_values(key).reset_index(drop=True)


def same(a: results.Results, b: results.Results) -> None:
    """Every column of rounds and clients equal but the wall-clock ones (results.WALL_CLOCK: ``clients.compile``
    and ``rounds.eval_compiles`` among them, checked by the tests themselves) and the placement."""
    for table, key in (("rounds", ["round", "domain"]), ("clients", ["round", "client_id"])):
        pd.testing.assert_frame_equal(frame(getattr(a, table), key), frame(getattr(b, table), key))


def test_ray_workers_compile_into_the_node_cache_and_equal_the_local_backend(tmp_path, node_cache, fed):
    """``train+eval`` (training's forwards on the workers, evaluation's on the server actor; ``train`` is the
    SIGKILL test's): two Ray workers give the local backend's tables, every client compiled."""
    ray_run = run(tmp_path / "ray", fed, "resources.compile=train+eval", "resources.backend=ray",
                  "resources.num_workers=2", "resources.cpus_per_worker=0.5")
    # the module's first compiles are the actors': the folder holds their code only if they were handed it
    folder = node_cache / "inductor"
    assert folder.is_dir() and any(folder.iterdir()), "the Ray actors did not compile into the driver's node cache"
    local = run(tmp_path / "local", fed, "resources.compile=train+eval")
    same(ray_run, local)
    for res in (ray_run, local):
        assert set(res.clients["compile"]) <= COMPILED and res.rounds["eval_compiles"].notna().all()
    assert "miss" in set(ray_run.clients["compile"])  # a worker's first shape (a new process: compiled or loaded)
    assert ray_run.clients["worker"].nunique() == 2
    # against eager: float reordering inside the network only (docs/guides/performance.md has the whole-run figures)
    eager = frame(run(tmp_path / "eager", fed, "resources.compile=off").rounds, ["round", "domain"])
    comp = frame(local.rounds, ["round", "domain"])
    for col in [c for c in comp.columns if c.endswith("loss")]:
        np.testing.assert_allclose(comp[col].astype(float), eager[col].astype(float), rtol=0, atol=LOSS_ATOL, err_msg=col)
    for col in [c for c in comp.columns if c.endswith("acc") or c.endswith("accuracy")]:
        np.testing.assert_allclose(comp[col].astype(float), eager[col].astype(float), rtol=0, atol=ACC_ATOL, err_msg=col)


def test_a_compiled_run_killed_with_sigkill_and_resumed_equals_the_run_never_killed(tmp_path, node_cache, fed):
    """kill -9 of ``fedsap-ray run`` (compiled) once round 1 is checkpointed, then ``--resume``: every table equals
    an uninterrupted compiled run's, which this process computes (so across processes too)."""
    overrides = [*TINY, "resources.compile=train"]
    cut = tmp_path / "cut"
    done, code = kill_once_checkpointed(cut, "r", overrides, 1, tmp_path / "log")
    assert done >= 1 and code == -signal.SIGKILL, (tmp_path / "log").read_text()[-3000:]
    assert results.load(cut).runs.loc[0, "rounds_done"] < 3  # killed mid-run
    resumed = subprocess.run([sys.executable, "-m", "fedsap_ray", "run", "--quiet", "--out", str(cut), "--resume", "r"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    cut_res, whole = results.load(cut), run(tmp_path / "whole", fed, "resources.compile=train")
    assert cut_res.runs.loc[0, "status"] == "finished"
    assert set(cut_res.clients["compile"]) <= COMPILED  # the resumed rounds compiled too (the mode was kept)
    same(cut_res, whole)


def test_a_hook_that_cannot_be_compiled_falls_back_by_name_and_equals_eager(tmp_path, node_cache, fed):
    """MOON's contrastive term (its ``moon`` hook runs the global and previous models too) does not declare
    ``supports_compile``: its clients train eager, say so in a warning naming the hook and in ``clients.compile``,
    and the run is the eager run's exactly."""
    compiled._WARNED.clear()
    with pytest.warns(UserWarning, match="moon do not support"):
        fallback = run(tmp_path / "compiled", fed, "algorithm.name=moon", "resources.compile=train")
    eager = run(tmp_path / "eager", fed, "algorithm.name=moon", "resources.compile=off")
    assert set(fallback.clients["compile"]) == {"fallback"} and set(eager.clients["compile"]) == {"off"}
    same(fallback, eager)
