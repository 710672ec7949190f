"""End-to-end runs on the embedded dataset: Parquet schema, determinism, interruption."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.experiment import run_experiment
from conftest import steady

TINY = ["algorithm.name=fedavg", "data.num_clients=4", "data.max_test_per_domain=40", "model.width_mult=0.0625", "training.rounds=2",
        "training.local_epochs=1", "training.batch_size=16", "training.max_steps_per_epoch=3"]


@pytest.fixture(scope="module")
def tiny_fed():
    return build_federation(build_config(preset="smoke", overrides=TINY))


def _run(tmp_path, fed, extra=(), run_id="r", **kw):
    cfg = build_config(preset="smoke", overrides=TINY + list(extra))
    return cfg, run_experiment(cfg, tmp_path, run_id=run_id, federation=fed, **kw)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_fed):
    """A folder with one run ``r`` of TINY, finished: tests read it, or edit a copy."""
    out = tmp_path_factory.mktemp("plain") / "o"
    _run(out, tiny_fed)
    return out


CAPACITY4 = ["training.rounds=4", "algorithm.width=capacity"]


@pytest.fixture(scope="module")
def whole4(tmp_path_factory, tiny_fed):
    """The tables of run ``r`` of TINY + CAPACITY4 never interrupted: what its resumed runs must equal."""
    out = tmp_path_factory.mktemp("whole4")
    _run(out, tiny_fed, CAPACITY4, run_id="r")
    return results.load(out)


def test_tables_have_design_columns(tmp_path, tiny_fed):
    cfg, outcome = _run(tmp_path, tiny_fed, ["algorithm.width=capacity"])
    assert outcome.status == "finished"
    rounds = pd.read_parquet(tmp_path / "rounds")
    assert set(rounds.eval_mode) == {"global", "deployed"}
    rounds = rounds[rounds.eval_mode == "global"]
    for col in ["run_id", "round", "domain", "accuracy", "loss", "global_accuracy", "best_global_accuracy",
                "worst_domain_accuracy", "avg_capacity", "bytes_up", "bytes_down", "round_wall_s"]:
        assert col in rounds.columns
    assert set(rounds["domain"]) == set(tiny_fed.domains) | {results.GLOBAL_DOMAIN}
    g = rounds[rounds.domain == results.GLOBAL_DOMAIN].sort_values("round")
    per = rounds[rounds.domain != results.GLOBAL_DOMAIN]
    # global accuracy is the unweighted mean over domains at that round; best is the running max
    np.testing.assert_allclose(g["accuracy"].to_numpy(), per.groupby("round")["accuracy"].mean().to_numpy())
    np.testing.assert_allclose(g["best_global_accuracy"], np.maximum.accumulate(g["global_accuracy"]))
    np.testing.assert_allclose(g["worst_domain_accuracy"], per.groupby("round")["accuracy"].min().to_numpy())
    clients = pd.read_parquet(tmp_path / "clients")
    for col in ["client_id", "true_domain", "capacity_max", "capacity_used", "pseudo_group", "n_global",
                "n_private", "n_dropped", "h_hat", "h_tilde", "tv_distance", "n_samples", "train_loss",
                "params_trained", "macs_per_sample", "train_macs"]:
        assert col in clients.columns
    # width=capacity: low-capacity clients really send less
    r1 = clients[clients["round"] == 1].set_index("client_id")
    assert r1["bytes_up"].loc[r1["capacity_max"].idxmin()] < r1["bytes_up"].loc[r1["capacity_max"].idxmax()]
    lo, hi = r1["capacity_max"].idxmin(), r1["capacity_max"].idxmax()
    assert r1.loc[lo, "macs_per_sample"] < r1.loc[hi, "macs_per_sample"]
    assert r1.loc[lo, "params_trained"] < r1.loc[hi, "params_trained"]
    # one forward pass of the width-p sub-model per sample seen: a multiple of macs_per_sample, and > 0
    assert (r1["train_macs"] > 0).all() and (r1["train_macs"] % r1["macs_per_sample"] == 0).all()
    assert r1.loc[lo, "train_macs"] / r1.loc[lo, "macs_per_sample"] <= r1.loc[lo, "n_samples"] * cfg.training.local_epochs
    assert (g["bytes_up"].to_numpy() == clients.groupby("round")["bytes_up"].sum().to_numpy()).all()
    runs = results.load(tmp_path).runs
    assert runs.loc[0, "status"] == "finished" and runs.loc[0, "rounds_done"] == 2
    assert runs.loc[0, "config_hash"] == cfg.config_hash()
    # what the numbers reproduce against: this process's torch and the CPU kernels it picked
    from fedsap_ray.run.session import cpu_kernels

    assert runs.loc[0, "torch_version"] == torch.__version__ and runs.loc[0, "cpu_kernels"] == cpu_kernels()


def test_cpu_kernels_name_the_kernels_the_environment_chose():
    """ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA pin the kernels (how a run made on an AVX2 machine is
    reproduced on an AVX-512 one); the recorded string must follow them, or it would not say which was used."""
    import os
    import subprocess
    import sys

    code = "from fedsap_ray.run.session import cpu_kernels; print(cpu_kernels())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "aten=DEFAULT onednn=AVX2", out


def test_same_seed_same_numbers_and_seed_matters(tmp_path, tiny_fed, plain):
    _run(tmp_path / "b", tiny_fed)
    a = results.load(plain)
    b = results.load(tmp_path / "b")
    cols = ["round", "domain", "accuracy", "loss", "bytes_up", "bytes_down"]
    pd.testing.assert_frame_equal(a.rounds[cols], b.rounds[cols])
    pd.testing.assert_frame_equal(a.clients[["client_id", "train_loss"]], b.clients[["client_id", "train_loss"]])
    cfg = build_config(preset="smoke", overrides=TINY, seed=1)
    run_experiment(cfg, tmp_path / "c", run_id="r", federation=build_federation(cfg))
    c = results.load(tmp_path / "c")
    assert not np.allclose(a.clients["train_loss"], c.clients["train_loss"])


def test_killed_run_leaves_loadable_parquet(tmp_path, tiny_fed):
    calls = {"n": 0}

    def kill_after_first_round(summary):
        calls["n"] += 1
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, tiny_fed, ["training.rounds=5"], progress=kill_after_first_round)
    res = results.load(tmp_path)
    assert res.runs.loc[0, "status"] == "interrupted"
    assert set(res.rounds["round"]) == {1}
    assert not list((tmp_path / "rounds").glob(".*"))  # no temp files left behind
    assert len(pd.read_parquet(tmp_path / "clients")) == 4


def test_fedprox_mu_zero_equals_fedavg(tmp_path, tiny_fed, plain):
    _run(tmp_path / "prox0", tiny_fed, ["algorithm.name=fedprox", "algorithm.mu=0"])
    _run(tmp_path / "prox", tiny_fed, ["algorithm.name=fedprox", "algorithm.mu=1.0"])
    a, p0, p = (results.load(f).rounds for f in (plain, tmp_path / "prox0", tmp_path / "prox"))
    np.testing.assert_array_equal(a["loss"], p0["loss"])
    assert not np.array_equal(a["loss"], p["loss"])


def _final_params(cfg, fed):
    """Run the strategy loop in-process and return (initial, final) flat parameters."""
    from fedsap_ray import algorithms
    from fedsap_ray.experiment import build_context
    from fedsap_ray.runtime.local import LocalBackend

    ctx = build_context(cfg, fed)
    strat = algorithms.get(cfg.algorithm.name)(ctx, cfg.algorithm.opts)
    backend = LocalBackend("cpu")
    backend.start(ctx)
    state0 = strat.init_state()
    state = state0
    for t in range(1, cfg.training.rounds + 1):
        plans = strat.configure_round(state, t)
        state = strat.aggregate(state, plans, backend.train(plans), t).state
    return ctx, state0.params, state.params


def test_heterogeneous_fedavg_at_full_width_equals_fedavg(tiny_fed):
    base = build_config(preset="smoke", overrides=TINY)
    het = build_config(preset="smoke", overrides=TINY + ["algorithm.width=capacity", "capacity.scheme=full"])
    _, _, a = _final_params(base, tiny_fed)
    _, _, b = _final_params(het, build_federation(het))
    np.testing.assert_array_equal(a, b)


def test_untrained_coordinates_stay_bit_identical(tiny_fed):
    from fedsap_ray.models.masks import nested_channel_masks, param_mask

    cfg = build_config(preset="smoke", overrides=TINY + ["algorithm.width=capacity", "capacity.scheme=explicit",
                                                         "capacity.keep_ratios=[0.5,0.25,0.5,0.25]"])
    ctx, p0, p1 = _final_params(cfg, build_federation(cfg))
    covered = param_mask(ctx.space, ctx.layout, nested_channel_masks(ctx.space, 0.5))
    assert (~covered).sum() > 0
    assert p1[~covered].tobytes() == p0[~covered].tobytes()  # never trained: bit-identical to initialisation
    assert not np.array_equal(p1[covered], p0[covered])       # trained coordinates moved


def test_concurrent_clients_give_the_same_numbers(tmp_path, tiny_fed):
    _run(tmp_path / "one", tiny_fed, ["resources.num_workers=1", "algorithm.width=capacity"])
    _run(tmp_path / "two", tiny_fed, ["resources.num_workers=2", "algorithm.width=capacity"])
    a, b = results.load(tmp_path / "one"), results.load(tmp_path / "two")
    pd.testing.assert_frame_equal(steady(a.rounds), steady(b.rounds))
    pd.testing.assert_frame_equal(a.clients.drop(columns=["wall_s"]), b.clients.drop(columns=["wall_s"]))


@pytest.mark.parametrize("algo", [["algorithm.width=capacity"],
                                  ["algorithm.name=hasfl", "algorithm.warmup=1", "algorithm.t_adapt=1", "algorithm.t_norm=2"]],
                         ids=["fedavg-capacity", "hasfl"])
def test_resumed_run_equals_uninterrupted_run(tmp_path, tiny_fed, algo, request):
    def stop_after_round_2(summary):
        if summary.round == 2:
            raise KeyboardInterrupt

    extra = ["training.rounds=4", *algo]
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "cut", tiny_fed, extra, run_id="r", progress=stop_after_round_2)
    assert results.load(tmp_path / "cut").runs.loc[0, "rounds_done"] == 2
    _, outcome = _run(tmp_path / "cut", tiny_fed, extra, run_id="r", resume=True)
    assert outcome.status == "finished"
    assert not (tmp_path / "cut" / "checkpoints" / "r.npz").exists()  # removed once finished
    if extra == CAPACITY4:
        b = request.getfixturevalue("whole4")
    else:
        _run(tmp_path / "whole", tiny_fed, extra, run_id="r")
        b = results.load(tmp_path / "whole")
    a = results.load(tmp_path / "cut")
    pd.testing.assert_frame_equal(steady(a.rounds), steady(b.rounds))
    pd.testing.assert_frame_equal(a.clients.drop(columns=["wall_s"]), b.clients.drop(columns=["wall_s"]))
    pd.testing.assert_frame_equal(a.allocations, b.allocations)
    assert len(a.allocations) == 4 * 4  # every client, every round
    assert a.runs.loc[0, "status"] == "finished" and a.runs.loc[0, "rounds_done"] == 4


def test_a_schema_1_folder_still_loads(tmp_path, plain):
    """Folders written before rounds.frozen_params and the allocations table load with those as nulls / empty."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp_path = tmp_path / "o"
    shutil.copytree(plain, tmp_path)
    f = tmp_path / "rounds" / "r.parquet"
    old = pq.read_table(f)
    v1 = old.drop(["frozen_params"])
    v1 = v1.set_column(0, "schema_version", pa.array([1] * len(v1), pa.int32()))
    pq.write_table(v1, f)  # what version 1 wrote (readers refuse a version 10 file without frozen_params)
    res = results.load(tmp_path)
    assert res.rounds["frozen_params"].isna().all() and len(res.rounds) == old.num_rows
    assert res.allocations.empty and "p" in res.allocations.columns
    assert (res.runs["schema_version"] == results.SCHEMA_VERSION).all()


