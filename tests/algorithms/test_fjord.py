"""FjORD's options: validation, the config hash at their defaults, ``od_sampling=batch`` in whole runs
(synchronous and asynchronous), and ``od_bn=per_width`` in motion (which width's statistics move, the bytes they
cost, resume, the asynchronous mode, the deployed and kept models). Its arithmetic against a reference is
tests/algorithms/test_reference_fjord.py."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from conftest import assert_options_rejected, assert_same_tables, make_strategy, tiny_overrides
from faultkit import cli, sets
from fedsap_ray import results
from fedsap_ray.run import resume
from fedsap_ray.algorithms.fjord import HOOK, STATS_KEY, FjORD, step_sizes, step_widths
from fedsap_ray.engine.asyncmode import AsyncServer, RunNote, Update
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.experiment import run_experiment

TINY = tiny_overrides("fjord", "data.num_clients=4", "training.rounds=2", "training.local_epochs=2",
                      "training.eval_deployed=false")
BATCH = [*TINY, "algorithm.od_sampling=batch"]
# per-width BatchNorm over three tiers (client 2 alone at the lowest), deployed models on the aggregated statistics
PW = [*TINY, "capacity.scheme=explicit", "capacity.keep_ratios=[1.0,0.5,0.25,0.5]", "algorithm.od_bn=per_width",
      "training.eval_deployed=true", "training.deployed_bn=aggregated"]


def test_bad_values_are_refused_naming_the_option():
    assert_options_rejected(TINY, "algorithm.od_sampling=step", "algorithm.od_bn=layer", "algorithm.od_sampling=1")


@pytest.mark.parametrize("value", ["per-width", "layer", "Shared"])
def test_a_bad_od_bn_is_refused_by_name_with_one_line_and_exit_2(tmp_path, capsys, value):
    """The command names the option and its allowed values, and writes nothing."""
    out = tmp_path / "out"
    rc, err = cli(capsys, "run", "--preset", "smoke", "--out", str(out), *sets([*TINY, f"algorithm.od_bn={value}"]))
    assert rc == 2 and len(err) == 1, err
    assert err[0] == f"fedsap-ray: error: invalid algorithm.od_bn='{value}': allowed values are shared, per_width", err
    assert not out.exists()


def test_options_at_their_defaults_keep_the_config_hash():
    """A run that names the defaults is the run it was before the options existed (same hash, same run id prefix);
    ``batch`` and ``per_width`` are other runs."""
    plain = build_config(preset="smoke", overrides=TINY).config_hash()
    named = build_config(preset="smoke", overrides=[*TINY, "algorithm.od_sampling=round", "algorithm.od_bn=shared"])
    assert named.config_hash() == plain
    assert build_config(preset="smoke", overrides=BATCH).config_hash() != plain
    assert build_config(preset="smoke", overrides=[*TINY, "algorithm.od_bn=per_width"]).config_hash() != plain


def test_step_sizes_follow_the_client_loop():
    """13 samples in batches of 4 (the size-1 remainder skipped), at most 2 steps an epoch, 2 epochs."""
    assert step_sizes(13, 4, 2, None) == [4, 4, 4] * 2
    assert step_sizes(13, 4, 2, 2) == [4, 4] * 2
    assert step_sizes(14, 4, 1, None) == [4, 4, 4, 2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, single_thread):
    """Two-round runs of ``batch``: synchronous and asynchronous (FjORD declares an asynchronous reading)."""
    out = tmp_path_factory.mktemp("fjord")
    run_experiment(build_config(preset="smoke", overrides=BATCH), out / "sync", run_id="s")
    run_experiment(build_config(preset="smoke", overrides=[*BATCH, "devices.mode=async", "asynchronous.concurrency=2",
                                                               "asynchronous.buffer_size=2"]), out / "async", run_id="a")
    return results.load(out / "sync"), results.load(out / "async")


@pytest.mark.parametrize("mode", [0, 1], ids=["sync", "async"])
def test_batch_sampling_trains_p_max_and_counts_each_steps_width(runs, mode):
    """Every client trains (and uploads) its p_max sub-model; a client with tiers below p_max spends fewer MACs
    than one forward pass of that sub-model per sample (its steps ran narrower ones), never more; a client at the
    lowest tier has nothing to draw and spends exactly that."""
    res = runs[mode]
    assert (res.runs["status"] == "finished").all()
    c = res.clients
    assert np.allclose(c["capacity_used"], c["capacity_max"])
    seen = c["n_samples"].map(lambda n: sum(step_sizes(int(n), 16, 2, 3)))  # TINY_BASE's batches, 2 epochs
    full = seen * c["macs_per_sample"]
    lowest = c["capacity_max"] == c["capacity_max"].min()
    assert (c["train_macs"] <= full).all()
    assert (c.loc[lowest, "train_macs"] == full[lowest]).all()
    assert (c.loc[~lowest, "train_macs"] < full[~lowest]).any()


# --- od_bn=per_width in motion ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pw_fed(single_thread):
    return build_federation(build_config(preset="smoke", overrides=PW))


def tier_sets(strat: FjORD, state) -> dict[float, np.ndarray]:
    return {p: strat.tier_set(state, p) for p in strat.tiers()}


def ran(strat: FjORD, plan, result) -> set[float]:
    """The widths a client's steps ran: its plan's width, or under ``batch`` the widths its steps drew."""
    if plan.hooks:
        return set(step_widths(plan.payload(HOOK), result.steps))
    return {strat.width_for(None, plan.client_id, plan.round)}


@pytest.mark.parametrize("sampling", ["round", "batch"])
def test_a_widths_statistics_move_only_when_a_client_runs_that_width(pw_fed, sampling):
    """Each client's update aggregated alone changes exactly the statistics of the widths its steps ran (the
    others come back bit for bit: it returns what it received); the plan and the result carry the sets of the tiers
    at or below p_max and count their bytes; after two rounds every narrow width's statistics differ from the
    wider sets' leading channels (what one shared set would hold)."""
    cfg = build_config(preset="smoke", overrides=[*PW, f"algorithm.od_sampling={sampling}"])
    ctx, strat = make_strategy(cfg, pw_fed)
    scratch = copy.deepcopy(ctx.model)
    state = strat.init_state()
    size = {p: 4 * strat.stat_coords(p).size for p in strat.tiers()}
    moved: set[float] = set()
    for t in (1, 2):
        plans = strat.configure_round(state, t)
        res = {c: train_client(plans[c], scratch, ctx.layout, pw_fed.client_data(c)) for c in sorted(plans)}
        for c, r in res.items():
            alone = tier_sets(strat, strat.aggregate(state, plans, [r], t).state)
            before = tier_sets(strat, state)
            changed = {p for p in strat.tiers() if not np.array_equal(alone[p], before[p])}
            assert changed == ran(strat, plans[c], r), (c, changed)
            moved |= changed
            others = sum(size[p] for p in strat.held_tiers(c) if p != strat.width_for(state, c, t))
            if sampling == "batch":
                assert plans[c].side_bytes_down == others and plans[c].side_bytes_up == 0
                assert r.bytes_up == r.values.nbytes + others and (STATS_KEY in r.stats) == (others > 0)
            else:  # the other tiers go and come back unchanged: counted, not sent
                assert plans[c].side_bytes_down == plans[c].side_bytes_up == others and not r.stats
        state = strat.aggregate(state, plans, list(res.values()), t).state
    assert set(strat.tiers()[:-1]) <= moved  # (the widest moves when a p_max-1 client's step draws it)
    for p in strat.tiers()[:-1]:
        assert np.abs(strat.tier_set(state, p) - state.params[strat.stat_coords(p)]).max() > 1e-3


