"""Asynchronous training on the simulated clock (issue 44, fedsap_ray.asyncmode) in motion: a slow client's
update arrives after the fast ones and is applied with its hand-computed staleness weight (the parameters
move by exactly server_lr x weight x its delta), one server step per buffer_size arrivals in simulated-time
order, every client trains on the version of the moment it started, the mode with equal devices equals the
synchronous round, and the config refuses what the mode does not support, by name."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.errors import ConfigError
from fedsap_ray.experiment import run_experiment
from fedsap_ray.messages import ClientPlan, ClientResult
from fedsap_ray.runtime.local import LocalBackend
from fedsap_ray.session import RunSession
from fedsap_ray.staleness import staleness_weight
from tests.conftest import federation_fixture, steady, tiny_overrides

# every client has capacity 1 and trains one batch of 16 samples: equal train_macs and bytes, so equal devices
# give equal simulated times; fast links, so a trace's speed decides the time
TINY = tiny_overrides("fedavg", "algorithm.width=full", "data.num_clients=6", "training.eval_deployed=false",
                      "capacity.scheme=full", "training.max_steps_per_epoch=1", "devices.down_bytes_s=1e6")
fed = federation_fixture(TINY)
# HeteroFL on cyclic capacities: sub-models of different widths on devices of different speeds
HETERO = tiny_overrides("heterofl", "data.num_clients=6", "training.eval_deployed=false")
fed_cyclic = federation_fixture(HETERO, name="fed_cyclic")
ASYNC_COLUMNS = {"rounds": ["updates_applied", "staleness_mean", "staleness_max"],
                 "clients": ["version_trained", "version_applied", "staleness", "sim_arrival_s", "staleness_weight"]}


class Recording:
    """The local backend, keeping every ``train`` call's plans and results."""

    name = "local"

    def __init__(self) -> None:
        self.inner = LocalBackend("cpu", num_workers=1)
        self.calls: list[tuple[dict[int, ClientPlan], list[ClientResult]]] = []

    def start(self, ctx) -> None:
        self.inner.start(ctx)

    def train(self, plans: dict[int, ClientPlan]) -> list[ClientResult]:
        out = self.inner.train(plans)
        self.calls.append((dict(plans), list(out)))
        return out

    def close(self) -> None:
        self.inner.close()


def _session(tmp_path, fed, *extra, base=TINY):
    """Run ``base + extra`` step by step in-process: (states by version, the backend's calls, the tables)."""
    cfg = build_config(preset="smoke", overrides=[*base, *extra])
    backend = Recording()
    session = RunSession(cfg, tmp_path, "r", backend=backend, federation=fed)
    session.start()
    states = [session.state]
    for t in range(1, cfg.training.rounds + 1):
        session.step(t)
        states.append(session.state)
    session.finish("finished")
    return states, backend.calls, results.load(tmp_path)


def _trace(tmp_path, speeds) -> str:
    path = tmp_path / "trace.csv"
    pd.DataFrame({"client_id": range(len(speeds)), "speed": speeds, "down_bytes_s": 1e12,
                  "up_bytes_s": 1e12}).to_csv(path, index=False)
    return str(path)


def test_a_slow_clients_update_arrives_last_and_moves_the_model_by_its_staleness_weight(tmp_path, fed):
    # client 0 takes 2.5x as long as the others; all six start at time 0 on version 0 (concurrency 6) and every
    # arrival is a step (buffer_size 1, FedAsync): the five fast ones arrive together at d (ties by client id:
    # steps 1-5, staleness 0..4), restart on version 5, arrive at 2d (steps 6-10), restart; client 0 arrives at
    # 2.5d, step 11, trained on version 0 and applied to version 10: staleness 10
    trace = _trace(tmp_path, [0.4e9] + [1e9] * 5)
    states, calls, res = _session(tmp_path / "run", fed, f"devices.trace={trace}", "devices.mode=async",
                                  "asynchronous.concurrency=6", "asynchronous.buffer_size=1",
                                  "asynchronous.staleness=polynomial", "asynchronous.staleness_a=0.5",
                                  "asynchronous.server_lr=0.8", "training.rounds=11", "training.eval_every=100")
    c = res.clients.set_index("round")
    assert list(c.loc[1:5, "client_id"]) == [1, 2, 3, 4, 5] and list(c.loc[1:5, "staleness"]) == [0, 1, 2, 3, 4]
    assert list(c.loc[6:10, "client_id"]) == [1, 2, 3, 4, 5] and list(c.loc[6:10, "version_trained"]) == [5] * 5
    slow = c.loc[11]
    assert (slow.client_id, slow.version_trained, slow.version_applied, slow.staleness) == (0, 0, 10, 10)
    weight = (1 + 10) ** -0.5  # FedAsync's polynomial rule, a = 0.5
    assert slow.staleness_weight == pytest.approx(weight, rel=1e-15)
    assert slow.sim_arrival_s > c.loc[1:10, "sim_arrival_s"].max()
    assert slow.sim_time_s == pytest.approx(2.5 * c.loc[1, "sim_time_s"], rel=1e-4)  # the bytes' time, 1e-5 of it, is equal
    np.testing.assert_allclose(c.loc[1:5, "staleness_weight"], [(1 + s) ** -0.5 for s in range(5)], rtol=1e-15)
    # the step: x_11 = x_10 + server_lr x s(10) x (y_0 - x_0), on every coordinate (the full model)
    (y0,) = [r.values for plans, out in calls for r in out if r.client_id == 0]
    x0, x10 = states[0].params, states[10].params
    expected = (x10.astype(np.float64) + 0.8 * weight * (y0.astype(np.float64) - x0.astype(np.float64))).astype(np.float32)
    np.testing.assert_array_equal(states[11].params, expected)


