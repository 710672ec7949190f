"""The command line: every bad input exits 2 with one line; the smoke run writes Parquet.

Every test here calls ``fedsap_ray.cli.main`` in this process (the function the console script and
``python -m fedsap_ray`` call), its exit code and captured output asserted as a subprocess's would be; what
only a subprocess shows (the entry points, their exit status reaching the shell, a local Ray started from the
command line) is tests/test_cli_subprocess.py, in the integration tier."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from faultkit import TINY, cli_process, runs_row, sets, tiny_run
from fedsap_ray import results
from faultkit import cli as in_process


cli = cli_process


BAD_INPUT = [
    (["--set", "training.rounds=-1"], "training.rounds=-1"),
    (["--set", "algorithm.name=fedmagic"], "algorithm.name='fedmagic'"),
    (["--set", "capacity.keep_ratios=[0.5,0.5]"], "capacity.keep_ratios"),
    (["--set", "data.root=/no/such/dir"], "data.root='/no/such/dir'"),
    (["--set", "nonsense"], "KEY=VALUE"),
    (["--config", "/no/such.yaml"], "--config"),
    (["--resume", "no-such-run"], "--resume='no-such-run'"),
]


def one_line_refusal(r, needle, out: Path) -> None:
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not (out / "runs").exists()  # rejected before any work


@pytest.mark.parametrize("args, needle", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path, capsys):
    one_line_refusal(cli(capsys, "run", "--preset", "smoke", "--out", str(tmp_path), *args), needle, tmp_path)


def test_missing_dataset_files_exit_2(tmp_path, capsys):
    r = cli(capsys, "run", "--preset", "smoke", "--out", str(tmp_path / "o"), "--set", "data.name=cifar10",
            "--set", "data.partition=dirichlet", "--set", f"data.root={tmp_path}")
    assert r.returncode == 2 and str(tmp_path) in r.stderr


def test_smoke_run_writes_rounds(tmp_path, capsys):
    r = cli(capsys, "run", "--preset", "smoke", "--out", str(tmp_path), "--set", "training.rounds=2")
    assert r.returncode == 0, r.stderr
    assert "round 2/2" in r.stderr and "global acc" in r.stderr
    rounds = pd.read_parquet(tmp_path / "rounds")
    assert sorted(rounds["round"].unique()) == [1, 2]


def test_closing_line_names_every_table_written(tmp_path, capsys):
    """HAS-FL writes allocations and no layers: the closing line lists exactly the tables on disk."""
    r = cli(capsys, "run", "--preset", "smoke", "--out", str(tmp_path), "--quiet", "--set", "algorithm.name=hasfl",
            "--set", "training.rounds=1", "--set", "model.width_mult=0.0625", "--set", "data.max_test_per_domain=40",
            "--set", "training.max_steps_per_epoch=2")
    assert r.returncode == 0, r.stderr
    on_disk = [t for t in results.TABLES if (tmp_path / t).is_dir()]
    assert on_disk == ["runs", "rounds", "clients", "allocations"]
    assert r.stdout.rstrip().endswith(f"results in {tmp_path}/{{{','.join(on_disk)}}}"), r.stdout


def test_print_config_and_listings(capsys):
    r = cli(capsys, "run", "--preset", "paper", "--print-config")
    assert r.returncode == 0 and '"local_epochs": 10' in r.stdout
    r = cli(capsys, "algorithms")
    assert r.returncode == 0 and "fedprox" in r.stdout and "mu=" in r.stdout
    from fedsap_ray import algorithms

    for name in algorithms.names():  # every registered strategy is listed with its one-line summary
        summary = algorithms.get(name).summary
        assert summary and f"{name:<14} {summary}" in r.stdout
    r = cli(capsys, "datasets")
    assert r.returncode == 0 and "embedded_digits" in r.stdout


def test_interrupted_cli_run_resumes(tmp_path, capsys):
    """Resume from the command line: the stored config is used and the run finishes (FedSAP on the smoke preset at
    a sixteenth of the width, two steps a round: what is resumed is the config, whatever it holds)."""
    from fedsap_ray.config import build_config
    from fedsap_ray.experiment import run_experiment

    cfg = build_config(preset="smoke", overrides=["training.rounds=3", "data.max_test_per_domain=50",
                                                  "model.width_mult=0.0625", "training.max_steps_per_epoch=2"])

    def stop(summary):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path, run_id="cut", progress=stop)
    r = cli(capsys, "run", "--out", str(tmp_path), "--resume", "cut")
    assert r.returncode == 0, r.stderr
    assert "round 2/3" in r.stderr and "round 1/3" not in r.stderr
    assert pq.read_table(tmp_path / "runs" / "cut.parquet").to_pylist()[0]["status"] == "finished"
    assert sorted(pd.read_parquet(tmp_path / "rounds")["round"].unique()) == [1, 2, 3]


def test_a_resume_keeps_the_stored_config_json_byte_for_byte(tmp_path, capsys):
    tiny_run(tmp_path, "r", stop_after=1)
    f = tmp_path / "runs" / "r.parquet"
    t = pq.read_table(f)
    row = t.to_pylist()[0]
    # a row written before the defaults were floats: the same config, with 7 where a rebuild writes 7.0
    old_json = row["config_json"].replace('"tier_shares":[7.0,7.0,3.0,3.0]', '"tier_shares":[7,7,3,3]')
    assert old_json != row["config_json"]
    results.write_atomic(results.to_table("runs", [{**row, "config_json": old_json}]), f)
    rc, lines = in_process(capsys, "run", "--quiet", "--out", str(tmp_path), "--resume", "r")
    assert rc == 0, lines
    assert runs_row(tmp_path, "r")["config_json"] == old_json


def test_the_interrupt_message_names_the_run_to_resume(tmp_path, capsys, monkeypatch):
    from fedsap_ray.engine.server import Server

    real_round = Server.round

    def ctrl_c_in_round_2(self, state, t):
        if t == 2:
            raise KeyboardInterrupt
        return real_round(self, state, t)

    monkeypatch.setattr(Server, "round", ctrl_c_in_round_2)
    rc, lines = in_process(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path),
                    *sets(TINY))
    assert rc == 130
    (run_id,) = [p.stem for p in (tmp_path / "runs").glob("*.parquet")]
    assert lines[-1].endswith(f"--resume {run_id}"), lines
    monkeypatch.setattr(Server, "round", real_round)
    rc, lines = in_process(capsys, "run", "--quiet", "--out", str(tmp_path), "--resume", run_id)
    assert rc == 0, lines