def test_shared_keeps_no_statistics_and_sends_none(pw_fed):
    """``od_bn=shared`` (the default) holds no per-width state and adds no bytes: the run it was before."""
    cfg = build_config(preset="smoke", overrides=[*PW, "algorithm.od_bn=shared", "algorithm.od_sampling=batch"])
    ctx, strat = make_strategy(cfg, pw_fed)
    state = strat.init_state()
    assert state.strategy_state == {}
    plans = strat.configure_round(state, 1)
    assert all(p.params is state.params and p.side_bytes_down == p.side_bytes_up == 0 for p in plans.values())
    assert all(not p.payload(HOOK).bn for p in plans.values() if p.hooks)


def test_a_stale_update_moves_each_width_by_its_scaled_change(pw_fed):
    """Asynchronously, an update trained on version 0 and applied at version 1 moves every width's statistics by
    eta_g s(tau) times its own change (FedBuff's rule, as for the model's coordinates): the width of its plan
    through the values the engine recovered, the narrower ones through the changes its stats carry."""
    cfg = build_config(preset="smoke", overrides=[*PW, "algorithm.od_sampling=batch", "devices.mode=async",
                                                  "asynchronous.concurrency=2", "asynchronous.buffer_size=2",
                                                  "asynchronous.staleness=polynomial", "asynchronous.server_lr=0.8"])
    ctx, strat = make_strategy(cfg, pw_fed)
    scratch = copy.deepcopy(ctx.model)
    s0 = strat.init_state()
    plans = strat.configure_round(s0, 1)
    res = {c: train_client(plans[c], scratch, ctx.layout, pw_fed.client_data(c)) for c in sorted(plans)}
    s1 = strat.aggregate(s0, plans, [res[0], res[2], res[3]], 1).state  # version 1, without client 1
    r, plan = res[1], plans[1]  # p_max 0.5: its values carry 0.5's statistics, its stats 0.25's change
    assert ran(strat, plan, r) == {0.25, 0.5}
    factor = 0.8 * 2 ** -0.5  # server_lr x (1 + staleness 1)^-0.5
    stale = dataclasses.replace(r, values=AsyncServer._recovered(s1, Update(1, 0, 0.0, 1.0, s0.params, plan, r, 1.0),
                                                                  factor))
    new = strat.aggregate(s1, {1: plan}, [stale], 2).state
    coords = np.cumsum(plan.mask)[strat.stat_coords(0.5)] - 1  # 0.5's statistics among the uploaded values
    change = {0.5: r.values[coords] - plan.params[strat.stat_coords(0.5)], 0.25: r.stats[STATS_KEY]}
    for p in (0.25, 0.5):
        assert np.abs(change[p]).max() > 1e-3
        want = strat.tier_set(s1, p).astype(np.float64) + factor * change[p].astype(np.float64)
        np.testing.assert_allclose(strat.tier_set(new, p), want, rtol=0, atol=1e-6)
    assert np.array_equal(strat.tier_set(new, 1.0), strat.tier_set(s1, 1.0))  # nobody reaching 1.0 in the step


