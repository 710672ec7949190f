"""Simulated device time (issue 28, fedsap_ray.data.devices): each client-round's time equals its formula, a
client past the deadline is left out of an aggregate that equals the one computed without it (and comes
back when it is in time), over-selection aggregates exactly the fastest k, an unavailable client is never
selected, and a bad device setting is one line naming the field."""
from __future__ import annotations

import io
import math
import shutil

import numpy as np
import pandas as pd
import pytest

from analysis import comparison, device_time, runs
from fedsap_ray import algorithms, results
from fedsap_ray.data import devices
from fedsap_ray.config import build_config
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.experiment import run_experiment
from fedsap_ray.run.progress import ProgressPrinter
from tests.conftest import federation_fixture, tiny_overrides

# FedAvg on the full model: a keep-0.2 device runs the same MACs at a fifth of the speed, so the
# capacity mapping makes the weak devices the slow ones
SMALL = ("data.num_clients=6", "training.rounds=3", "training.eval_deployed=false")
TINY = tiny_overrides("fedavg", "algorithm.width=full", *SMALL)
fed = federation_fixture(TINY)


def _run(tmp_path, fed, *extra, name="r", progress=None, base=TINY):
    cfg = build_config(preset="smoke", overrides=[*base, *extra])
    run_experiment(cfg, tmp_path / name, run_id=name, federation=fed, progress=progress)
    return cfg, results.load(tmp_path / name)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, fed):
    """A folder holding one run ``x`` of TINY (FedAvg waiting for every device): the tests below copy it where they
    need that run, beside runs of their own."""
    out = tmp_path_factory.mktemp("plain") / "o"
    run_experiment(build_config(preset="smoke", overrides=list(TINY)), out, run_id="x", federation=fed)
    return out


def _copy(plain, to):
    shutil.copytree(plain, to)
    return to


def test_a_client_rounds_time_is_its_formula_and_the_round_waits_for_the_slowest(tmp_path, fed):
    cfg, res = _run(tmp_path, fed, "devices.speed_full=1e9", "devices.down_bytes_s=1e6", "devices.up_bytes_s=5e5")
    c = res.clients
    by_hand = 3.0 * c["train_macs"] / (1e9 * c["capacity_max"]) + c["bytes_down"] / 1e6 + c["bytes_up"] / 5e5
    np.testing.assert_allclose(c["sim_time_s"], by_hand, rtol=1e-12)
    assert not c["straggler"].any()
    rounds = res.rounds.drop_duplicates("round").set_index("round")
    slowest = c.groupby("round")["sim_time_s"].max()
    np.testing.assert_allclose(rounds["sim_round_s"], slowest, rtol=1e-12)
    np.testing.assert_allclose(rounds["sim_elapsed_s"], slowest.cumsum(), rtol=1e-12)
    assert (rounds["n_stragglers"] == 0).all()
    # time to accuracy: the simulated hours of the first round whose best-so-far reaches the target
    g = res.rounds[(res.rounds["domain"] == results.GLOBAL_DOMAIN) & (res.rounds["eval_mode"] == "global")]
    g = g.set_index("round")["accuracy"].cummax()
    target = float(g.max())
    first = int(g[g >= target].index.min())
    t2a = device_time.time_to_accuracy(tmp_path / "r", full_width=target, deployed=1.01).iloc[0]
    assert math.isclose(t2a["full_width_hours"], rounds.loc[first, "sim_elapsed_s"] / 3600)
    assert t2a["full_width_reached"] == "1/1" and t2a["deployed_reached"] == "0/1" and np.isnan(t2a["deployed_hours"])
    fig = device_time.plot_curves(tmp_path / "r", "full_width")
    assert len(fig.axes[0].lines) == 1
    # the hand-computed figure for one client-round, from its own columns
    row = c.iloc[0]
    assert math.isclose(devices.client_time(cfg, devices.Device(1e9 * row.capacity_max, 1e6, 5e5, 1.0), int(row["round"]),
                                            int(row.client_id), int(row.train_macs), int(row.bytes_down), int(row.bytes_up)),
                        3 * row.train_macs / (1e9 * row.capacity_max) + row.bytes_down / 1e6 + row.bytes_up / 5e5)