def test_one_step_per_buffer_of_arrivals_in_time_order_each_on_the_version_it_started_from(tmp_path, fed_cyclic):
    states, calls, res = _session(tmp_path, fed_cyclic, "devices.mode=async", "asynchronous.concurrency=4",
                                  "asynchronous.buffer_size=2", "asynchronous.staleness=hinge",
                                  "asynchronous.staleness_a=2", "asynchronous.staleness_b=1", "training.rounds=6",
                                  "training.eval_every=3", base=HETERO)
    c, r = res.clients, res.rounds.drop_duplicates("round").set_index("round")
    assert (c.groupby("round").size() == 2).all() and (r["updates_applied"] == 2).all()
    assert not c["straggler"].any()
    # the step is taken at its second arrival; every arrival of step t comes after step t - 1
    arrival = c.groupby("round")["sim_arrival_s"]
    np.testing.assert_array_equal(arrival.max().to_numpy(), r["sim_elapsed_s"].to_numpy())
    assert (arrival.min().to_numpy()[1:] >= r["sim_elapsed_s"].to_numpy()[:-1]).all()
    assert c.sort_values(["round", "sim_arrival_s"])["sim_arrival_s"].is_monotonic_increasing
    assert (c["version_applied"] == c["round"] - 1).all()
    assert (c["staleness"] == c["version_applied"] - c["version_trained"]).all()
    np.testing.assert_allclose(c["staleness_weight"], [staleness_weight("hinge", int(s), 2.0, 1.0) for s in c["staleness"]])
    assert (r["staleness_mean"] == c.groupby("round")["staleness"].mean()).all()
    # every plan carries the model of the version it was started on (its round - 1), at its covered coordinates
    started = 0
    for plans, _ in calls:
        for plan in plans.values():
            x = states[plan.round - 1].params
            np.testing.assert_array_equal(plan.values, x if plan.mask is None else x[plan.mask])
            started += 1
    assert started >= 12 and len({plan.round for plans, _ in calls for plan in plans.values()}) > 1
    # the table says the same: the version a client trained on is its plan's round - 1
    trained = {(cid, plan.round - 1) for plans, _ in calls for cid, plan in plans.items()}
    assert {(int(a), int(b)) for a, b in zip(c["client_id"], c["version_trained"])} <= trained
    assert c["capacity_used"].nunique() > 1  # sub-models of several widths took part


def test_with_equal_devices_the_async_mode_is_the_synchronous_round(tmp_path, fed):
    # equal times, concurrency = a round's clients (participation 0.5 of 6), buffer_size = concurrency (the
    # defaults): every step applies exactly the round's clients, fresh, on the same seeds
    base = [*TINY, "training.rounds=3", "training.participation=0.5"]
    tables = []
    for name, extra in (("sync", []), ("async", ["devices.mode=async"])):
        cfg = build_config(preset="smoke", overrides=[*base, *extra])
        run_experiment(cfg, tmp_path / name, run_id="r", federation=fed)
        tables.append(results.load(tmp_path / name))
    sync, asyn = tables
    assert (asyn.clients["staleness"] == 0).all() and (asyn.rounds["updates_applied"] == 3).all()
    for table in ("rounds", "clients"):
        s, a = steady(getattr(sync, table)), steady(getattr(asyn, table))
        assert s[ASYNC_COLUMNS[table]].isna().all().all()  # a synchronous run leaves them null
        s, a = s.drop(columns=ASYNC_COLUMNS[table]), a.drop(columns=ASYNC_COLUMNS[table])
        if table == "rounds":  # differences of the simulated clock: the round's time to float rounding
            np.testing.assert_allclose(a.pop("sim_round_s"), s.pop("sim_round_s"), rtol=1e-12)
        pd.testing.assert_frame_equal(s.drop(columns="run_id"), a.drop(columns="run_id"))


