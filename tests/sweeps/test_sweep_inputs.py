"""What a sweep refuses before Ray starts (issue 40): ``--set`` of what the sweep sets itself, unreachable
``--address``/``RAY_ADDRESS``, tune's ``--storage``, and a ``--resume`` of a missing folder or of a folder
whose runs came from another study or config. No Ray is started here (``connect`` fails the test if reached)."""
from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedsap_ray import results

REPO = Path(__file__).resolve().parents[2]
GRIDS = ["ablation", "sensitivity", "main_comparison", "capacity_confound", "mask_stability", "learning_check", "readings"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"sweep_{name}", REPO / "sweeps" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    import sweeps.tuner

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(sweeps.tuner, "connect", lambda *a, **k: pytest.fail("Ray was started"))


def refused(capsys, script: str, *args: str) -> str:
    rc = _load(script).main(list(args))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    return lines[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("script", [*GRIDS, "tune"])
@pytest.mark.parametrize("override, needle", [("seed=3", "--seeds"), ("study=x", "study"),
                                              ("resources.backend=local", "--workers-per-trial"),
                                              ("resources.num_workers=2", "--workers-per-trial"),
                                              ("resources.address=127.0.0.1:1", "--address"),
                                              ("_out=/tmp/x", "not a config field")])
def test_set_of_what_every_sweep_sets_is_refused(tmp_path, capsys, script, override, needle):
    line = refused(capsys, script, "--out", str(tmp_path / "o"), "--dry-run", "--set", override)
    assert f"invalid --set {override!r}" in line and needle in line


@pytest.mark.parametrize("script", GRIDS)
def test_set_of_a_key_the_chosen_variants_set_is_refused(tmp_path, capsys, script):
    mod = _load(script)
    variants = mod.VARIANTS
    key = next(k for ov in variants.values() for k in __import__("sweeps.trials").trials.flat_overrides(ov))
    line = refused(capsys, script, "--out", str(tmp_path / "o"), "--dry-run", "--set", f"{key}=1")
    assert f"the sweep sets {key} itself (per variant" in line and "--variants" in line


@pytest.mark.parametrize("override", ["algorithm.name=fedavg", "algorithm.tau_var=0.1", "algorithm.g_target=0.6"])
def test_tune_refuses_a_set_of_what_it_searches(tmp_path, capsys, override):
    assert "the sweep sets" in refused(capsys, "tune", "--out", str(tmp_path / "o"), "--dry-run", "--set", override)


@pytest.mark.parametrize("script", ["ablation", "sensitivity", "tune"])
@pytest.mark.parametrize("dry", [True, False])
def test_an_unreachable_address_is_refused_before_ray(tmp_path, capsys, monkeypatch, script, dry):
    port = closed_port()
    line = refused(capsys, script, "--out", str(tmp_path / "o"), "--smoke-test", "--address", f"127.0.0.1:{port}",
                   *(["--dry-run"] if dry else []))
    assert line.startswith(f"{script}.py: error: invalid --address='127.0.0.1:{port}'") or \
        f"invalid --address='127.0.0.1:{port}'" in line
    monkeypatch.setenv("RAY_ADDRESS", "garbage")
    assert "invalid RAY_ADDRESS='garbage'" in refused(capsys, script, "--out", str(tmp_path / "o"), "--smoke-test",
                                                      *(["--dry-run"] if dry else []))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("storage, needle", [
    ("bogus://x", "not a database URL"), ("not a url", "not a database URL"),
    ("sqlite:////etc/hostname", "is not an SQLite database"), ("sqlite://", "in-memory"),
    ("sqlite:///:memory:", "in-memory"), ("sqlite:////no/such/folder/optuna.db", "does not exist"),
    ("sqlite:////tmp", "is a folder"), ("mysql://u@127.0.0.1/db", "driver is not installed")])
@pytest.mark.parametrize("dry", [True, False])
def test_tune_refuses_a_storage_it_cannot_use(tmp_path, capsys, storage, needle, dry):
    line = refused(capsys, "tune", "--out", str(tmp_path / "o"), "--smoke-test", "--storage", storage,
                   *(["--dry-run"] if dry else []))
    assert f"invalid --storage={storage!r}" in line and needle in line


def test_tune_takes_a_new_sqlite_file_in_a_writable_folder(tmp_path, capsys):
    tune = _load("tune")
    assert tune.main(["--out", str(tmp_path / "o"), "--smoke-test", "--dry-run",
                      "--storage", f"sqlite:///{tmp_path / 'optuna.db'}"]) == 0
    assert not (tmp_path / "optuna.db").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("script", ["ablation", "capacity_confound", "tune"])
def test_resume_of_a_missing_folder_is_refused(tmp_path, capsys, script):
    line = refused(capsys, script, "--out", str(tmp_path / "typo"), "--smoke-test", "--resume")
    assert "invalid --resume" in line and "does not exist" in line and str(tmp_path / "typo") in line


def test_tune_resume_of_a_study_that_is_not_there_is_refused(tmp_path, capsys):
    (tmp_path / "o").mkdir()
    line = refused(capsys, "tune", "--out", str(tmp_path / "o"), "--smoke-test", "--resume")
    assert "no study 'fedsap-tune'" in line and "leave --resume out" in line


def _write_run(out: Path, run_id: str, cfg) -> None:
    (out / "runs").mkdir(parents=True, exist_ok=True)
    row = {"run_id": run_id, "study": cfg.study, "status": "finished", "config_json": json.dumps(cfg.to_dict()),
           "config_hash": cfg.config_hash()}
    pq.write_table(pa.Table.from_pylist([row], schema=results.schema("runs").empty_table().schema),
                   out / "runs" / f"{run_id}.parquet")


def _planned(args: list[str]):
    """The smoke ablation's trials for ``full`` at seed 0 and their config (as study_main plans them)."""
    from sweeps import study
    from sweeps.trials import to_configs

    mod = _load("ablation")
    parsed = study.study_parser(doc=mod.__doc__, variants=mod.VARIANTS, study="ablation",
                                default_preset="laptop").parse_args(args)
    opts = study.options_from(parsed, mod.SMOKE)
    trials = study.grid_trials({"full": mod.VARIANTS["full"]}, opts, "ablation")
    return trials, opts, to_configs(trials[0])[0][0]


def test_resume_refuses_a_run_of_another_study_or_config(tmp_path, capsys):
    from dataclasses import replace

    from sweeps import study

    out = tmp_path / "o"
    base = ["--out", str(out), "--smoke-test", "--variants", "full", "--resume"]
    trials, opts, cfg = _planned(base)
    _write_run(out, "full-s0", cfg)
    assert study.pending(trials, opts) == [] and study.check_resume(trials, opts) is None  # its own run: skipped
    _write_run(out, "full-s0", replace(cfg, study="sensitivity"))
    line = refused(capsys, "ablation", *base)
    assert "run full-s0" in line and "study 'sensitivity', not 'ablation'" in line and "--out" in line
    _write_run(out, "full-s0", cfg)
    line = refused(capsys, "ablation", *base, "--set", "training.lr=0.5")  # another config under the same run id
    assert "run full-s0" in line and f"config_hash {cfg.config_hash()}" in line and "--set" in line


def test_resume_of_a_folder_with_a_damaged_runs_file_is_one_line(tmp_path, capsys):
    out = tmp_path / "o"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "full-s0.parquet").write_bytes(b"PAR1" + b"\0" * 20)
    line = refused(capsys, "ablation", "--out", str(out), "--smoke-test", "--variants", "full", "--resume")
    assert "runs/full-s0.parquet" in line and "cannot be read" in line  # the damaged file, named


# ----------------------------------------------------------------------------------------------
# --tracker (docs/guides/trackers.md): checked before Ray starts; the trials report their rounds only when tracked
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["ablation", "tune"])
def test_tracker_flags_are_checked_before_ray(tmp_path, capsys, monkeypatch, script):
    uri = (tmp_path / "o").as_uri()  # a URI destination: trackers write to this machine, so a folder must be given
    line = refused(capsys, script, "--out", uri, "--dry-run", "--tracker", "tensorboard")
    assert "--tracker tensorboard: --out is a URI" in line and "--tracker-uri" in line
    storage = ["--storage", f"sqlite:///{tmp_path / 'optuna.db'}"] if script == "tune" else []  # its URI rule
    assert _load(script).main(["--out", uri, "--dry-run", "--tracker", "tensorboard",
                               "--tracker-uri", str(tmp_path / "t"), *storage]) == 0
    line = refused(capsys, script, "--out", str(tmp_path / "o"), "--dry-run", "--tracker-uri", str(tmp_path / "t"))
    assert "invalid --tracker-uri" in line and "no --tracker is given" in line
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)
    line = refused(capsys, script, "--out", str(tmp_path / "o"), "--dry-run", "--tracker", "mlflow")
    assert line.endswith("--tracker mlflow needs the trackers extra: pip install 'fedsap-ray[trackers]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # a dry run creates nothing


def test_a_tracked_sweeps_trials_say_so_and_keep_their_run_ids(tmp_path):
    plain, _, _ = _planned(["--out", str(tmp_path / "o"), "--smoke-test"])
    tracked, opts, _ = _planned(["--out", str(tmp_path / "o"), "--smoke-test", "--tracker", "tensorboard"])
    assert [s.name for s in opts.trackers] == ["tensorboard"]
    assert tracked == [{**t, "_trackers": True} for t in plain]  # nothing else changes, run ids included


def _summary(t: int, accuracy: float):
    from fedsap_ray.engine.server import RoundSummary

    row = {"round": t, "domain": "__global__", "eval_mode": "global", "evaluated": True, "accuracy": accuracy,
           "bytes_up": 100 * t}
    return RoundSummary(round=t, evaluated=True, global_accuracy=accuracy, best_global_accuracy=accuracy,
                        worst_domain=None, worst_domain_accuracy=accuracy, avg_capacity=1.0, bytes_up=100 * t,
                        bytes_down=0, train_loss=1.0, wall_s=0.0, rows=(row,))


def test_a_trial_reports_each_runs_rounds_metrics_only_when_tracked(monkeypatch):
    """A trial of two seeds, the second resumed past round 1 (so it sits round 1 out, as drive steps it): each
    round's report names the runs that ran it, with their rounds metrics; untracked, the report is as before."""
    from fedsap_ray.run.session import SessionMetrics
    from sweeps import trainable

    reports: list[dict] = []
    monkeypatch.setattr(trainable.tune, "report", reports.append)
    monkeypatch.setattr(trainable.ray.util, "get_current_placement_group", lambda: None)
    started = [SessionMetrics("a-s0", 0, 3, 0.0, 0.0), SessionMetrics("a-s1", 1, 3, 0.0, 0.0)]
    for tracked in (True, False):
        cb = trainable.TuneReport(["a-s0", "a-s1"], 3, tracked=tracked)
        cb.on_start(started)
        cb.on_round(1, [_summary(1, 0.25)], started)
        cb.on_round(2, [_summary(2, 0.5), _summary(2, 0.75)], started)
    sent = [json.loads(r[trainable.ROUNDS_METRICS]) for r in reports[:2]]
    assert sent == [{"a-s0": {"global/__global__/accuracy": 0.25, "bytes_up": 100.0}},
                    {"a-s0": {"global/__global__/accuracy": 0.5, "bytes_up": 200.0},
                     "a-s1": {"global/__global__/accuracy": 0.75, "bytes_up": 200.0}}]
    assert all(trainable.ROUNDS_METRICS not in r for r in reports[2:])
    assert {k: v for k, v in reports[0].items() if k != trainable.ROUNDS_METRICS} == reports[2]