@pytest.fixture(scope="module")
def pw_runs(tmp_path_factory, pw_fed):
    """``per_width`` runs of three rounds: ``batch`` keeping its final models, the same asynchronous with every
    client in flight and one step for all (the synchronous round), and ``batch`` with ``shared`` statistics for
    contrast (stale asynchronous updates: the asynchronous resume test's runs)."""
    out = tmp_path_factory.mktemp("fjord_pw")
    three = ["training.rounds=3"]
    run_experiment(build_config(preset="smoke", overrides=[*PW, *three, "algorithm.od_sampling=batch"]), out / "pw",
                   run_id="pw", federation=pw_fed)
    run_experiment(build_config(preset="smoke", overrides=[*PW, *three, "algorithm.od_sampling=batch",
                                                               "algorithm.od_bn=shared"]),
                   out / "sh", run_id="sh", federation=pw_fed)
    with pytest.warns(RunNote, match="is the synchronous run"):
        run_experiment(build_config(preset="smoke", overrides=[*PW, *three, "algorithm.od_sampling=batch",
                                                                   "devices.mode=async", "asynchronous.concurrency=4",
                                                                   "asynchronous.buffer_size=4"]),
                       out / "eq", run_id="eq", federation=pw_fed)
    return out


def test_asynchronous_steps_that_are_synchronous_rounds_give_the_synchronous_figures(pw_runs):
    """Every client in flight and a step for all of them: each update is fresh, so every figure (the deployed
    models' too, which read the narrow widths' statistics) is the synchronous run's, bit for bit."""
    sync, asyn = results.load(pw_runs / "pw"), results.load(pw_runs / "eq")
    key = ["round", "eval_mode", "domain"]
    a, b = (r.rounds.sort_values(key).reset_index(drop=True) for r in (sync, asyn))
    assert (a["eval_mode"] == "deployed").any()
    np.testing.assert_array_equal(a[["accuracy", "loss"]].to_numpy(), b[["accuracy", "loss"]].to_numpy())
    c, d = (r.clients.sort_values(["round", "client_id"]).reset_index(drop=True) for r in (sync, asyn))
    np.testing.assert_array_equal(c["train_loss"].to_numpy(), d["train_loss"].to_numpy())


