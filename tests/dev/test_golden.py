"""The golden-numbers tool (fedsap_ray.dev.golden): record then check is identical, a perturbed
recorded number is found and named, bad input exits 2. One case (fedavg, local), two tiny runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fedsap_ray.dev import golden

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("golden")
    assert golden.main(["record", str(store), "--only", "fedavg", "--backends", "local"]) == 0
    return store


def test_record_then_check_is_identical(baseline, capsys):
    manifest = json.loads((baseline / golden.MANIFEST).read_text())
    assert list(manifest["cases"]) == ["fedavg"] and manifest["package_version"]
    assert set(manifest["cases"]["fedavg"]["tables"]) == {"runs", "rounds", "clients"}
    rounds = pd.read_parquet(baseline / "fedavg.rounds.parquet")
    assert "accuracy" in rounds.columns and not set(rounds.columns) & golden.DROP
    capsys.readouterr()
    assert golden.main(["check", str(baseline), "--only", "fedavg"]) == 0
    out = capsys.readouterr().out
    assert "OK    fedavg.rounds" in out and out.strip().splitlines()[-1].startswith("IDENTICAL")


def test_a_perturbed_number_is_found_and_named(baseline, tmp_path, capsys, monkeypatch):
    """The case's run is replaced by the tables recorded from it (test_record_then_check_is_identical shows a real
    run gives exactly those): what this test checks is the comparison, and a run of the case costs 3.5 s."""
    manifest = golden.read_manifest(baseline)
    monkeypatch.setattr(golden, "run_case", lambda case, root: golden.read_recorded(baseline, case.reference, manifest))
    store = tmp_path / "perturbed"
    store.mkdir()
    for f in baseline.iterdir():
        (store / f.name).write_bytes(f.read_bytes())
    f = store / "fedavg.rounds.parquet"
    df = pd.read_parquet(f)
    df.loc[3, "accuracy"] += 1e-7
    df.to_parquet(f, index=False)
    capsys.readouterr()
    assert golden.main(["check", str(store), "--only", "fedavg"]) == 1
    out = capsys.readouterr().out
    assert "DIFF  fedavg.rounds" in out and "column accuracy: 1 of" in out
    assert "OK    fedavg.clients" in out and out.strip().splitlines()[-1].startswith("DIFFERENT: 1 tables")


def test_bad_input_exits_2(baseline, tmp_path, capsys):
    assert golden.main(["check", str(baseline), "--only", "fedavg,nosuch"]) == 2
    assert "unknown case(s): nosuch" in capsys.readouterr().err
    assert golden.main(["check", str(tmp_path)]) == 2
    assert "no baseline" in capsys.readouterr().err
    assert golden.main(["check", str(baseline), "--only", "fedsap"]) == 2  # a case it never recorded
    assert "no baseline for: fedsap" in capsys.readouterr().err
    assert golden.main(["check", str(baseline), "--backends", "gpu"]) == 2


def test_the_file_runs_on_its_own():
    """``python fedsap_ray/dev/golden.py`` (how a baseline is recorded from an older checkout): absolute imports only."""
    p = subprocess.run([sys.executable, str(REPO / "fedsap_ray" / "dev" / "golden.py"), "--list", "--backends", "local"],
                       capture_output=True, text=True, cwd=REPO.parent, timeout=120)
    assert p.returncode == 0, p.stderr
    names = [line.split("\t")[0] for line in p.stdout.splitlines()]
    assert {"fedavg", "fedprox-mu", "fedsap-probe", "fedavg@masked", "fedavg@resume"} <= set(names)
    assert not any(n.endswith("@ray") for n in names)


def test_every_wall_clock_column_is_left_out_of_the_comparison():
    """golden.DROP spells the wall-clock columns out (it runs against older checkouts): it must hold them all."""
    from fedsap_ray import results

    assert set(results.WALL_CLOCK) <= golden.DROP


def test_a_baseline_column_dropped_since_it_was_recorded_is_not_compared():
    """A baseline recorded when DROP held fewer columns (schema_version was compared once) still checks."""
    import pandas as pd

    ref = pd.DataFrame({"round": [1, 2], "accuracy": [0.5, 0.6], "schema_version": [4, 4]})
    new = pd.DataFrame({"round": [1, 2], "accuracy": [0.5, 0.6]})
    assert golden.compare_table(ref, new) == ([], [])
    problems, _ = golden.compare_table(ref, new.assign(accuracy=[0.5, 0.7]))
    assert problems and "accuracy" in problems[0]
