"""Study scripts under Ray Tune: flat config boundary, smoke runs (what CI runs), a killed driver's Ray ended,
failure reporting, and the Optuna study resumed across invocations (a killed sweep resumed: test_multinode.py)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from fedsap_ray import algorithms, results
from fedsap_ray.config import ConfigError
from fedsap_ray.runtime import reaper
from conftest import REPO, check_complete, run_study, run_study_in_process, sweep_statuses, wait_part_way

pytestmark = pytest.mark.slow


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"sweep_{name}", REPO / "sweeps" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trials():
    from sweeps import trials

    return trials


def _flat(trials, **extra):
    return {"algorithm.name": "fedsap_fixed", "algorithm.g_target": 0.8, "training.rounds": 3, "seed": 1,
            "_study": "sensitivity", "_preset": "smoke", "_out": "/tmp/x", "_variant": "g_target=0.8", **extra}


# ----------------------------------------------------------------------------------------------
# The flat-dict boundary and trial resources
# ----------------------------------------------------------------------------------------------
def test_flat_tune_config_becomes_the_typed_config(trials):
    (cfg,), (run_id,) = trials.to_configs(_flat(trials))
    assert run_id == "g_target=0.8-s1"
    assert (cfg.seed, cfg.study, cfg.preset, cfg.training.rounds) == (1, "sensitivity", "smoke", 3)
    assert cfg.algorithm.name == "fedsap_fixed" and cfg.algorithm.options["g_target"] == 0.8
    # the same trial from override strings (what the scripts write) gives the same config
    flat = {**trials.flat_overrides(["algorithm.name=fedsap_fixed", "algorithm.g_target=0.8", "training.rounds=3"]),
            **{k: v for k, v in _flat(trials).items() if k.startswith("_") or k == "seed"}}
    assert trials.to_configs(flat)[0][0] == cfg
    cfgs, ids = trials.to_configs(_flat(trials, _seeds=[0, 2], _variant=None))
    assert [c.seed for c in cfgs] == [0, 2] and ids[0].endswith("-s0") and ids[1].endswith("-s2")
    assert ids[0].startswith("t") and ids[0][:-3] == ids[1][:-3]  # sampled trials: one hash for all seeds


@pytest.mark.parametrize("key,value,field", [("algorithm.g_target", 1.5, "algorithm.g_target"),
                                             ("training.rounds", 0, "training.rounds"),
                                             ("model.nope", 1, "model.nope")])
def test_a_bad_trial_value_is_rejected_naming_the_field(trials, key, value, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        trials.to_configs(_flat(trials, **{key: value}))


def test_placement_group_has_a_server_bundle_and_one_per_client_worker(trials):
    pgf = trials.trial_resources(_flat(trials, _workers=3, _server_cpus=0.5, **{"resources.cpus_per_worker": 2,
                                                                              "resources.gpus_per_worker": 0.25}))
    assert pgf.bundles == [{"CPU": 0.5}] + [{"CPU": 2.0, "GPU": 0.25}] * 3
    pgf = trials.trial_resources(_flat(trials, _workers=2, _seeds=[0, 1, 2], _variant=None))
    assert pgf.bundles == [{"CPU": 1.0}] + [{"CPU": 1.0}] * 6  # lockstep seeds: workers for every run
    assert trials.trial_resources(_flat(trials, _workers=0)).bundles == [{"CPU": 1.0}]


# ----------------------------------------------------------------------------------------------
# The studies' grids
# ----------------------------------------------------------------------------------------------
def test_sensitivity_grid_is_the_papers_one_factor_design():
    mod = _load("sensitivity")
    from sweeps.trials import flat_overrides

    # papers/000 Table 7's value lists, around the fixed-mask reference (0.9, 0.1, 0.3)
    assert mod.GRID == {"g_target": [0.5, 0.6, 0.7, 0.8, 0.9, 0.95], "tau_var": [0.05, 0.1, 0.2, 0.3, 0.5],
                        "beta_ema": [0.3, 0.5, 0.7, 0.9]}
    assert len(mod.VARIANTS) == 1 + 5 + 4 + 3  # the reference point runs once
    ref = flat_overrides(mod.VARIANTS["ref"])
    assert ref["algorithm.name"] == "fedsap_fixed"
    for name, ov in mod.VARIANTS.items():
        diff = {k: v for k, v in flat_overrides(ov).items() if ref.get(k) != v}
        if name == "ref":
            assert diff == {}
        else:
            factor, value = name.split("=")
            assert diff == {f"algorithm.{factor}": float(value)}


def test_ablation_variants_are_distinct_configs():
    from fedsap_ray.config import build_config

    mod = _load("ablation")
    hashes = {build_config(preset="smoke", overrides=ov, seed=0).config_hash() for ov in mod.VARIANTS.values()}
    assert len(hashes) == len(mod.VARIANTS) == 19


def test_dry_run_validates_and_lists_the_trials_without_running_them(tmp_path, capsys):
    out = tmp_path / "out"
    ablation, tune = _load("ablation"), _load("tune")
    assert ablation.main(["--out", str(out), "--seeds", "0", "1", "--variants", "full", "no-sgp", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "ablation: 4 trials, preset laptop, seeds [0, 1]" in text
    assert 'no-sgp-s1: algorithm.name="fedsap" algorithm.sgp=false' in text
    assert ablation.main(["--out", str(out), "--dry-run", "--set", "training.rounds=-1"]) == 2  # validated
    assert "training.rounds=-1" in capsys.readouterr().err
    assert tune.main(["--out", str(out), "--num-samples", "5", "--seeds", "0", "1", "--dry-run"]) == 0
    assert "up to 5 completed trials of fedsap" in capsys.readouterr().out
    assert not out.exists()  # nothing was written, no Optuna study opened


def test_main_comparison_runs_every_registered_algorithm():
    mod = _load("main_comparison")
    assert sorted(set(mod.VARIANTS) - set(mod.EXTRA_VARIANTS)) == algorithms.names()
    assert mod.VARIANTS["dapperfl-capacity"] == ["algorithm.name=dapperfl", "algorithm.full_first_epoch=false"]
    from analysis.comparison import method_of
    assert method_of({"algorithm": {"name": "dapperfl", "options": {"full_first_epoch": False}}}) == "DapperFL (capacity)"


# ----------------------------------------------------------------------------------------------
# Smoke runs (one per script, shared with tests/analysis/test_notebooks.py through the session fixture)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("study,rounds", [("sensitivity", 3), ("ablation", 3), ("main_comparison", 3),
                                          ("capacity_confound", 4)])
def test_smoke_study_writes_one_run_per_grid_point_and_seed(smoke_study, study, rounds):
    out = smoke_study(study)
    mod = _load(study)
    check_complete(out, {f"{v}-s0" for v in mod.VARIANTS}, rounds)
    proc = smoke_study.proc(study)
    assert "trials" in proc.stderr and "best best_global_accuracy" in proc.stderr  # the live progress line
    assert "|" in proc.stdout  # the study's table


def test_sensitivity_table_is_read_from_the_runs(smoke_study):
    from analysis.sensitivity import sensitivity_table

    res = results.load(smoke_study("sensitivity"))
    table = sensitivity_table(res)
    g = res.rounds[(res.rounds["domain"] == "__global__") & res.rounds["evaluated"]]
    best = g[g["eval_mode"] == "group"].groupby("run_id")["accuracy"].max()  # FedSAP's primary mode
    for factor in ("g_target", "tau_var", "beta_ema"):  # the reference run sits on every factor's curve
        row = table[(table["factor"] == factor) & table["reference"].astype(bool)].iloc[0]
        assert row["best_mean"] == pytest.approx(best["ref-s0"])
    row = table[(table["factor"] == "tau_var") & (table["value"] == 0.5)].iloc[0]
    assert row["best_mean"] == pytest.approx(best["tau_var=0.5-s0"])


def test_main_comparison_table_matches_a_direct_computation(smoke_study):
    from analysis.comparison import table1, to_markdown

    res = results.load(smoke_study("main_comparison"))
    table = table1(res)
    r = res.rounds[(res.rounds["run_id"] == "fedmp-s0") & res.rounds["evaluated"]]
    assert table.loc["FedMP", "street"] == pytest.approx(r[r["domain"] == "street"]["accuracy"].max())
    g = r[(r["domain"] == "__global__") & (r["eval_mode"] == "global")]
    assert table.loc["FedMP", "global"] == pytest.approx(g["accuracy"].max())
    d = r[(r["domain"] == "__global__") & (r["eval_mode"] == "deployed")].sort_values("round")
    assert table.loc["FedMP", "deployed"] == pytest.approx(d["accuracy"].max())
    assert table.loc["FedMP", "deployed_final"] == pytest.approx(d["accuracy"].iloc[-1])
    # methods beyond the paper's table are marked by what their clients trained
    md = to_markdown(table)
    assert "| hasfl | ✓ |" in md and "| scaffold | ✗ |" in md and "| FedSPU | ✗ |" in md


def test_a_finished_sweep_reruns_nothing_and_needs_resume(smoke_study):
    """Both invocations stop before Ray starts (a refusal; nothing to run): the script's ``main`` in this process
    (the script as a subprocess, its exit status: the failing-trial and Optuna tests below)."""
    out = smoke_study("capacity_confound")
    before = {f.name: f.stat().st_mtime_ns for f in (out / "rounds").iterdir()}
    proc = run_study_in_process("capacity_confound", "--smoke-test", "--out", str(out))
    assert proc.returncode == 2 and "--resume" in proc.stderr and "--out" in proc.stderr
    proc = run_study_in_process("capacity_confound", "--smoke-test", "--out", str(out), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 to run" in proc.stderr and "Table 3" in proc.stdout
    assert before == {f.name: f.stat().st_mtime_ns for f in (out / "rounds").iterdir()}


# ----------------------------------------------------------------------------------------------
# A killed driver, resumed
# ----------------------------------------------------------------------------------------------
KILL_VARIANTS = ["ref"]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]
    except OSError:
        return "?"


def _alive(pid: int, started: int) -> bool:
    st = reaper._stat(pid)
    return st is not None and st[1] == started


def test_a_killed_sweep_driver_leaves_no_ray_process_behind(tmp_path):
    """kill -9 of a sweep's driver mid-trial: the local Ray it started (GCS, raylet, agents, the trial's actors)
    is ended by fedsap_ray.runtime.reaper. That ``--resume`` then completes every trial exactly once is tested on
    the multi-node cluster (tests/runtime/test_multinode.py), through the same study code."""
    out = tmp_path / "out"
    args = ["--smoke-test", "--out", str(out), "--max-concurrent", "1", "--set", "training.rounds=5",
            "--variants", *KILL_VARIANTS]
    proc = subprocess.Popen([sys.executable, str(REPO / "sweeps" / "sensitivity.py"), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_part_way(proc, out, finished=False)  # kill once the trial is part-way
        started = reaper.descendants(proc.pid)  # its local Ray: GCS, raylet, agents, trial and worker actors
        assert any(_comm(p) == "ray::DashboardAgent" for p in started), [_comm(p) for p in started]
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone, as a user's kill -9 would
        proc.wait()
        # Ray's own agents would linger ~60 s (a fixed timeout in Ray); fedsap_ray.runtime.reaper ends them
        deadline = time.time() + 40
        while time.time() < deadline and [p for p, t in started.items() if _alive(p, t)]:
            time.sleep(0.5)
        assert not [(p, _comm(p)) for p, t in started.items() if _alive(p, t)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything left of the driver's process group
        proc.wait()
    assert sweep_statuses(out) == {"ref-s0": "running"}  # caught mid-way: its row says so, for --resume


def test_a_failing_trial_is_retried_and_reported_with_its_error(tmp_path):
    out, empty = tmp_path / "out", tmp_path / "empty"
    empty.mkdir()  # exists (so the config is valid) but holds no dataset files: every trial fails at load
    # a relative --out lands where the user ran the script (trials run in their own working directories)
    proc = run_study("sensitivity", "--smoke-test", "--out", "out", "--variants", "ref", "g_target=0.5",
                     "--max-failures", "1", "--set", "data.name=digits", "--set", f"data.root={empty}", cwd=tmp_path)
    assert proc.returncode == 1
    assert "2 trial(s) failed" in proc.stderr and "2 failed (2 retries)" in proc.stderr  # each retried once
    assert "ref-s0" in proc.stderr and "g_target=0.5-s0" in proc.stderr
    assert "DatasetUnavailable" in proc.stderr
    runs = results.load(out).runs.set_index("run_id")  # not silently dropped: the runs table says why
    assert set(runs.index) == {"ref-s0", "g_target=0.5-s0"} and (runs["status"] == "failed").all()
    assert runs["error"].str.contains("DatasetUnavailable").all()


@pytest.mark.parametrize("uri", [False, True])
def test_a_finished_runs_leftover_checkpoint_is_removed_on_resume(tmp_path, uri):
    """A driver killed between a run's ``finished`` row and the removal of its checkpoint leaves both:
    the next --resume skips the run and removes that checkpoint (locally, or at a URI destination)."""
    from fedsap_ray.results.destination import ResultsDestination
    from sweeps.study import drop_stale_checkpoints

    folder = tmp_path / "out"
    for run_id in ("done-s0", "cut-s0"):
        (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
        (folder / "checkpoints" / f"{run_id}.npz").write_bytes(b"state")
    dest = ResultsDestination(folder.as_uri() if uri else folder, staging_root=tmp_path / "staging")
    assert dest.is_remote == uri
    assert drop_stale_checkpoints(dest, ["done-s0"]) == ["done-s0"]
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["cut-s0.npz"]  # a run to resume keeps its own
    assert drop_stale_checkpoints(dest, ["done-s0"]) == []


# ----------------------------------------------------------------------------------------------
# Trackers: every trial's curves in MLflow and TensorBoard
# ----------------------------------------------------------------------------------------------
def test_a_sweep_logs_every_trials_curves_to_mlflow_and_tensorboard(tmp_path, session_ray):
    """Two trials on the session's Ray, MLflow in its default SQLite store: one MLflow run and one TensorBoard run
    per trial, named by its run id, each curve the run's rounds table at step = the round, read back by
    MlflowClient and TensorBoard's EventAccumulator (tests/trackerkit.py); Tune's own event files keep their few
    scalars (the rounds metrics reach the driver as one text value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trackerkit import check_curves, mlflow_runs, tensorboard_scalars

    out = tmp_path / "out"
    proc = run_study_in_process("ablation", "--smoke-test", "--workers-per-trial", "0", "--variants", "full", "no-dga",
                                "--out", str(out), "--tracker", "mlflow", "--tracker", "tensorboard")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tracker" not in proc.stderr  # no tracker failed
    runs = results.load(out).runs.set_index("run_id")
    logged = mlflow_runs(f"sqlite:///{out / '_trackers' / 'mlflow' / 'mlflow.db'}", "ablation")
    assert set(logged) == set(runs.index) == {"full-s0", "no-dga-s0"}
    for run_id, run in logged.items():
        assert run["status"] == "FINISHED"
        assert {k: run["tags"][k] for k in ("study", "variant", "seed", "trial")} == \
            {"study": "ablation", "variant": run_id[:-3], "seed": "0", "trial": run_id}
        assert run["params"]["algorithm.name"] == runs.loc[run_id, "config.algorithm.name"] == "fedsap"
        assert run["params"]["training.rounds"] == "3"
        check_curves(run["curves"], out, run_id)
        check_curves(tensorboard_scalars(out / "_trackers" / "tensorboard" / run_id), out, run_id)
    assert logged["no-dga-s0"]["params"]["algorithm.options.dga"] == "none"
    for events in (out / "_tune").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        assert all(tag.startswith("ray/tune/") for tag in acc.Tags()["scalars"])
        assert not any("accuracy/" in tag or "__global__" in tag for tag in acc.Tags()["scalars"])


# ----------------------------------------------------------------------------------------------
# Optuna: the study survives across invocations
# ----------------------------------------------------------------------------------------------
def test_tune_smoke_resumes_its_optuna_study(tmp_path, session_ray):
    """The Optuna study across three invocations, each the script's ``main`` on the session's Ray (the study lives in
    its SQLite file, not in a process; the script as a subprocess starting its own Ray is tested above: a failing
    trial retried, a killed driver)."""
    import optuna

    out = tmp_path / "tune"
    first = run_study_in_process("tune", "--smoke-test", "--out", str(out), "--num-samples", "1")
    assert first.returncode == 0, first.stderr[-4000:]
    storage = f"sqlite:///{out / 'optuna.db'}"
    study = optuna.load_study(study_name="fedsap-tune", storage=storage)
    done1 = [(t.number, t.params, t.value) for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done1) == 1
    again = run_study_in_process("tune", "--smoke-test", "--out", str(out), "--num-samples", "1")  # refused before Ray
    assert again.returncode == 2 and "--resume" in again.stderr  # never silently mixed into an old study
    second = run_study_in_process("tune", "--smoke-test", "--out", str(out), "--num-samples", "2", "--resume")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "1 trials completed, 1 to run" in second.stderr
    study = optuna.load_study(study_name="fedsap-tune", storage=storage)
    done2 = [(t.number, t.params, t.value) for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done2) == 2 and done2[:1] == done1  # the first invocation's trials are kept as they were
    res = results.load(out)
    assert res.runs["run_id"].nunique() == len(res.runs) >= 2
    assert set(res.runs["status"]) <= {"finished", "stopped"} and "finished" in set(res.runs["status"])
    trials = pd.read_parquet(out / "optuna_trials.parquet")
    assert len(trials) == 2 and trials["value"].notna().all()