def test_a_client_past_the_deadline_is_left_out_and_comes_back_when_in_time(tmp_path, fed, monkeypatch):
    seen = []  # (state in, plans, results, state out) of every aggregate call
    cls = algorithms.get("fedavg")
    inner = cls.aggregate

    def spy(self, state, plans, results_, t):
        out = inner(self, state, plans, results_, t)
        seen.append((self, state, dict(plans), list(results_), out.state, t))
        return out

    monkeypatch.setattr(cls, "aggregate", spy)
    # equal devices (a trace) on fast links, so the seeded jitter of the compute alone decides who is late
    trace = tmp_path / "equal.csv"
    pd.DataFrame({"client_id": range(len(fed.clients)), "speed": 1e9}).to_csv(trace, index=False)
    equal = ["devices.jitter=0.6", f"devices.trace={trace}", "devices.down_bytes_s=1e12", "devices.up_bytes_s=1e12"]
    _, base = _run(tmp_path, fed, *equal, name="base")
    times = base.clients["sim_time_s"]
    deadline = float(np.median(times))
    seen.clear()
    lines = io.StringIO()
    _, res = _run(tmp_path, fed, *equal, "devices.policy=deadline", f"devices.deadline_s={deadline}",
                  progress=ProgressPrinter(3, stream=lines))
    c = res.clients
    pd.testing.assert_series_equal(c["sim_time_s"], times)  # the same devices and draws
    assert (c["straggler"] == (c["sim_time_s"] > deadline)).all() and c["straggler"].any()
    assert c["train_macs"].notna().all()  # a straggler's compute is counted
    late = c[c["straggler"]]
    assert set(late["client_id"]) & set(c[~c["straggler"]]["client_id"])  # a late client is in time in another round
    for strat, state, plans, kept, out, t in seen:
        in_time = set(c[(c["round"] == t) & ~c["straggler"]]["client_id"])
        assert set(plans) == {r.client_id for r in kept} == in_time
        again = inner(strat, state, plans, kept, t).state  # the aggregate computed without the stragglers
        np.testing.assert_array_equal(out.params, again.params)
    rounds = res.rounds.drop_duplicates("round").set_index("round")
    assert (rounds["n_stragglers"] == late.groupby("round").size().reindex(rounds.index, fill_value=0)).all()
    assert (rounds.loc[rounds["n_stragglers"] > 0, "sim_round_s"] == deadline).all()
    # the study's reading: the share of client-rounds each capacity missed, and the two policies side by side
    late_share = device_time.missed(tmp_path / "r").set_index("method").iloc[0]
    by_keep = c.groupby("capacity_max")["straggler"].mean()
    assert late_share.to_dict() == pytest.approx({f"keep {k:g}": v for k, v in by_keep.items()})
    both = {"wait_all": tmp_path / "base", "deadline": tmp_path / "r"}
    t = device_time.compare(both, deployed=0.5, full_width=0.0)
    assert list(t["policy"]) == ["wait_all", "deadline"]  # in the order given (a study's own order of policies)
    assert t.set_index("policy")["total_hours"].to_dict() == pytest.approx(
        {"deadline": rounds["sim_elapsed_s"].iloc[-1] / 3600, "wait_all": times.groupby(c["round"]).max().sum() / 3600})
    assert "missed the deadline (deadline, %)" in device_time.report(both, deployed=0.5)
    printed = device_time.report(both, deployed=0.5, full_width=0.0).splitlines()  # the full-width target's columns
    head = [c.strip() for c in next(x for x in printed if x.startswith("| method")).strip("|").split("|")]
    assert head[4:6] == ["to 0% full-width (min)", "seeds reached (full-width)"]
    for _, r in t.iterrows():
        row = next(x for x in printed if x.startswith(f"| {r['method']} | {r['policy']} |"))
        minutes = 60 * r["full_width_hours"]  # one decimal from a minute up, three significant digits below
        assert minutes < 1 and row.strip("|").split("|")[4].strip() == f"{minutes:.3g}" != "0"
    assert len(device_time.plot_policies(both, "full_width").axes) == 2
    with pytest.raises(SystemExit) as bad:
        device_time.main([str(tmp_path / "r")])
    assert bad.value.code == 2
    with pytest.raises(SystemExit) as bad:
        device_time.main([f"deadline={tmp_path / 'r'}", "--full-width", "1.5"])
    assert bad.value.code == 2
    shown = lines.getvalue().splitlines()  # the progress line: device time so far and the round's stragglers
    for line, (_, row) in zip(shown, rounds.iterrows()):
        assert f"device time {row['sim_elapsed_s']:.1f}s" in line
        assert (f"({row['n_stragglers']} late)" in line) == (row["n_stragglers"] > 0)


