"""analysis/privacy.py (the DP-per-tier study, sweeps/privacy.py) on a tiny hand-made results frame: each figure is
checked against hand-computed values; the figure is drawn. No run, no model (the per-client evaluation of kept
models is the study's own step, checked once against the runs' recorded deployed rows: docs/studies/privacy.md)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from analysis import privacy

DOMAINS = ("mnist", "street")


def _config(method: str, eps: float | None, den: str = "cohort") -> str:
    p = {"mode": "off"} if eps is None else {"mode": "central", "target_epsilon": eps, "denominator": den}
    return json.dumps({"algorithm": {"name": method}, "privacy": p})


def _res() -> SimpleNamespace:
    """heterofl at epsilon infinity and 8 (coverage), seeds 0 and 1, two rounds, two test domains."""
    runs, rounds, clients = [], [], []
    for variant, eps, den in (("heterofl-inf", None, "cohort"), ("heterofl-eps8-coverage", 8.0, "coverage")):
        for seed in (0, 1):
            rid = f"{variant}-s{seed}"
            runs.append({"run_id": rid, "seed": seed, "config_json": _config("heterofl", eps, den),
                         "wall_s": 10.0 + seed})
            drop = 0.0 if eps is None else 0.2
            for rnd in (1, 2):
                base = 0.5 + 0.1 * rnd + 0.02 * seed - drop  # final global: 0.7 / 0.72 (off), 0.5 / 0.52 (eps 8)
                dp = {} if eps is None else {"dp_snr_shared": rnd * 1.0, "dp_snr_partial": rnd * 0.5,
                                             "dp_noise_std": 1.5 * 0.75, "dp_clip_norm": 0.75}
                for mode in ("global", "deployed"):
                    for i, dom in enumerate(DOMAINS):
                        rounds.append({"run_id": rid, "round": rnd, "eval_mode": mode, "domain": dom,
                                       "accuracy": base + (0.1 if i == 0 else -0.1), **dp})
                    rounds.append({"run_id": rid, "round": rnd, "eval_mode": mode, "domain": "__global__",
                                   "accuracy": base, **dp})
            for cid, clipped in enumerate((True, False, False, False)):
                clients.append({"run_id": rid, "round": 1, "client_id": cid,
                                "dp_clipped": None if eps is None else clipped})
    return SimpleNamespace(runs=pd.DataFrame(runs), rounds=pd.DataFrame(rounds), clients=pd.DataFrame(clients))


def _per_client(per_run: pd.DataFrame) -> pd.DataFrame:
    """Two tiers (keep 1: clients 0 and 5, keep 0.2: client 4), each model on both test domains; DP costs the
    narrow tier 0.3 and the wide one 0.1."""
    rows = []
    for _, r in per_run.iterrows():
        private = not math.isinf(r["epsilon"])
        for cid, tier, home in ((0, 1.0, "mnist"), (5, 1.0, "street"), (4, 0.2, "mnist")):
            for dom, acc in zip(DOMAINS, (0.8, 0.6)):
                cost = (0.3 if tier < 1 else 0.1) if private else 0.0
                rows.append({"run_id": r["run_id"], "client": cid, "tier": tier, "home": home, "domain": dom,
                             "accuracy": acc - (0.1 if tier < 1 else 0.0) - cost + 0.01 * r["seed"]})
    return pd.DataFrame(rows)


def test_run_table_reads_the_final_round_and_the_dp_columns():
    t = privacy.run_table(_res()).set_index("run_id")
    off, on = t.loc["heterofl-inf-s1"], t.loc["heterofl-eps8-coverage-s0"]
    assert (off["method"], off["epsilon"], off["denominator"], off["variant"]) == ("heterofl", math.inf, "", "heterofl-inf")
    assert (on["epsilon"], on["denominator"], on["variant"]) == (8.0, "coverage", "heterofl-eps8-coverage")
    assert off["global"] == pytest.approx(0.72) and on["global"] == pytest.approx(0.5)
    assert on["global_mnist"] == pytest.approx(0.6) and on["deployed_street"] == pytest.approx(0.4)
    assert on["snr_shared"] == pytest.approx(1.5) and on["snr_partial"] == pytest.approx(0.75)  # mean over rounds
    assert on["sigma"] == pytest.approx(1.5) and on["clipped"] == pytest.approx(0.25)
    assert np.isnan(off["snr_shared"]) and np.isnan(off["clipped"]) and off["wall_s"] == 11.0
    v = privacy.variant_table(privacy.run_table(_res())).set_index("variant")
    assert v.loc["heterofl-inf", "global_mean"] == pytest.approx(0.71)
    assert v.loc["heterofl-inf", "global_std"] == pytest.approx(np.std([0.7, 0.72], ddof=1))
    assert v.loc["heterofl-eps8-coverage", "seeds"] == 2


def test_tier_figures_average_over_test_domains_then_seeds_and_the_drop_is_per_tier(tmp_path):
    per_run = privacy.run_table(_res())
    per_client = _per_client(per_run)
    tiers = privacy.tier_table(per_client, per_run).set_index(["variant", "tier"])
    assert tiers.loc[("heterofl-inf", 1.0), "accuracy_mean"] == pytest.approx(0.705)  # (0.8 + 0.6) / 2 + seeds' 0.005
    assert tiers.loc[("heterofl-eps8-coverage", 0.2), "accuracy_mean"] == pytest.approx(0.305)
    assert tiers.loc[("heterofl-inf", 1.0), "clients"] == 4  # two clients a run, two seeds
    by_dom = privacy.tier_table(per_client, per_run, by_domain=True).set_index(["variant", "tier", "domain"])
    assert by_dom.loc[("heterofl-eps8-coverage", 0.2, "street"), "accuracy_mean"] == pytest.approx(0.205)
    gaps = privacy.tier_gaps(privacy.tier_table(per_client, per_run)).set_index("tier")
    assert gaps.loc[0.2, "drop_mean"] == pytest.approx(0.3) and gaps.loc[1.0, "drop_mean"] == pytest.approx(0.1)
    text = privacy.report("folder", {"runs": per_run, "variants": privacy.variant_table(per_run),
                                     "clients": per_client, "tiers": privacy.tier_table(per_client, per_run),
                                     "tier_domains": privacy.tier_table(per_client, per_run, by_domain=True)})
    assert "| heterofl | 8 | coverage | 10.0 ± 1.0 | 30.0 ± 1.0 |" in text  # the drops (points), widest tier first
    assert "| heterofl | ∞ | – | 70.5 ± 0.7 | 60.5 ± 0.7 |" in text  # the tiers at epsilon infinity
    fig = privacy.plot_tiers(privacy.tier_table(per_client, per_run), tmp_path / "tiers.png")
    assert (tmp_path / "tiers.png").stat().st_size > 0 and len(fig.axes) == 1
    with pytest.raises(privacy.sweep.MissingData):
        privacy.plot_tiers(privacy.tier_table(per_client, per_run).query("epsilon == inf"))
