"""``fedsap-ray run --tracker``: what TensorBoard, MLflow and W&B hold after a run, read back by their own libraries.

One tiny run logs to all three (module fixture): every tracker's curves must be the run's rounds table cell for
cell at step = the round (tests/trackerkit.py check_curves), its parameters the runs row's config, its tags the
study, seed, algorithm and run id, and MLflow and W&B hold the kept model files. Then what must not happen: a
missing library or a bad location runs nothing (exit 2, one line), a tracker that fails mid-run costs no result,
and a resumed or replaced run neither splits nor mixes its curves. The sweep path (Ray Tune) is
tests/sweeps/test_sweeps.py's tracker test, in the integration tier."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from faultkit import TINY, sets
from fedsap_ray import results
from fedsap_ray.run import trackers
from fedsap_ray.cli import main
from fedsap_ray.config import build_config
from fedsap_ray.run.driver import DriverCallback
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.experiment import run_experiment
from trackerkit import check_curves, mlflow_runs, rounds_cells, tensorboard_hparams, tensorboard_scalars, \
    tensorboard_text, wandb_run

RUN = "trk"
# round 1 evaluates nothing (its rows: mode not_evaluated), rounds 2 and 3 the global and deployed models
RUN_SETS = [*TINY, "training.eval_every=2"]


def in_process(*args: str) -> subprocess.CompletedProcess:
    """``fedsap-ray ARGS`` in this process: its exit code (argparse's too), stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["fedsap-ray", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def file_store():
    """MLflow's file store (``--tracker-uri mlflow=file://...``), which MLflow 3 opens only when asked to: it is
    created in milliseconds where the default SQLite store runs MLflow's schema migrations first (about 6 s on 2
    cores; the sweep test uses that default). W&B offline, whatever the environment says."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        mp.delenv("WANDB_MODE", raising=False)
        yield


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, file_store, single_thread):
    """One tiny run logged to all three trackers (its final model kept, as by default)."""
    tmp = tmp_path_factory.mktemp("trackers")
    out, store = tmp / "out", (tmp / "mlruns").as_uri()
    proc = in_process("run", "--preset", "smoke", *sets(RUN_SETS), "--out", str(out), "--run-id", RUN, "--quiet",
                      "--tracker", "tensorboard", "--tracker", "mlflow", "--tracker", "wandb",
                      "--tracker-uri", f"mlflow={store}")
    assert proc.returncode == 0, proc.stderr
    runs = results.load(out).runs
    kept = results.kept_models(out, RUN)
    assert {p.name for p in kept} >= {"final.safetensors", "final.json"}
    return SimpleNamespace(out=out, proc=proc, store=store, kept=kept, row=runs[runs.run_id == RUN].iloc[0])


def config_of(row) -> dict:
    """The runs row's config.* columns: the resolved config, one entry per leaf (numpy scalars as Python's)."""
    return {k[len("config."):]: v.item() if hasattr(v, "item") else v for k, v in row.items()
            if k.startswith("config.")}


def test_the_run_is_what_it_is_without_trackers(tracked):
    assert tracked.proc.stderr == ""
    assert {c[0] for c in rounds_cells(tracked.out, RUN)} == {1, 2, 3}
    assert tracked.row["status"] == "finished"


def test_tensorboard_holds_the_rounds_table_the_config_and_the_tags(tracked):
    folder = tracked.out / "_trackers" / "tensorboard" / RUN
    check_curves(tensorboard_scalars(folder), tracked.out, RUN)
    hp = tensorboard_hparams(folder)
    for key, value in config_of(tracked.row).items():
        want = value if isinstance(value, (bool, int, float, str)) else json.dumps(value, sort_keys=True)
        assert hp[key] == want, key
    assert set(hp) == set(config_of(tracked.row))
    text = tensorboard_text(folder, "tags/text_summary")
    for tag in ("study: default", "seed: 0", "algorithm: fedavg", f"run_id: {RUN}"):
        assert tag in text


def test_mlflow_holds_the_rounds_table_the_config_the_tags_and_the_kept_models(tracked):
    (name, run), = mlflow_runs(tracked.store, "default").items()
    assert name == RUN and run["status"] == "FINISHED"
    check_curves(run["curves"], tracked.out, RUN)
    config = config_of(tracked.row)
    assert run["params"] == {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in config.items()}
    assert {k: run["tags"][k] for k in ("study", "seed", "algorithm", "run_id")} == \
        {"study": "default", "seed": "0", "algorithm": "fedavg", "run_id": RUN}
    assert sorted(run["artifacts"]) == sorted(f"models/{f.name}" for f in tracked.kept)


def test_wandb_offline_run_holds_the_rounds_table_the_config_the_tags_and_the_kept_models(tracked):
    folder = tracked.out / "_trackers" / "wandb"
    run = wandb_run(folder)
    assert run["names"] == {RUN}
    check_curves(run["curves"], tracked.out, RUN)
    config = config_of(tracked.row)
    assert {k: run["config"][k] for k in config} == config
    assert {"study=default", "seed=0", "algorithm=fedavg", f"run_id={RUN}"} <= run["tags"]
    (files,) = folder.glob("wandb/offline-run-*/files")
    for f in tracked.kept:
        assert (files / "models" / f.name).read_bytes() == f.read_bytes()
        assert not (files / "models" / f.name).is_symlink()


@pytest.mark.parametrize("tracker", trackers.TRACKERS)
def test_a_missing_library_is_one_line_naming_the_extra(tracker, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, trackers.LIBRARIES[tracker], None)  # import fails as if not installed
    out = tmp_path / "out"
    proc = in_process("run", "--preset", "smoke", *sets(TINY), "--out", str(out), "--tracker", tracker)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"fedsap-ray: error: --tracker {tracker} needs the trackers extra: "
                                        "pip install 'fedsap-ray[trackers]'"]
    assert not out.exists()


def _refusals(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "a-file").write_text("x")
    return [
        (["--tracker-uri", str(tmp / "t")], "no --tracker is given"),
        (["--tracker", "tensorboard", "--tracker-uri", "mlflow=x"], "--tracker mlflow is not given"),
        (["--tracker", "wandb", "--tracker-uri", "wandb=s3://bucket/x"], "wandb writes to a local folder"),
        (["--tracker", "tensorboard", "--tracker-uri", "s3://bucket/x"], "is a local folder"),
        (["--tracker", "tensorboard", "--tracker-uri", "mlflow="], "--tracker mlflow is not given"),
        (["--tracker", "mlflow", "--tracker-uri", "mlflow="], "must name a location"),
        (["--tracker", "tensorboard", "--tracker-uri", f"tensorboard={tmp / 'a-file'}"], "it is a file"),
        (["--tracker", "tensorboard", "--tracker-uri", str(tmp / "a"), "--tracker-uri", str(tmp / "b")], "twice"),
        (["--tracker", "nope"], "invalid choice"),
    ]


def test_a_bad_tracker_flag_is_one_line_and_nothing_is_written(tmp_path):
    for args, needle in _refusals(tmp_path):
        before = sorted(tmp_path.rglob("*"))
        proc = in_process("run", "--preset", "smoke", *sets(TINY), "--out", str(tmp_path / "out"), *args)
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, proc.stderr)
        assert sorted(tmp_path.rglob("*")) == before, args


def test_a_link_in_the_results_folder_where_trackers_write_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (out / "_trackers").symlink_to(tmp_path / "elsewhere")
    proc = in_process("run", "--preset", "smoke", *sets(TINY), "--out", str(out), "--tracker", "tensorboard")
    assert proc.returncode == 2 and "_trackers is a symbolic link" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert sorted(out.iterdir()) == [out / "_trackers"] and not any((tmp_path / "elsewhere").iterdir())


class FailsAtRound2:
    """A tracker whose second round raises, as a store that went away would."""

    name = "mlflow"
    closed: list[str] = []

    def __init__(self, spec):
        pass

    def start(self, run):
        pass

    def log(self, step, metrics):
        if step == 2:
            raise OSError("the tracking server went away")

    def log_files(self, paths):
        pass

    def close(self, status):
        FailsAtRound2.closed.append(status)


def test_a_tracker_that_fails_mid_run_is_reported_once_and_costs_no_result(tmp_path, monkeypatch, file_store,
                                                                            single_thread):
    """An asynchronous run (its staleness columns: logged like every other), MLflow failing at round 2."""
    monkeypatch.setitem(trackers.MAKERS, "mlflow", FailsAtRound2)
    out = tmp_path / "out"
    proc = in_process("run", "--preset", "smoke", *sets([*TINY, "devices.mode=async"]), "--out", str(out),
                      "--run-id", "a", "--quiet", "--tracker", "mlflow", "--tracker", "tensorboard")
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "tracker mlflow failed logging round 2 of run a (OSError: the tracking server went away)" in line
    assert FailsAtRound2.closed == ["failed"]
    assert {c[0] for c in rounds_cells(out, "a")} == {1, 2, 3}
    scalars = tensorboard_scalars(out / "_trackers" / "tensorboard" / "a")
    check_curves(scalars, out, "a")
    assert set(scalars["staleness_mean"]) == {1, 2, 3}


class Interrupt(DriverCallback):
    """Ctrl-C after round ``at`` was checkpointed and logged."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_round(self, t, summaries, metrics) -> None:
        if t == self.at:
            raise KeyboardInterrupt