def test_over_selection_samples_more_and_aggregates_exactly_the_fastest_k(tmp_path, fed):
    _, res = _run(tmp_path, fed, "training.participation=0.5", "devices.policy=over_select", "devices.over_select=0.5",
                  "devices.jitter=0.6")
    k = 3  # round(0.5 * 6)
    for t, c in res.clients.groupby("round"):
        assert len(c) == math.ceil(k * 1.5)
        fastest = set(c.sort_values(["sim_time_s", "client_id"])["client_id"][:k])
        assert set(c[~c["straggler"]]["client_id"]) == fastest
        assert res.rounds[res.rounds["round"] == t]["sim_round_s"].iloc[0] == c[~c["straggler"]]["sim_time_s"].max()
    # the study reports the left-out clients as over-selected, never as missing a deadline there was not
    printed = device_time.report({"over_select": tmp_path / "r"}, deployed=0.5)
    assert "over-selected and left out, slower than the round's k fastest (over_select, %)" in printed
    assert "missed the deadline" not in printed
    row = device_time.updates(tmp_path / "r").iloc[0]
    assert row["trainings"] == len(res.clients) and row["not_applied"] == res.clients["straggler"].sum() > 0


def test_an_unavailable_client_is_never_selected(tmp_path, fed):
    cfg, res = _run(tmp_path, fed, "devices.availability=0.5")
    devs = devices.devices_for(cfg, [c.capacity for c in fed.clients])
    chosen = res.clients.groupby("round")["client_id"].apply(set)
    for t, ids in chosen.items():
        assert ids == set(devices.available(cfg, devs, int(t)))  # participation 1: every available client
    assert len({frozenset(s) for s in chosen}) > 1 and all(len(s) < len(fed.clients) for s in chosen)


def test_a_device_trace_replaces_the_capacity_mapping_and_bad_traces_name_the_field(tmp_path, fed):
    trace = tmp_path / "devices.csv"
    pd.DataFrame({"client_id": [0, 1], "speed": [1e6, 2e6], "availability": [1.0, 1.0]}).to_csv(trace, index=False)
    cfg = build_config(preset="smoke", overrides=[*TINY, f"devices.trace={trace}"])
    devs = devices.devices_for(cfg, [c.capacity for c in fed.clients])
    assert [d.speed for d in devs[:3]] == [1e6, 2e6, cfg.devices.speed_full * fed.clients[2].capacity]
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"client_id": [0], "speed": [-1.0]}).to_csv(bad, index=False)
    for path, needle in [(bad, r"row 1 \(client 0\): speed -1.0 must be a number in"), (tmp_path / "none.csv", "no such file")]:
        with pytest.raises(ConfigError, match=f"invalid devices.trace=.*{needle}"):
            devices.devices_for(build_config(preset="smoke", overrides=[*TINY, f"devices.trace={path}"]),
                                [c.capacity for c in fed.clients])


def test_a_stragglers_channels_do_not_count_as_covered(tmp_path, fed):
    # HeteroFL's nested sub-models: only the full-width clients train the outer channels. Those clients are
    # made too slow for the deadline (a trace), so their updates are always discarded and the outer
    # channels stay frozen; under wait_all the same clients cover everything from round 1.
    full = [c.client_id for c in fed.clients if c.capacity == 1.0]
    assert full and len(full) < len(fed.clients)
    trace = tmp_path / "slow_full.csv"
    pd.DataFrame({"client_id": range(len(fed.clients)),
                  "speed": [1e3 if i in full else 1e12 for i in range(len(fed.clients))]}).to_csv(trace, index=False)
    links = [f"devices.trace={trace}", "devices.down_bytes_s=1e12", "devices.up_bytes_s=1e12"]

    def frozen(res):
        g = res.rounds[(res.rounds["domain"] == results.GLOBAL_DOMAIN)].drop_duplicates("round")
        return g.set_index("round")["frozen_params"]

    hetero = tiny_overrides("heterofl", *SMALL)
    _, waited = _run(tmp_path, fed, *links, name="wait", base=hetero)
    _, late = _run(tmp_path, fed, *links, "devices.policy=deadline", "devices.deadline_s=1.0", name="late", base=hetero)
    assert set(late.clients.loc[late.clients["straggler"], "client_id"]) == set(full)
    assert (frozen(waited) == 0).all()
    assert (frozen(late) > 0).all()


