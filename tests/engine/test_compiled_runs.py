"""resources.compile=train under Inductor (issue 56) on a tiny run: deterministic in its mode (two runs, the same
tables) and within float reordering of the eager run (tolerances below). The first Inductor compile of a process
costs tens of seconds on a loaded 2-core machine, so this module is in the integration tier (tests/conftest.py);
the mechanics (eager, the cache's counts, the fallback, the refusal) are tests/engine/test_compiled.py's."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.engine import compiled
from fedsap_ray.experiment import run_experiment

TINY = ["algorithm.name=fedavg", "data.num_clients=4", "data.client_fraction=0.01", "data.max_test_per_domain=40",
        "model.name=cnn_small", "model.width_mult=0.25", "training.local_epochs=1", "training.batch_size=16",
        "training.max_steps_per_epoch=3", "training.rounds=3"]
VOLATILE = [*results.WALL_CLOCK, "worker", "gpu_id", "node"]
# float reordering inside the network, over 3 rounds of 3 steps: the largest differences seen were ~1e-6
LOSS_ATOL = 1e-4
ACC_ATOL = 1 / 40  # at most one test image of a domain's 40 may flip


def run(tmp_path, fed, mode: str, name: str) -> results.Results:
    cfg = build_config(preset="smoke", overrides=[*TINY, f"resources.compile={mode}", "resources.num_workers=1"])
    run_experiment(cfg, tmp_path / name, run_id="x", federation=fed)
    return results.load(tmp_path / name)


@pytest.fixture(scope="module")
def fed(single_thread):
    return build_federation(build_config(preset="smoke", overrides=TINY))


def frame(table: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    return table.drop(columns=VOLATILE, errors="ignore").sort_values(key).reset_index(drop=True)


def test_compiled_runs_are_deterministic_and_agree_with_eager(tmp_path, fed, monkeypatch):
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(compiled.ENV, raising=False)
    monkeypatch.setattr(compiled, "_FORWARDS", None)
    a, b = run(tmp_path, fed, "train", "a"), run(tmp_path, fed, "train", "b")
    assert compiled.forwards().misses >= 1 and (tmp_path / "cache" / "inductor").is_dir()
    pd.testing.assert_frame_equal(frame(a.rounds, ["round", "domain"]), frame(b.rounds, ["round", "domain"]))
    pd.testing.assert_frame_equal(frame(a.clients, ["round", "client_id"]), frame(b.clients, ["round", "client_id"]))
    eager = run(tmp_path, fed, "off", "eager")
    ra, re_ = frame(a.rounds, ["round", "domain"]), frame(eager.rounds, ["round", "domain"])
    for col in [c for c in ra.columns if c.endswith("loss")]:
        np.testing.assert_allclose(ra[col].astype(float), re_[col].astype(float), rtol=0, atol=LOSS_ATOL, err_msg=col)
    for col in [c for c in ra.columns if c.endswith("acc")]:
        np.testing.assert_allclose(ra[col].astype(float), re_[col].astype(float), rtol=0, atol=ACC_ATOL, err_msg=col)