@pytest.mark.parametrize("merged", [False, True], ids=["killed-before-merging-parts", "merged-at-the-end"])
def test_resume_drops_rows_written_after_the_checkpoint(tmp_path, tiny_fed, monkeypatch, merged, whole4):
    """Round 3's rows reach disk but its checkpoint does not (the run dies in between): the resume
    from round 2 drops them (as parts, or inside the merged per-run file) and redoes round 3, so the
    tables equal an uninterrupted run's."""
    from fedsap_ray.persist import checkpoint

    save = checkpoint.save

    def save_fails_at_round_3(out, run_id, state, *a, **kw):
        if state.round == 3:
            raise OSError("killed between the round's rows and its checkpoint")
        return save(out, run_id, state, *a, **kw)

    extra = CAPACITY4
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "save", save_fails_at_round_3)
        if not merged:
            m.setattr(results.RunWriter, "consolidate", lambda self: self.tables_written())
        with pytest.raises(OSError):
            _run(tmp_path / "cut", tiny_fed, extra, run_id="r")
    cut = tmp_path / "cut"
    if merged:
        assert not list(cut.glob("*/r@r*.parquet")) and 3 in set(results.load(cut).rounds["round"])
    else:
        assert (cut / "rounds" / "r@r000003.parquet").is_file() and not (cut / "rounds" / "r.parquet").exists()
        stale = cut / "clients" / "r@r000009.parquet"  # a part from further on must go too
        stale.write_bytes((cut / "clients" / "r@r000003.parquet").read_bytes())
    _, outcome = _run(cut, tiny_fed, extra, run_id="r", resume=True)
    assert outcome.status == "finished" and not list(cut.glob("*/r@r*.parquet"))
    a, b = results.load(cut), whole4
    pd.testing.assert_frame_equal(steady(a.rounds), steady(b.rounds))
    pd.testing.assert_frame_equal(a.clients.drop(columns=["wall_s"]), b.clients.drop(columns=["wall_s"]))
    pd.testing.assert_frame_equal(a.layers, b.layers)
    pd.testing.assert_frame_equal(a.allocations, b.allocations)