def test_the_study_names_every_method_it_compares_by_its_row_name():
    # Table 1's rows and the sub-model methods it lacks (HeteroFL, FjORD); a run of fedprox is Table 1's row
    pr = pd.DataFrame({"run_id": list("abcde"),
                       "label": ["heterofl", "fjord", "fedavg", "dapperfl (full_first_epoch=False)", "fedprox"]})
    assert device_time.row_names(pr) == {"a": "HeteroFL", "b": "FjORD", "c": "FedAvg", "d": "DapperFL (capacity)",
                                         "e": "FedProx (full model)"}


def test_a_deadline_run_no_client_missed_is_read_as_the_methods_wait_all_run(tmp_path, fed, plain):
    def run(folder, run_id, *extra):
        cfg = build_config(preset="smoke", overrides=[*TINY, *extra])
        run_experiment(cfg, tmp_path / folder, run_id=run_id, federation=fed)

    _copy(plain, tmp_path / "w")  # FedAvg waiting for every device: run x
    run("d", "in_time", "algorithm.width=capacity", "devices.policy=deadline", "devices.deadline_s=1e9")
    run("d", "late", "algorithm.name=fedprox", "devices.policy=deadline", "devices.deadline_s=1e-9")
    run("d", "has_one", "devices.policy=deadline", "devices.deadline_s=1e9")  # FedAvg: wait_all has its own run
    policies, borrowed = device_time.in_time_as_wait_all({"wait_all": tmp_path / "w", "deadline": tmp_path / "d"})
    assert borrowed == ["FedAvg (sub-models)"]
    assert set(policies["wait_all"].runs["run_id"]) == {"x", "in_time"}
    assert set(policies["deadline"].runs["run_id"]) == {"in_time", "late", "has_one"}
    for table in ("rounds", "clients"):
        assert set(policies["wait_all"][table]["run_id"]) == {"x", "in_time"}
    t = device_time.compare(policies, deployed=0.5).set_index(["method", "policy"])
    assert t.loc[("FedAvg (sub-models)", "wait_all"), "total_hours"] == t.loc[("FedAvg (sub-models)", "deadline"), "total_hours"]
    assert ("FedProx (full model)", "wait_all") not in t.index
    # without a wait_all folder nothing is borrowed
    assert device_time.in_time_as_wait_all({"deadline": tmp_path / "d"})[1] == []


def test_one_policy_reads_several_sweeps_folders_and_refuses_shared_run_ids(tmp_path, fed, plain):
    _copy(plain, tmp_path / "a")
    run_experiment(build_config(preset="smoke", overrides=list(TINY)), tmp_path / "b", run_id="y", federation=fed)
    _copy(plain, tmp_path / "c")  # run x again
    both = device_time.load_policy(f"{tmp_path / 'a'},{tmp_path / 'b'}")
    assert sorted(both.runs["run_id"]) == ["x", "y"] and set(both.clients["run_id"]) == {"x", "y"}
    t = device_time.time_to_accuracy(f"{tmp_path / 'a'},{tmp_path / 'b'}", full_width=0.0)
    assert t["full_width_reached"].tolist() == ["2/2"]
    with pytest.raises(ValueError, match="share run ids"):
        device_time.load_policy(f"{tmp_path / 'a'},{tmp_path / 'c'}")


def test_the_curves_tell_sub_model_from_full_model_methods_and_split_a_crowded_panel(tmp_path, fed, monkeypatch, plain):
    _copy(plain, tmp_path / "w")  # the full model: run x
    run_experiment(build_config(preset="smoke", overrides=[*TINY, "algorithm.width=capacity"]), tmp_path / "w",
                   run_id="narrow", federation=fed)
    assert device_time.sub_model_methods(tmp_path / "w") == {"FedAvg (sub-models)"}  # read from capacity_used
    # Table 1's marks: the paper's for its rows (FedSPU's clients run the full model forward), else the runs'
    assert not comparison.sys_het("FedSPU", True) and comparison.sys_het("FedSAP", False)
    assert comparison.sys_het("FjORD", True) and not comparison.sys_het("FjORD", False)
    both = {"wait_all": tmp_path / "w"}

    def drawn(fig):
        return {ax.get_title(): {ln.get_label(): ln.get_linestyle() for ln in ax.lines} for ax in fig.axes}

    assert drawn(device_time.plot_policies(both, "full_width")) == {
        "wait_all": {"FedAvg": "--", "FedAvg (sub-models)": "-"}}
    monkeypatch.setattr(device_time, "PANEL_LINES", 1)  # one line a panel: the two methods go to two panels
    fig = device_time.plot_policies(both, "full_width")
    assert drawn(fig) == {"wait_all: sub-models": {"FedAvg (sub-models)": "-"}, "wait_all: full model": {"FedAvg": "--"}}
    assert len({ax.get_ylim() for ax in fig.axes}) == 1  # one accuracy scale