def test_deployed_and_kept_models_carry_their_widths_statistics(pw_runs):
    """A narrow client's kept deployed model stores its own values (the global weights with its width's statistics:
    the widest client's is the global model itself), and scoring it gives the recorded deployed figure; with one
    shared set every client runs the global values (nothing stored) and the deployed figures differ."""
    dep = json.loads((pw_runs / "pw" / "models" / "pw" / "final.deployed.json").read_text())
    widths = {0: 1.0, 1: 0.5, 2: 0.25, 3: 0.5}
    assert {e["client"]: e["values"] is None for e in dep["clients"]} == {c: p == 1.0 for c, p in widths.items()}
    rows = results.load(pw_runs / "pw").rounds
    rows = rows[(rows.eval_mode == "deployed") & (rows["round"] == 3) & (rows.domain != results.GLOBAL_DOMAIN)]
    for _, row in rows.iterrows():
        worst = int(row["worst_client_id"])
        assert results.evaluate_kept(pw_runs / "pw", "pw", client=worst).own.accuracy == row["worst_client_accuracy"]
    shared = json.loads((pw_runs / "sh" / "models" / "sh" / "final.deployed.json").read_text())
    assert {e["values"] for e in shared["clients"]} == {None}
    sh = results.load(pw_runs / "sh").rounds
    sh = sh[(sh.eval_mode == "deployed") & (sh["round"] == 3) & (sh.domain != results.GLOBAL_DOMAIN)]
    assert not np.array_equal(rows["loss"].to_numpy(), sh["loss"].to_numpy())


def test_a_resumed_asynchronous_per_width_run_gives_the_tables_of_the_run_never_stopped(tmp_path, pw_fed):
    """With updates in flight across the checkpoint (their plans hold the narrower widths' statistics in the hook's
    payload), the engine's state brings them back: the resumed run's tables are the uninterrupted run's."""
    cfg = build_config(preset="smoke", overrides=[*PW, "training.rounds=3", "algorithm.od_sampling=batch",
                                                  "devices.mode=async", "asynchronous.concurrency=2",
                                                  "asynchronous.buffer_size=1"])

    def stop(summary):
        if summary.round == 2:
            raise KeyboardInterrupt

    run_experiment(cfg, tmp_path / "whole", run_id="a", federation=pw_fed)
    whole = results.load(tmp_path / "whole")
    assert (whole.runs["status"] == "finished").all() and np.isfinite(whole.rounds["accuracy"]).all()
    assert whole.rounds["staleness_max"].max() >= 1  # the engine's rule recovered some statistics from a stale update
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", run_id="a", federation=pw_fed, progress=stop)
    run_experiment(cfg, tmp_path / "cut", run_id="a", federation=pw_fed, resume=True)
    assert_same_tables(results.load(tmp_path / "cut"), whole)


def test_a_resumed_per_width_run_gives_the_tables_of_the_run_never_stopped(tmp_path, pw_runs, pw_fed, monkeypatch):
    """Interrupted after round 2 and resumed, the tables equal the uninterrupted run's; the checkpointed
    statistics are what makes it so: resumed with the narrow widths' sets reset, the deployed figures differ."""
    cfg = build_config(preset="smoke", overrides=[*PW, "training.rounds=3", "algorithm.od_sampling=batch"])

    def stop(summary):
        if summary.round == 2:
            raise KeyboardInterrupt

    for name in ("cut", "reset"):
        with pytest.raises(KeyboardInterrupt):
            run_experiment(cfg, tmp_path / name, run_id="pw", federation=pw_fed, progress=stop)
    run_experiment(cfg, tmp_path / "cut", run_id="pw", federation=pw_fed, resume=True)
    assert_same_tables(results.load(tmp_path / "cut"), results.load(pw_runs / "pw"))

    def forget(strategy, tree):
        return {**tree, "bn": strategy.init_state().strategy_state["bn"]}

    monkeypatch.setattr(resume, "state_from_tree", forget)  # what a resume reads the state with
    run_experiment(cfg, tmp_path / "reset", run_id="pw", federation=pw_fed, resume=True)
    with pytest.raises(AssertionError):
        assert_same_tables(results.load(tmp_path / "reset"), results.load(pw_runs / "pw"))


def test_a_model_without_batchnorm_runs_per_width_as_shared():
    """Nothing to keep per width: no state, no payload, plans on the global model (the numbers of ``shared``)."""
    cfg = build_config(preset="smoke", overrides=["algorithm.name=fjord", "algorithm.od_bn=per_width",
                                                  "algorithm.od_sampling=batch", "data.name=generated_blobs",
                                                  "model.name=mlp", "data.partition=iid", "data.num_clients=4"])
    ctx, strat = make_strategy(cfg, build_federation(cfg))
    state = strat.init_state()
    assert not strat.per_width and state.strategy_state == {}
    plans = strat.configure_round(state, 1)
    assert all(p.params is state.params and not (p.hooks and p.payload(HOOK).bn) for p in plans.values())
