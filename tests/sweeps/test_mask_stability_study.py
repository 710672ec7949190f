"""The mask-stability study (sweeps/mask_stability.py) through the sweep machinery, and its analysis
(analysis/stability.py, the ablation report's stability rows): every reading pins its options, the swapped
shares are read from the clients table as the column's definition says, and a swap budget shows in them."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis import ablation, stability
from fedsap_ray import results
from fedsap_ray.algorithms.fedsap import roles
from fedsap_ray.config import build_config
from conftest import load_study


def _load():
    return load_study("mask_stability")


def test_every_reading_pins_every_stability_option_and_the_grid_crosses_dga_sources():
    mod = _load()
    assert len(mod.VARIANTS) == 14
    pinned = ("smoothing", "stability", "ranking", "masks", "dga_source")
    configs = {}
    for name, overrides in mod.VARIANTS.items():
        cfg = build_config(preset="laptop", overrides=overrides)
        opts = cfg.algorithm.options
        assert all(k in opts for k in pinned), name  # a later change of FedSAP's defaults cannot move the study
        configs[name] = tuple(sorted((k, str(v)) for k, v in opts.items()))
    assert len(set(configs.values())) == 14  # fourteen distinct configurations


@pytest.fixture(scope="module")
def study(smoke_study):
    """The study's ``--smoke-test`` folder (run once per session, shared with the docs' command check)."""
    return smoke_study("mask_stability"), smoke_study.proc("mask_stability")


def test_swap_shares_follow_the_clients_table(study):
    out, proc = study
    res = results.load(str(out))
    shares = stability.swap_shares(res)
    c = res.clients.dropna(subset=["n_new_channels"])
    c = c[c["round"] > 1]  # the smoke preset's FedSAP warm-up is 1 round
    mine = (c["n_new_channels"] / (c["n_global"] + c["n_private"])).groupby([c["run_id"], c["capacity_max"]]).mean()
    got = shares.set_index(["run_id", "capacity_max"])["swap_share"]
    pd.testing.assert_series_equal(got.sort_index(), mine.sort_index(), check_names=False)
    # the budget held every client-round (floor(0.1 x active), at least one) and the masks still moved
    b = c[c["run_id"] == "ema-budget-train-s0"]
    active = (b["n_global"] + b["n_private"]).to_numpy()
    assert (b["n_new_channels"].to_numpy() <= [roles.swap_limit(0.1, int(a)) for a in active]).all()
    assert b["n_new_channels"].sum() > 0
    # re-ranked every round, the narrow clients swap more than under the budget
    narrow = stability.per_run(res).set_index("variant")["swap_narrow"]
    assert narrow["today-train"] > narrow["ema-budget-train"]
    assert "Swapped share after warm-up, per keep ratio" in proc.stdout and "|" in proc.stdout


def test_report_rows_and_mask_motion_columns(study):
    out, _ = study
    res = results.load(str(out))
    table = stability.table(res)
    assert sorted(table["variant"]) == sorted(_load().VARIANTS)
    for col in ("best_global_accuracy", "deployed", "worst_client", "swap_narrow", "min_coverage"):
        assert col not in table.columns  # renamed to the study's measures
    assert {"full-width best_mean", "swap share keep-min_mean", "min domain coverage_mean"} <= set(table.columns)
    rules = ablation.stability_table(res)
    assert set(rules["rule"]) == {r for r, _ in ablation.STABILITY_RULES}  # the dga_source=train runs, one row each
    motion = ablation.mask_motion_table(res)
    keep_cols = [c for c in motion.columns if c.startswith("swap keep ")]
    assert len(keep_cols) == res.clients["capacity_max"].nunique()
    assert np.isfinite(motion[keep_cols].to_numpy(dtype=float)).all()


def test_progress_line_shows_the_swapped_share():
    from fedsap_ray.algorithms.fedsap.strategy import progress_template

    c = {"n_reactivated": 3, "n_role_switches": 1, "swap_share": 0.21, "swap_share_narrow": 0.39}
    text = progress_template(c).format_map(c)
    assert "swap 21% (narrowest 39%)" in text