def test_a_resumed_run_continues_its_tracker_runs_and_a_replaced_one_replaces_its_curves(tmp_path, file_store,
                                                                                         single_thread):
    out, store = tmp_path / "out", (tmp_path / "mlruns").as_uri()
    specs = trackers.tracker_specs(["tensorboard", "mlflow", "wandb"], [f"mlflow={store}"], str(out))
    cfg = build_config(preset="smoke", overrides=TINY)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out, run_id="r", callbacks=[trackers.TrackerCallback(specs, cfg, out, "r"), Interrupt(2)])
    assert mlflow_runs(store, "default")["r"]["status"] == "KILLED"
    proc = in_process("run", "--out", str(out), "--resume", "r", "--quiet", "--tracker", "tensorboard",
                      "--tracker", "mlflow", "--tracker", "wandb", "--tracker-uri", f"mlflow={store}")
    assert proc.returncode == 0, proc.stderr
    (name, run), = mlflow_runs(store, "default").items()  # the same MLflow run, continued
    assert run["status"] == "FINISHED"
    check_curves(run["curves"], out, "r")
    check_curves(tensorboard_scalars(out / "_trackers" / "tensorboard" / "r"), out, "r")
    wandb = out / "_trackers" / "wandb"
    # one W&B run id, twice: a folder is offline-run-<time>-<run id>, and W&B adds -1 to a second one started within
    # the same second (wandb_init's x_sync_dir_suffix: a fast machine resumed within it, and the id read as "1")
    dirs = list(wandb.glob("wandb/offline-run-*"))
    assert len(dirs) == 2 and len({p.name.split("-")[3] for p in dirs}) == 1, [p.name for p in dirs]
    check_curves(wandb_run(wandb)["curves"], out, "r")
    # the same run id run again (another seed, so other numbers): TensorBoard shows only the new curves
    proc = in_process("run", "--preset", "smoke", *sets(TINY), "--seed", "5", "--out", str(out), "--run-id", "r",
                      "--overwrite", "--quiet", "--tracker", "tensorboard")
    assert proc.returncode == 0, proc.stderr
    check_curves(tensorboard_scalars(out / "_trackers" / "tensorboard" / "r"), out, "r")