def test_a_too_stale_update_is_discarded_and_not_counted_in_the_buffer(tmp_path, fed):
    trace = _trace(tmp_path, [0.4e9] + [1e9] * 5)
    _, _, res = _session(tmp_path / "run", fed, f"devices.trace={trace}", "devices.mode=async",
                         "asynchronous.concurrency=6", "asynchronous.buffer_size=1", "asynchronous.max_staleness=3",
                         "training.rounds=11", "training.eval_every=100")
    c = res.clients
    late = c[c["straggler"]]
    # clients 5 (staleness 4 at step 5's instant) and 0 (staleness 10) are staler than 3: discarded
    assert set(late["client_id"]) == {0, 5} and late["version_applied"].isna().all()
    assert late["staleness_weight"].isna().all() and (late["staleness"] > 3).all()
    r = res.rounds.drop_duplicates("round")
    assert (r["updates_applied"] == 1).all()  # a discarded arrival is no step
    assert r["n_stragglers"].sum() == len(late)


@pytest.mark.parametrize("name", ["fedsap", "scaffold", "hasfl", "moon", "dapperfl", "fedspu"])
def test_strategies_with_round_synchronous_state_are_refused_by_name(name):
    with pytest.raises(ConfigError, match=rf"invalid algorithm\.name='?{name}'?: devices\.mode=async does not support "
                                          rf"{name}: .*supported: .*heterofl"):
        build_config(preset="smoke", overrides=[f"algorithm.name={name}", "devices.mode=async"])


def test_async_settings_are_checked_and_named():
    base = ["algorithm.name=fedavg", "devices.mode=async"]
    for bad, field in [("asynchronous.buffer_size=0", "asynchronous.buffer_size"),
                       ("asynchronous.concurrency=11", "asynchronous.concurrency"),  # the smoke preset has 10 clients
                       ("asynchronous.buffer_size=11", "asynchronous.buffer_size"),
                       ("asynchronous.staleness=linear", "asynchronous.staleness"),
                       ("asynchronous.staleness_a=0", "asynchronous.staleness_a"),
                       ("asynchronous.server_lr=-1", "asynchronous.server_lr"),
                       ("asynchronous.max_staleness=-1", "asynchronous.max_staleness"),
                       ("devices.policy=over_select", "devices.policy"),
                       ("algorithm.selection=afd", "algorithm.name")]:
        overrides = [*base, bad] if "selection" not in bad else ["algorithm.name=feddrop", "devices.mode=async", bad]
        with pytest.raises(ConfigError, match=re.escape(f"invalid {field}=")):
            build_config(preset="smoke", overrides=overrides)
    with pytest.raises(ConfigError, match=r"invalid devices\.mode='bsp': allowed values are sync, async"):
        build_config(preset="smoke", overrides=["devices.mode=bsp"])
    with pytest.raises(ConfigError, match=r"invalid asynchronous\.buffer_size=2: read only with devices\.mode=async"):
        build_config(preset="smoke", overrides=["algorithm.name=fedavg", "asynchronous.buffer_size=2"])
    build_config(preset="smoke", overrides=["algorithm.name=feddrop", "devices.mode=async"])  # plain FD is supported


def test_synchronous_configs_keep_their_hash():
    """The new field and section leave a synchronous config's hash (its run ids, the golden check) unchanged:
    the values were computed with the code before issue 44."""
    assert build_config(preset="smoke").config_hash() == "670e427f2acd"
    assert build_config(preset="smoke", overrides=["devices.policy=deadline", "devices.deadline_s=2.0"]
                        ).config_hash() == "b06ae037dd8c"
    assert build_config(preset="smoke", overrides=["devices.jitter=0.5"]).config_hash() == "af536ddb1fb5"


def test_staleness_rules_are_fedasyncs():
    assert staleness_weight("constant", 7) == 1.0
    assert staleness_weight("polynomial", 3, 0.5) == pytest.approx(0.5)
    assert staleness_weight("polynomial", 0) == 1.0
    assert staleness_weight("hinge", 4, 10.0, 4.0) == 1.0
    assert staleness_weight("hinge", 6, 10.0, 4.0) == pytest.approx(1 / 21)
    assert staleness_weight("hinge", 6) == pytest.approx(1 / 21)  # FedAsync's a = 10, b = 4

