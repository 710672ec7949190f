"""analysis.readings (the authors'-code readings study, docs/studies/readings.md) on hand-built results."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest

from analysis import readings
from fedsap_ray import results

G = results.GLOBAL_DOMAIN
# variant -> per seed (global accuracy per round, deployed accuracy at the last round, worst client there)
RUNS = {"fjord": [([0.2, 0.5, 0.4], 0.30, 0.10), ([0.2, 0.6, 0.6], 0.34, 0.12), ([0.1, 0.4, 0.5], 0.32, 0.14)],
        "fjord-batch": [([0.3, 0.7, 0.6], 0.40, 0.10), ([0.3, 0.8, 0.8], 0.44, 0.12), ([0.2, 0.6, 0.7], 0.42, 0.14)]}


def _res() -> SimpleNamespace:
    runs, rounds, clients = [], [], []
    for variant, seeds in RUNS.items():
        for seed, (accs, dep, worst) in enumerate(seeds):
            rid = f"{variant}-s{seed}"
            cfg = {"algorithm": {"name": "fjord", "options": {}}, "study": "readings", "seed": seed}
            runs.append({"run_id": rid, "study": "readings", "algorithm": "fjord", "dataset": "digits", "seed": seed,
                         "config_json": json.dumps(cfg), "status": "finished", "variant": variant})
            for t, a in enumerate(accs, start=1):
                rounds.append({"run_id": rid, "round": t, "eval_mode": "global", "domain": G, "evaluated": True,
                               "accuracy": a})
            rounds.append({"run_id": rid, "round": len(accs), "eval_mode": "deployed", "domain": G, "evaluated": True,
                           "accuracy": dep, "worst_client_accuracy": worst})
            clients += [{"run_id": rid, "round": 1, "client_id": c, "train_macs": 1e9 * (c + 1)} for c in range(2)]
    return SimpleNamespace(runs=pd.DataFrame(runs), rounds=pd.DataFrame(rounds), clients=pd.DataFrame(clients),
                           layers=None, allocations=None)


def test_the_table_has_every_measure_per_variant_over_seeds():
    t = readings.table(_res()).set_index("variant")
    assert list(t.index) == ["fjord", "fjord-batch"] and (t["seeds"] == 3).all()
    assert t.loc["fjord", "full-width best_mean"] == pytest.approx((0.5 + 0.6 + 0.5) / 3)
    assert t.loc["fjord", "full-width final_mean"] == pytest.approx(0.5)
    assert t.loc["fjord-batch", "deployed final_mean"] == pytest.approx(0.42)
    assert t.loc["fjord", "GMACs / client-round_mean"] == pytest.approx(1.5)


def test_a_reading_is_judged_against_its_methods_default_and_the_noise():
    """full-width best: fjord-batch 0.7/0.8/0.7 against 0.5/0.6/0.5, +20 points, std 5.8 each: beyond noise;
    the worst clients are equal (difference 0, never beyond the noise)."""
    v = readings.verdicts(_res()).set_index("measure")
    assert set(v["reading"]) == {"fjord-batch"} and set(v["against"]) == {"fjord"}
    assert v.loc["full-width best", "difference"] == pytest.approx(20.0)
    assert v.loc["full-width best", "noise (larger std)"] == pytest.approx(100 * pd.Series([0.5, 0.6, 0.5]).std())
    assert v.loc["full-width best", "beyond noise"]
    assert v.loc["worst client final", "difference"] == pytest.approx(0.0, abs=1e-9)
    assert not v.loc["worst client final", "beyond noise"]
    assert "fjord-batch" in readings.report(_res())