def test_kept_files_are_the_run_models_folder_and_no_link_is_followed(tmp_path, tracked):
    out = tmp_path / "out"
    assert trackers.kept_files(out, "r") == []
    folder = out / "models" / "r"
    folder.mkdir(parents=True)
    for f in tracked.kept:
        (folder / f.name).write_bytes(f.read_bytes())
    assert trackers.kept_files(out, "r") == sorted(folder / f.name for f in tracked.kept)
    (folder / "best.json").symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="symbolic link"):
        trackers.kept_files(out, "r")


def test_the_readme_figure_reads_the_curves_the_trackers_hold(tracked, tmp_path):
    """analysis/trackers.py (the README's trackers figure) reads back the same numbers: the table's."""
    from analysis import trackers as figure

    cells = {(c[0], c[1], c[2], c[3]): c[4] for c in rounds_cells(tracked.out, RUN)}
    loss = figure.mlflow_curves(tracked.store, "default", "train_loss")
    assert loss == {RUN: {t: v for (t, _, d, col), v in cells.items() if col == "train_loss" and d == "__global__"}}
    deployed = figure.tensorboard_curves(tracked.out / "_trackers" / "tensorboard", "deployed/__global__/accuracy")
    assert deployed == {RUN: {t: v for (t, m, d, col), v in cells.items()
                              if (m, d, col) == ("deployed", "__global__", "accuracy")}}
    assert set(deployed[RUN]) == {2, 3}
    untracked = tmp_path / "res"  # a results folder whose runs logged to no tracker
    shutil.copytree(tracked.out, untracked, ignore=shutil.ignore_patterns("_trackers"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert figure.main([str(untracked), "--study", "default", "--png", str(tmp_path / "f.png")]) == 2
    assert "--tracker mlflow" in err.getvalue() and not (tmp_path / "f.png").exists()