def test_async_runs_are_read_beside_sync_ones_by_their_steps_time_and_told_apart_by_variant(tmp_path, fed, plain):
    """analysis.device_time on a synchronous folder and an asynchronous one holding two variants of one method:
    the time to a target is the hand-computed sim_elapsed_s of the first step (round) whose best-so-far accuracy
    reaches it, the variants are two named rows (never pooled as seeds), an async run is never borrowed as a
    wait_all run, and its discarded updates are reported as such."""
    def run(folder, run_id, *extra):
        run_experiment(build_config(preset="smoke", overrides=[*TINY, *extra]), tmp_path / folder, run_id=run_id,
                       federation=fed)

    _copy(plain, tmp_path / "sync")  # run x
    asyn = ["devices.mode=async", "asynchronous.concurrency=4", "training.rounds=6"]
    run("async", "k1", *asyn, "asynchronous.buffer_size=1", "asynchronous.staleness=polynomial",
        "asynchronous.max_staleness=1", "asynchronous.eval_every_s=0.05")  # evaluated at some steps only
    run("async", "k2", *asyn, "asynchronous.buffer_size=2")
    loaded = {p: device_time.load_policy(tmp_path / p) for p in ("sync", "async")}
    names = device_time.row_names(pd.concat([runs.per_run(r) for r in loaded.values()]))
    assert names == {"x": "FedAvg", "k1": "FedAvg [async: buffer 1, concurrency 4, polynomial a=0.5, max staleness 1]",
                     "k2": "FedAvg [async: buffer 2, concurrency 4, constant]"}
    # by hand from each run's rounds table: the first round (step) whose best-so-far global accuracy reaches the
    # target, at its sim_elapsed_s (NaN: never), for every accuracy some run reached
    best, hours = {}, {}
    for rid, folder in (("x", "sync"), ("k1", "async"), ("k2", "async")):
        r = results.load(tmp_path / folder).rounds
        r = r[(r["run_id"] == rid) & (r["domain"] == results.GLOBAL_DOMAIN)]
        best[rid] = r[r["eval_mode"] == "global"].set_index("round")["accuracy"].cummax()
        hours[rid] = r.drop_duplicates("round").set_index("round")["sim_elapsed_s"] / 3600
    assert not best["k1"].index.equals(hours["k1"].index)  # eval_every_s skipped steps
    policies, borrowed = device_time.in_time_as_wait_all({"wait_all": tmp_path / "sync", "async": tmp_path / "async"})
    assert borrowed == [] and set(policies["wait_all"].runs["run_id"]) == {"x"}  # no async run waited for a round
    later = 0  # hits after a run's first evaluation: the case is there
    for target in sorted({float(v) for b in best.values() for v in b}):
        first = {rid: b[b >= target].index.min() for rid, b in best.items()}
        by_hand = {names[rid]: np.nan if pd.isna(f) else hours[rid][int(f)] for rid, f in first.items()}
        later += sum(int(f) > b.index[0] for f, b in zip(first.values(), best.values()) if not pd.isna(f))
        t = device_time.compare(policies, deployed=1.01, full_width=target).set_index("method")
        assert len(t) == 3
        assert t["full_width_hours"].to_dict() == pytest.approx(by_hand, rel=1e-12, nan_ok=True)
    assert later > 0
    assert t["total_hours"].to_dict() == pytest.approx({names[rid]: h.iloc[-1] for rid, h in hours.items()})
    # the async columns, by hand from the clients tables: updates that reached the model, their mean staleness
    for rid, folder in (("x", "sync"), ("k1", "async"), ("k2", "async")):
        c = results.load(tmp_path / folder).clients
        c = c[(c["run_id"] == rid) & ~c["straggler"]]
        row = t.loc[names[rid]]
        assert row["updates_applied"] == len(c) and row["steps"] == hours[rid].index.max()
        assert (np.isnan(row["staleness_mean"]) if rid == "x" else row["staleness_mean"] == c["staleness"].mean())
    k1 = results.load(tmp_path / "async").clients
    k1 = k1[k1["run_id"] == "k1"]
    assert k1["straggler"].any()  # max_staleness 1 discarded some: reported as discarded, not as missed deadlines
    printed = device_time.report(policies, deployed=1.01, full_width=0.0)
    assert "discarded as staler than asynchronous.max_staleness (async, %)" in printed
    assert "missed the deadline" not in printed and "| mean staleness |" in printed
    shares = device_time.missed(runs.only_runs(policies["async"], ["k1"])).set_index("method").iloc[0]
    assert shares.to_dict() == pytest.approx({f"keep {k:g}": v for k, v in k1.groupby("capacity_max")["straggler"].mean().items()})
    fig = device_time.plot_policies(policies, "full_width")
    assert [sorted(ln.get_label() for ln in ax.lines) for ax in fig.axes] == [["FedAvg"], sorted([names["k1"], names["k2"]])]
    assert len({ax.get_xlim() for ax in fig.axes}) == 1 and fig.axes[0].get_xlim()[0] == 0  # one time axis


