"""An asynchronous run whose settings make it the synchronous one says so, once (issue 53, fedsap_ray/engine/asyncmode.py):
with every client training every step (concurrency = buffer_size = all clients, participation 1) and server_lr 1,
each step waits for every client's fresh update, whatever the devices' speeds. The note's claim is checked: such a
run on clients of different widths (so different simulated times) writes the synchronous run's tables."""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest

from fedsap_ray import results
from fedsap_ray.engine.asyncmode import RunNote, synchronous_equivalent
from fedsap_ray.config import build_config
from fedsap_ray.experiment import run_experiment
from tests.conftest import federation_fixture, steady, tiny_overrides

# HeteroFL on cyclic capacities: sub-models of different widths on devices of different speeds
BASE = tiny_overrides("heterofl", "data.num_clients=4", "model.name=cnn_small", "data.max_test_per_domain=16",
                      "training.eval_deployed=false", "training.rounds=2", "training.participation=1")
ASYNC_COLUMNS = {"rounds": ["updates_applied", "staleness_mean", "staleness_max"],
                 "clients": ["version_trained", "version_applied", "staleness", "sim_arrival_s", "staleness_weight"]}
fed = federation_fixture(BASE)


@pytest.mark.parametrize("extra, same", [
    ([], True),  # the defaults: concurrency = a round's clients = all of them, buffer = concurrency
    (["asynchronous.concurrency=4", "asynchronous.buffer_size=4", "asynchronous.staleness=polynomial"], True),
    (["training.participation=0.5"], False),  # two of four a step: the others start on a model a step old
    (["asynchronous.buffer_size=2"], False),
    (["asynchronous.concurrency=3"], False),
    (["asynchronous.server_lr=0.5"], False),
    (["devices.availability=0.9"], False),
    (["asynchronous.eval_every_s=1"], False),
])
def test_the_settings_that_make_an_async_run_synchronous(extra, same):
    cfg = build_config(preset="smoke", overrides=[*BASE, "devices.mode=async", *extra])
    note = synchronous_equivalent(cfg)
    assert (note is not None) == same
    if same:
        assert "is the synchronous run" in note and "asynchronous.concurrency" in note and "\n" not in note
    assert synchronous_equivalent(build_config(preset="smoke", overrides=BASE)) is None  # a synchronous run: nothing


def test_such_a_run_says_so_once_and_writes_the_synchronous_tables(tmp_path, fed):
    tables = []
    for name, extra in (("sync", []), ("async", ["devices.mode=async"])):
        cfg = build_config(preset="smoke", overrides=[*BASE, *extra])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_experiment(cfg, tmp_path / name, run_id="r", federation=fed)
        notes = [w for w in caught if issubclass(w.category, RunNote)]
        assert len(notes) == (1 if name == "async" else 0), [str(w.message) for w in notes]
        tables.append(results.load(tmp_path / name))
    sync, asyn = tables
    assert asyn.clients["sim_time_s"].nunique() > 1  # the devices differ: clients arrive at different times
    assert (asyn.clients["staleness"] == 0).all() and (asyn.rounds["updates_applied"] == 4).all()
    for table in ("rounds", "clients"):
        s, a = (steady(getattr(t, table)).drop(columns=[*ASYNC_COLUMNS[table], "run_id"]) for t in (sync, asyn))
        if table == "rounds":  # the simulated clock's arithmetic differs: the round's time to float rounding
            np.testing.assert_allclose(a.pop("sim_round_s"), s.pop("sim_round_s"), rtol=1e-12)
        pd.testing.assert_frame_equal(s, a)
