"""Asynchronous training on the simulated clock (issue 44, fedsap_ray.engine.asyncmode) in motion: a slow client's
update arrives after the fast ones and is applied with its hand-computed staleness weight (the parameters
move by exactly server_lr x weight x its delta), one server step per buffer_size arrivals in simulated-time
order, every client trains on the version of the moment it started, the mode with equal devices equals the
synchronous round, and the config refuses what the mode does not support, by name. DapperFL, whose client
chooses the coordinates it uploads, is applied on those (ClientResult.mask), divided by every buffered client's
samples as its reconstruction does."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from fedsap_ray import results
from fedsap_ray.algorithms.dapperfl import MASK_KEY
from fedsap_ray.engine.asyncmode import crossed
from fedsap_ray.config import build_config
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.experiment import run_experiment
from fedsap_ray.algorithms.staleness import staleness_weight
from tests.conftest import federation_fixture, steady, tiny_overrides
from tests.faultkit import stepped_run

# every client has capacity 1 and trains one batch of 16 samples: equal train_macs and bytes, so equal devices
# give equal simulated times; fast links, so a trace's speed decides the time
TINY = tiny_overrides("fedavg", "algorithm.width=full", "data.num_clients=6", "training.eval_deployed=false",
                      "capacity.scheme=full", "training.max_steps_per_epoch=1", "devices.down_bytes_s=1e6")
fed = federation_fixture(TINY)
# HeteroFL on cyclic capacities: sub-models of different widths on devices of different speeds
HETERO = tiny_overrides("heterofl", "data.num_clients=6", "training.eval_deployed=false")
fed_cyclic = federation_fixture(HETERO, name="fed_cyclic")
# DapperFL: every client keeps 0.6 of each layer (one pruning ratio) and runs one batch of 16 per epoch, two epochs:
# equal train_macs and bytes as in TINY, but a pruned upload (ClientResult.mask) under a full-model plan (mask None)
DAPPER = tiny_overrides("dapperfl", "data.num_clients=6", "capacity.pruning_ratios=[0.4]", "training.local_epochs=2",
                        "training.max_steps_per_epoch=1", "devices.down_bytes_s=1e6")
fed_dapper = federation_fixture(DAPPER, name="fed_dapper")
ASYNC_COLUMNS = {"rounds": ["updates_applied", "staleness_mean", "staleness_max"],
                 "clients": ["version_trained", "version_applied", "staleness", "sim_arrival_s", "staleness_weight"]}


def _session(tmp_path, fed, *extra, base=TINY):
    """Run ``base + extra`` step by step in-process: (states by version, the backend's calls, the tables)."""
    states, backend = stepped_run(tmp_path, build_config(preset="smoke", overrides=[*base, *extra]), fed)
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


@pytest.mark.parametrize("full_first", ["false", "true"])
def test_a_stale_dapperfl_update_moves_its_uploaded_coordinates_by_its_weighted_delta(tmp_path, fed_dapper, full_first):
    # the schedule of the FedAvg case above (client 0 2.5x slower, FedAsync): client 0 trains on version 0 and is
    # applied to version 10. DapperFL's plan sends the full model (mask None) and the client uploads its pruned model
    # (ClientResult.mask, chosen by its hook): the delta is taken there, from what it downloaded, x_0
    trace = _trace(tmp_path, [0.4e9] + [1e9] * 5)
    states, calls, res = _session(tmp_path / "run", fed_dapper, f"devices.trace={trace}", "devices.mode=async",
                                  "asynchronous.concurrency=6", "asynchronous.buffer_size=1",
                                  "asynchronous.staleness=polynomial", "asynchronous.staleness_a=0.5",
                                  "asynchronous.server_lr=0.8", "training.rounds=11", "training.eval_every=100",
                                  base=[*DAPPER, f"algorithm.full_first_epoch={full_first}"])
    slow = res.clients.set_index("round").loc[11]
    assert (slow.client_id, slow.version_trained, slow.version_applied, slow.staleness) == (0, 0, 10, 10)
    weight = (1 + 10) ** -0.5
    assert slow.staleness_weight == pytest.approx(weight, rel=1e-15)
    ((plan, r0),) = [(plans[0], r) for plans, out in calls for r in out if r.client_id == 0]
    m = r0.mask
    assert plan.mask is None and m is not None and 0 < m.sum() < m.size  # a pruned upload of a full download
    # by hand: x_11 = x_10 + 0.8 s(10) (y_0 - x_0) on client 0's uploaded coordinates, x_10 on the others
    x0, x10 = states[0].params, states[10].params
    expected = x10.copy()
    expected[m] = (x10[m].astype(np.float64)
                   + 0.8 * weight * (r0.values.astype(np.float64) - x0[m].astype(np.float64))).astype(np.float32)
    np.testing.assert_array_equal(states[11].params, expected)
    assert (states[11].params[m] != x10[m]).mean() > 0.5
    # its deployed model is the channels it kept, recorded when its update was applied
    np.testing.assert_array_equal(states[11].strategy_state["kept"][0], r0.stats[MASK_KEY])
    assert 0 not in states[10].strategy_state["kept"]


def test_a_dapperfl_step_divides_by_every_buffered_clients_samples(tmp_path, fed_cyclic):
    """DapperFL's reconstruction refills what a client pruned from the current model, so a step is
    x_t = x_{t-1} + eta sum_i n_i s(tau_i) M_i (y_i - x_{v_i}) / sum_i n_i over the buffer (step 7 with the current
    model as W^{t-1}), not the coordinate-wise mean of the other methods; checked on every step of a run where
    clients with different capacities (HETERO's cyclic capacities) and stalenesses share a buffer."""
    states, calls, res = _session(tmp_path, fed_cyclic, "devices.mode=async", "asynchronous.concurrency=4",
                                  "asynchronous.buffer_size=2", "asynchronous.staleness=polynomial",
                                  "asynchronous.server_lr=0.8", "training.rounds=6", "training.eval_every=100",
                                  base=[*HETERO, "algorithm.name=dapperfl", "training.local_epochs=2"])
    trained = {(r.client_id, r.round - 1): r for _, out in calls for r in out}
    c = res.clients
    assert c["staleness"].max() > 0 and (c.groupby("round").size() == 2).all()
    gap = 0.0
    for t, rows in c.groupby("round"):
        x = states[t - 1].params.astype(np.float64)
        step, n, covered = np.zeros_like(x), 0.0, np.zeros_like(x)
        for row in rows.itertuples():
            r = trained[(row.client_id, row.version_trained)]
            delta = np.zeros_like(x)
            delta[r.mask] = r.values.astype(np.float64) - states[row.version_trained].params[r.mask]
            step += r.n_samples * 0.8 * row.staleness_weight * delta
            n += r.n_samples
            covered += r.n_samples * r.mask
        np.testing.assert_allclose(states[t].params, x + step / n, rtol=1e-6, atol=1e-7)
        coordinatewise = x + np.divide(step, covered, out=np.zeros_like(x), where=covered > 0)
        gap = max(gap, float(np.abs(coordinatewise - (x + step / n)).max()))
    assert gap > 1e-3  # the buffered masks differ, so the two rules are told apart


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


@pytest.mark.parametrize("base, federation", [
    (TINY, "fed"),
    ([*DAPPER, "algorithm.full_first_epoch=false"], "fed_dapper"),  # DapperFL's within-capacity reading
    ([*DAPPER, "algorithm.full_first_epoch=true"], "fed_dapper"),  # the paper's: masks chosen after epoch 1
], ids=["fedavg", "dapperfl-within-capacity", "dapperfl-full-first-epoch"])
def test_with_equal_devices_the_async_mode_is_the_synchronous_round(tmp_path, request, base, federation):
    # equal times, concurrency = a round's clients (participation 0.5 of 6), buffer_size = concurrency (the
    # defaults): every step applies exactly the round's clients, fresh, on the same seeds
    fed = request.getfixturevalue(federation)
    base = [*base, "training.rounds=3", "training.participation=0.5"]
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


def test_evaluation_every_t_simulated_seconds_is_at_the_steps_that_cross_its_multiples(tmp_path, fed):
    # irregular steps: six devices of different speeds, four in flight, a step per arrival; t = 0.02 s is about
    # a step's time, so some steps pass no multiple of t and some pass two (checked below, so the case is there)
    trace = _trace(tmp_path, [0.4e9, 0.7e9, 1e9, 1.3e9, 0.55e9, 0.9e9])
    common = [f"devices.trace={trace}", "devices.mode=async", "asynchronous.concurrency=4", "asynchronous.buffer_size=1",
              "training.rounds=12", "training.eval_deployed=true"]
    every, every_calls, every_res = _session(tmp_path / "every", fed, *common)  # every step evaluated
    t = 0.02
    timed, timed_calls, res = _session(tmp_path / "timed", fed, *common, f"asynchronous.eval_every_s={t}",
                                       "training.deployed_every=2")
    rows = res.rounds.set_index("round")
    elapsed = rows["sim_elapsed_s"].groupby(level=0).first()

    def first_steps(period):  # by hand: the first step whose recorded time reaches each multiple of the period
        return {int(elapsed[elapsed >= k * period].index.min())
                for k in range(1, int(elapsed.iloc[-1] / period) + 1)} | {12}

    evaluated = set(rows.index[rows["evaluated"]])
    assert evaluated == first_steps(t)
    assert set(rows.index[rows["eval_mode"] == "deployed"]) == first_steps(2 * t)  # deployed_every counts periods
    before = np.concatenate([[0.0], elapsed.to_numpy()[:-1]])
    passed = np.floor(elapsed.to_numpy() / t) - np.floor(before / t)  # multiples of t each step passes
    assert (passed == 0).any() and (passed >= 2).any() and 12 in evaluated
    assert not rows.loc[~rows["evaluated"], "accuracy"].notna().any()
    # evaluating never changes training: the same models, clients rows and step times as evaluating every step
    for a, b in zip(every, timed):
        np.testing.assert_array_equal(a.params, b.params)
    pd.testing.assert_frame_equal(steady(every_res.clients), steady(res.clients))
    steps = ["sim_elapsed_s", "sim_round_s", "train_loss", "updates_applied", "staleness_mean", "n_clients"]
    pd.testing.assert_frame_equal(every_res.rounds.drop_duplicates("round")[steps].reset_index(drop=True),
                                  res.rounds.drop_duplicates("round")[steps].reset_index(drop=True))
    # ... and an evaluated step reads the model every step's evaluation read
    keys = ["round", "eval_mode", "domain"]
    both = res.rounds[res.rounds["evaluated"]].merge(every_res.rounds, on=keys, suffixes=("", "_every"))
    assert len(both) == res.rounds["evaluated"].sum()
    np.testing.assert_array_equal(both["accuracy"], both["accuracy_every"])


def test_a_step_is_due_when_it_reaches_or_passes_a_multiple_once():
    assert crossed(0.0, 0.5, 0.5) and crossed(0.4, 0.6, 0.5)  # reaching the multiple counts, as passing it
    assert not crossed(0.5, 0.9, 0.5) and not crossed(0.0, 0.49, 0.5)  # 0.5 was counted by the step that reached it
    assert crossed(0.1, 1.7, 0.5)  # three multiples in one step: one evaluation (a bool)
    assert crossed(0.6, 1.1, 0.5, per=2) and not crossed(1.1, 1.9, 0.5, per=2)  # per: multiples of 1.0 only


@pytest.mark.parametrize("name", ["fedsap", "scaffold", "hasfl", "moon", "fedspu"])
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
                       ("asynchronous.eval_every_s=0", "asynchronous.eval_every_s"),
                       ("asynchronous.eval_every_s=-5", "asynchronous.eval_every_s"),
                       ("asynchronous.eval_every_s=inf", "asynchronous.eval_every_s"),
                       ("asynchronous.eval_every_s=nan", "asynchronous.eval_every_s"),
                       ("asynchronous.eval_every_s=true", "asynchronous.eval_every_s"),
                       ("asynchronous.eval_every_s=soon", "asynchronous.eval_every_s"),
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
    with pytest.raises(ConfigError, match=r"invalid asynchronous\.eval_every_s=60\.0: read only with devices\.mode=async"):
        build_config(preset="smoke", overrides=["algorithm.name=fedavg", "asynchronous.eval_every_s=60"])
    with pytest.raises(ConfigError, match=r"invalid training\.eval_every=2: is not read with asynchronous\.eval_every_s=60"):
        build_config(preset="smoke", overrides=[*base, "asynchronous.eval_every_s=60", "training.eval_every=2"])
    assert build_config(preset="smoke", overrides=[*base, "asynchronous.eval_every_s=60"]).asynchronous.eval_every_s == 60


def test_synchronous_configs_keep_their_hash():
    """The new field and section leave a synchronous config's hash (its run ids, the golden check) unchanged:
    the values were computed with the code before issue 44."""
    assert build_config(preset="smoke").config_hash() == "670e427f2acd"
    assert build_config(preset="smoke", overrides=["devices.policy=deadline", "devices.deadline_s=2.0"]
                        ).config_hash() == "b06ae037dd8c"
    assert build_config(preset="smoke", overrides=["devices.jitter=0.5"]).config_hash() == "af536ddb1fb5"


def test_asynchronous_configs_keep_their_hash_without_eval_every_s():
    """asynchronous.eval_every_s left null keeps an asynchronous run's id (values from the code before the field)."""
    async_ = ["algorithm.name=heterofl", "devices.mode=async"]
    assert build_config(preset="smoke", overrides=async_).config_hash() == "e565167ea979"
    assert build_config(preset="smoke", overrides=[*async_, "asynchronous.buffer_size=2", "asynchronous.concurrency=4"]
                        ).config_hash() == "226b0ab8f8e1"
    assert build_config(preset="smoke", overrides=[*async_, "asynchronous.eval_every_s=60"]).config_hash() != "e565167ea979"


def test_staleness_rules_are_fedasyncs():
    assert staleness_weight("constant", 7) == 1.0
    assert staleness_weight("polynomial", 3, 0.5) == pytest.approx(0.5)
    assert staleness_weight("polynomial", 0) == 1.0
    assert staleness_weight("hinge", 4, 10.0, 4.0) == 1.0
    assert staleness_weight("hinge", 6, 10.0, 4.0) == pytest.approx(1 / 21)
    assert staleness_weight("hinge", 6) == pytest.approx(1 / 21)  # FedAsync's a = 10, b = 4