def test_a_horizon_reads_every_run_to_one_budget_of_updates_and_counts_the_trainings_never_applied(tmp_path, fed, capsys,
                                                                                                   plain):
    """``--updates N``: a synchronous run is read to round N // k, an asynchronous one to step N // buffer_size,
    each kept row the run's own; the cut is where the shorter run of the same training stops (nothing in rounds
    1..r depends on how many follow); trainings never applied (deadline stragglers) counted apart; a budget below
    one step is refused on the command line, naming the run."""
    def run(folder, run_id, *extra):
        run_experiment(build_config(preset="smoke", overrides=[*TINY, *extra]), tmp_path / folder, run_id=run_id,
                       federation=fed)

    _copy(plain, tmp_path / "sync")  # run x: 3 rounds of 6 clients (k = 6)
    run("short", "x", "training.rounds=2")  # the same run, stopped at round 2
    run("async", "a", "devices.mode=async", "asynchronous.concurrency=3", "asynchronous.buffer_size=2",
        "training.rounds=6")
    run("late", "d", "devices.policy=deadline", "devices.deadline_s=1e-9")  # every client misses it
    cut = device_time.to_horizon(tmp_path / "sync", 13)  # 13 // 6 = 2 rounds
    short = results.load(tmp_path / "short")
    for table in ("rounds", "clients"):
        got, want = cut[table], getattr(short, table)
        assert got["round"].max() == 2
        cols = [c for c in want.columns if not c.endswith("_s") and "wall" not in c]  # timings differ run to run
        pd.testing.assert_frame_equal(got[cols].reset_index(drop=True), want[cols].reset_index(drop=True))
    asy = device_time.to_horizon(tmp_path / "async", 9)  # 9 // 2 = 4 steps
    assert asy.rounds["round"].max() == 4 and asy.clients["round"].max() == 4
    t = device_time.compare({"sync": cut, "async": asy}, deployed=1.01).set_index("policy")
    r = results.load(tmp_path / "async").rounds
    assert t.loc["async", "total_hours"] == r[r["round"] == 4]["sim_elapsed_s"].iloc[0] / 3600
    assert t.loc["async", "steps"] == 4 and t.loc["async", "updates_applied"] == 8  # 4 steps of 2
    assert t.loc["sync", "trainings"] == 12 and t.loc["sync", "not_applied"] == 0
    late = device_time.updates(tmp_path / "late").iloc[0]
    assert late["trainings"] == 6 * 3 and late["not_applied"] == late["trainings"]  # 3 rounds of 6, none in time
    with pytest.raises(ValueError, match=r"--updates=5: run x applies 6 updates a round"):
        device_time.to_horizon(tmp_path / "sync", 5)
    with pytest.raises(SystemExit) as e:
        device_time.main([f"sync={tmp_path / 'sync'}", f"async={tmp_path / 'async'}", "--updates", "1"])
    assert e.value.code == 2 and "invalid --updates=1: run" in capsys.readouterr().err
    assert device_time.main([f"sync={tmp_path / 'sync'}", "--updates", "12"]) == 0
    assert "| 12 (0) |" in capsys.readouterr().out
    # a panel of one async variant names it once, in its title, and draws the method in the method's own look
    fig = device_time.plot_policies({"sync": cut, "async": asy}, "full_width")
    (s_line,), (a_line,) = (ax.get_lines() for ax in fig.axes)
    assert a_line.get_label() == s_line.get_label() == "FedAvg" and a_line.get_color() == s_line.get_color()
    assert fig.axes[1].get_title() == "async\nasync: buffer 2, concurrency 3, constant"
