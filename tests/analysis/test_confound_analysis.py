"""analysis.confound: the papers/003 tables (3-6, Figure 6, Table 1) from hand-built results."""
from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis import confound as cf
from analysis.runs import annotate_runs
from fedsap_ray import results

G = "__global__"


def run_row(run_id: str, algorithm: str, seed: int, options: dict | None = None, dataset: str = "cifar10",
            status: str = "finished") -> dict:
    cfg = {"algorithm": {"name": algorithm, "options": options or {}}}
    return {"run_id": run_id, "study": "confound", "algorithm": algorithm, "dataset": dataset, "seed": seed,
            "config_json": json.dumps(cfg), "status": status}


def round_rows(run_id: str, accs: list, caps: list, frozen: list | None = None) -> list[dict]:
    """__global__ rows (plus a decoy domain row whose accuracy must be ignored); None = not evaluated."""
    rows = []
    for t, (a, c) in enumerate(zip(accs, caps), start=1):
        ev = a is not None
        base = {"run_id": run_id, "round": t, "eval_mode": "global", "evaluated": ev, "avg_capacity": c,
                "frozen_params": None if frozen is None else frozen[t - 1], "bytes_up": 10}
        rows.append({**base, "domain": G, "accuracy": a, "global_accuracy": a,
                     "best_global_accuracy": None})
        rows.append({**base, "domain": "d0", "accuracy": 0.99 if ev else None, "global_accuracy": None,
                     "best_global_accuracy": None})
    return rows


def make_results(runs: list[dict], rounds: list[dict], clients: list[dict] | None = None,
                 allocations: list[dict] | None = None) -> SimpleNamespace:
    return SimpleNamespace(runs=pd.DataFrame(runs), rounds=pd.DataFrame(rounds),
                           clients=pd.DataFrame(clients or []), allocations=pd.DataFrame(allocations or []))


# ----------------------------------------------------------------------------- correlations

def test_partial_correlation_matches_closed_form_and_hand_p_value() -> None:
    rng = np.random.default_rng(3)
    n = 40
    z = rng.normal(size=n)
    x = 0.6 * z + rng.normal(size=n)
    y = -0.4 * z + 0.5 * x + rng.normal(size=n)
    rxy, rxz, ryz = (np.corrcoef(a, b)[0, 1] for a, b in ((x, y), (x, z), (y, z)))
    closed = (rxy - rxz * ryz) / math.sqrt((1 - rxz ** 2) * (1 - ryz ** 2))
    c = cf.partial_corr(x, y, z)
    assert c.r == pytest.approx(closed, abs=1e-12)
    assert c.n == n
    df = n - 2 - 1
    t = closed * math.sqrt(df / (1 - closed ** 2))
    assert c.pvalue == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-10)
    half = 1.959963984540054 / math.sqrt(n - 3 - 1)
    assert c.ci_low == pytest.approx(math.tanh(math.atanh(closed) - half), rel=1e-9)
    assert c.ci_high == pytest.approx(math.tanh(math.atanh(closed) + half), rel=1e-9)
    # plain Pearson agrees with numpy and has scipy's Fisher interval
    p = cf.pearson(x, y)
    assert p.r == pytest.approx(rxy, abs=1e-12)
    half0 = 1.959963984540054 / math.sqrt(n - 3)
    assert p.ci_low == pytest.approx(math.tanh(math.atanh(rxy) - half0), rel=1e-6)


def _tiered(seed: int, n: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """p at its tier cap for most clients (a step function of p_max, not a line), TV unrelated to p within a tier."""
    rng = np.random.default_rng(seed)
    pmax = rng.choice([0.25, 0.5, 0.75, 1.0], size=n, p=[0.35, 0.35, 0.15, 0.15])
    tier_mean_tv = {0.25: 0.2, 0.5: 0.6, 0.75: 0.1, 1.0: 0.5}  # tier means off any line in p_max
    tv = np.array([tier_mean_tv[v] for v in pmax]) + 0.05 * rng.normal(size=n)
    p = np.minimum(pmax, 0.4 + 0.05 * rng.normal(size=n)).clip(0.1)
    p[pmax <= 0.5] = pmax[pmax <= 0.5]  # capped clients sit exactly at p_max
    return p, tv, pmax


def test_partial_correlation_tier_dummies_match_statsmodels_ols() -> None:
    """Issue 14 item 2: r(p, TV | tier) equals the correlation of statsmodels OLS residuals on C(tier), and
    its p-value the t-test of p's coefficient in OLS TV ~ p + C(tier) (df = n - 2 - (tiers - 1))."""
    sm = pytest.importorskip("statsmodels.formula.api")
    for seed in range(4):
        p, tv, pmax = _tiered(seed)
        df = pd.DataFrame({"p": p, "tv": tv, "tier": pmax})
        rp = sm.ols("p ~ C(tier)", df).fit().resid
        rt = sm.ols("tv ~ C(tier)", df).fit().resid
        c = cf.partial_corr(p, tv, pmax, control="tiers")
        assert c.r == pytest.approx(np.corrcoef(rp, rt)[0, 1], abs=1e-10)
        fit = sm.ols("tv ~ p + C(tier)", df).fit()
        assert c.pvalue == pytest.approx(float(fit.pvalues["p"]), rel=1e-8)
        k = len(np.unique(pmax)) - 1
        assert fit.df_resid == len(p) - 2 - k
        half = stats.norm.ppf(0.975) / math.sqrt(len(p) - 3 - k)
        assert c.ci_low == pytest.approx(math.tanh(math.atanh(c.r) - half), rel=1e-9)
        # the linear form is statsmodels' OLS on p_max as a number
        lin = cf.partial_corr(p, tv, pmax, control="linear")
        fl = sm.ols("tv ~ p + tier", df).fit()
        assert lin.pvalue == pytest.approx(float(fl.pvalues["p"]), rel=1e-8)


def test_tier_control_removes_the_spurious_linear_partial_correlation() -> None:
    """Issue 14 item 2: tier means that are not linear in p_max make r(p, TV | p_max) look significant under
    the linear control; the tier dummies (Table 5's default) remove it."""
    p, tv, pmax = _tiered(0, n=60)
    lin, tiers = cf.partial_corr(p, tv, pmax, control="linear"), cf.partial_corr(p, tv, pmax, control="tiers")
    assert lin.pvalue < 0.01 and abs(lin.r) > 0.4
    assert abs(tiers.r) < abs(lin.r) and tiers.pvalue > 0.01
    with pytest.raises(ValueError, match="control"):
        cf.partial_corr(p, tv, pmax, control="cubic")


def test_partial_correlation_known_answers_and_constant_inputs() -> None:
    rng = np.random.default_rng(0)
    n = 500
    z = rng.normal(size=n)
    x = z + 0.5 * rng.normal(size=n)
    y = z + 0.5 * rng.normal(size=n)
    assert cf.pearson(x, y).r > 0.7           # a common cause makes x and y look related ...
    assert abs(cf.partial_corr(x, y, z).r) < 0.2  # ... and controlling for it removes the relation
    y2 = x + z
    assert cf.partial_corr(x, y2, z).r > 0.9
    assert cf.partial_corr(x, y2, z).pvalue < 1e-6
    # constant inputs (e.g. every p_max equal) give NaN, no exception and no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        const = np.full(n, 0.5)
        assert math.isnan(cf.pearson(x, const).r)
        assert math.isnan(cf.partial_corr(x, y, const).r)
        assert math.isnan(cf.partial_corr(const, y, z).pvalue)
        assert math.isnan(cf.partial_corr(2 * z + 1, y, z).r)  # x is a function of the control
        assert math.isnan(cf.pearson([1.0, 2.0], [3.0, 1.0]).r)  # too few observations
    # missing values are dropped pairwise
    xm = x.copy()
    xm[:10] = np.nan
    assert cf.pearson(xm, y).n == n - 10
    assert cf.pearson(xm, y).r == pytest.approx(np.corrcoef(x[10:], y[10:])[0, 1])


# ----------------------------------------------------------------------------- per run / summary

def two_seed_results() -> SimpleNamespace:
    stale = round_rows("b", [0.3, 0.8, 0.75, 0.95], [0.3, 0.4, 0.5, 0.6], [0, 0, 0, 0])
    for r in stale[6:]:
        r["evaluated"] = False  # round 4 skipped by eval_every: its (stale) accuracy must be ignored
    runs = [run_row("a", "hasfl", 1), run_row("b", "hasfl", 2),
            run_row("c", "hasfl", 1, {"coverage": False}), run_row("d", "fedavg", 1),
            run_row("e", "fedavg", 2, {"width": "capacity"}), run_row("f", "fedprox", 1, status="failed")]
    rounds = (round_rows("a", [0.5, 0.7, 0.6], [0.4, 0.5, 0.6], [100, 50, 10])
              + stale
              + round_rows("c", [0.4, 0.6, 0.2], [0.5, 0.5, 0.5], [300, 300, 300])
              + round_rows("d", [0.6, 0.9], [1.0, 1.0], [0, 0]))
    return make_results(runs, rounds)


def test_variant_labels() -> None:
    pr = cf.per_run(two_seed_results()).set_index("run_id")
    assert pr["variant"].to_dict() == {"a": "HAS-FL", "b": "HAS-FL", "c": "HAS-FL (no coverage)", "d": "FedAvg",
                                      "e": "FedAvg (capacity width)", "f": "FedProx"}
    def variant(row: dict) -> str:  # variant_of reads a runs-table row: config.* columns, as results.load gives
        return cf.variant_of(annotate_runs(pd.DataFrame([row])).iloc[0])

    assert variant(run_row("x", "random_budget", 1)) == "Random-budget"
    assert variant(run_row("x", "hasfl", 1, {"coverage": "false"})) == "HAS-FL (no coverage)"
    assert variant(run_row("x", "hasfl", 1, {"coverage": True})) == "HAS-FL"
    assert variant(run_row("x", "newalgo", 1)) == "newalgo"


def test_per_run_and_summary_hand_computed() -> None:
    pr = cf.per_run(two_seed_results()).set_index("run_id")
    a, b = pr.loc["a"], pr.loc["b"]
    assert (a.best_accuracy, a.final_accuracy) == pytest.approx((0.7, 0.6))
    assert a.peak_to_final == pytest.approx(-0.1)
    assert a.avg_p == pytest.approx(0.5)
    assert a.final_frozen_params == 10
    assert (b.best_accuracy, b.final_accuracy) == pytest.approx((0.8, 0.75))  # round 4 was not evaluated
    assert b.peak_to_final == pytest.approx(-0.05)
    assert b.avg_p == pytest.approx(0.45)                                      # every round counts for p
    assert b.rounds == 4
    assert math.isnan(pr.loc["e"].best_accuracy)                               # a run without rounds
    st = cf.summary_table(pr.reset_index(), ["HAS-FL", "FedAvg"]).set_index("variant")
    h = st.loc["HAS-FL"]
    assert h.seeds == 2
    assert h.best_mean == pytest.approx(0.75) and h.best_std == pytest.approx(np.std([0.7, 0.8], ddof=1))
    assert h.final_mean == pytest.approx(0.675) and h.final_std == pytest.approx(np.std([0.6, 0.75], ddof=1))
    assert h.drop_mean == pytest.approx(-0.075)
    assert h.avg_p_mean == pytest.approx(0.475)
    assert list(st.index) == ["HAS-FL", "FedAvg"]
    cov = cf.coverage_table(pr.reset_index()).set_index("variant")
    assert list(cov.index) == ["HAS-FL", "HAS-FL (no coverage)"]
    assert cov.loc["HAS-FL", "frozen_mean"] == pytest.approx(5.0)
    assert cov.loc["HAS-FL (no coverage)", "drop_mean"] == pytest.approx(-0.4)
    md = cf.to_markdown(cf.summary_table(pr.reset_index(), ["HAS-FL", "FedAvg"]))
    assert "| cifar10 | HAS-FL | 2 | 75.0 ± 7.1 | 67.5 ± 10.6 | -7.5 ± 3.5 | 0.47 ± 0.04 |" in md


def test_matched_budget_paired_difference() -> None:
    pr = pd.DataFrame({
        "dataset": ["c"] * 7, "variant": ["HAS-FL"] * 4 + ["Random-budget"] * 3, "seed": [1, 2, 3, 4, 1, 2, 3],
        "final_accuracy": [0.70, 0.75, 0.80, 0.9, 0.71, 0.70, 0.78],
        "avg_p": [0.52, 0.50, 0.54, 0.5, 0.49, 0.48, 0.50]})
    mb = cf.matched_budget(pr)
    per_seed = mb[mb["seed"] != "mean"]
    assert list(per_seed["seed"]) == [1, 2, 3]   # seed 4 has no Random-budget partner
    assert per_seed["diff"].to_numpy() == pytest.approx([-0.01, 0.05, 0.02])
    assert per_seed["avg_p_b"].to_numpy() == pytest.approx([0.49, 0.48, 0.50])
    s = mb[mb["seed"] == "mean"].iloc[0]
    assert s["diff"] == pytest.approx(0.02)
    assert s["diff_std"] == pytest.approx(np.std([-0.01, 0.05, 0.02], ddof=1))
    assert s["n_pairs"] == 3
    assert s["p_value"] == pytest.approx(stats.ttest_rel([0.70, 0.75, 0.80], [0.71, 0.70, 0.78]).pvalue)
    one = cf.matched_budget(pr[pr["seed"] == 1])
    assert math.isnan(one[one["seed"] == "mean"].iloc[0]["p_value"])


# ----------------------------------------------------------------------------- Table 5

def alloc_rows(run_id: str, t: int, h: list, p: list, pmax: list, tv: list) -> list[dict]:
    return [{"run_id": run_id, "round": t, "client_id": i, "capacity_max": pmax[i], "p": p[i], "h_hat": None,
             "h_tilde": h[i], "tv_distance": tv[i], "adapted": t % 2 == 0} for i in range(len(h))]


TV = [0.1, 0.5, 0.2, 0.7, 0.3, 0.9]
PMAX = [0.25, 0.25, 0.5, 0.5, 1.0, 1.0]


def test_correlation_table_uses_the_last_allocation_round() -> None:
    allocs = (alloc_rows("a", 2, [3 * v + 1 for v in TV], [0.2, 0.25, 0.4, 0.5, 0.6, 1.0], PMAX, TV)
              + alloc_rows("a", 1, [1.0, 0.9, 1.3, 0.2, 1.1, 0.4], [0.25] * 6, PMAX, TV))
    clients = [{"run_id": "b", "round": t, "client_id": i, "capacity_max": PMAX[i], "capacity_used": PMAX[i],
                "h_tilde": (TV[i] if t == 3 else -TV[i]), "tv_distance": TV[i]} for t in (3, 1) for i in range(6)]
    res = make_results([run_row("a", "hasfl", 42), run_row("b", "hasfl", 43)], [], clients, allocs)
    ct = cf.correlation_table(res).set_index("run_id")
    a = ct.loc["a"]
    assert a["source"] == "allocations" and a["round"] == 2 and a["n"] == 6
    assert a["r_H_TV"] == pytest.approx(1.0)
    assert a["r_H_TV|pmax"] == pytest.approx(1.0)
    assert a["r_H_pmax"] == pytest.approx(np.corrcoef(TV, PMAX)[0, 1])
    assert a["n_H_TV"] == 6 and a["pval_H_TV"] < 1e-6
    # the clients-table fallback takes each client's last row (round 3 here)
    b = ct.loc["b"]
    assert b["source"] == "clients" and b["round"] == 3
    assert b["r_H_TV"] == pytest.approx(1.0)
    assert math.isnan(b["r_p_TV|pmax"])  # p == p_max exactly: nothing left after controlling for it


def test_correlation_table_reads_a_results_folder(tmp_path, monkeypatch, capsys) -> None:
    for name, rows in (("runs", [run_row("a", "hasfl", 42)]),
                       ("rounds", round_rows("a", [0.5, 0.6], [0.5, 0.5], [3, 1])),
                       ("allocations", alloc_rows("a", 1, [1.0, 0.9, 1.3, 0.2, 1.1, 0.4], [0.25] * 6, PMAX, TV)
                        + alloc_rows("a", 2, [-v for v in TV], PMAX, PMAX, TV))):
        rows = [{"schema_version": results.SCHEMA_VERSION, **r} for r in rows]  # as a run writes them
        results.write_atomic(results.to_table(name, rows), tmp_path / name / "a.parquet")
    ct = cf.correlation_table(tmp_path)
    assert len(ct) == 1 and ct.iloc[0]["round"] == 2
    assert ct.iloc[0]["r_H_TV"] == pytest.approx(-1.0)
    cf.main([str(tmp_path), "--all"])
    printed = capsys.readouterr().out
    assert "## Do the estimates measure data heterogeneity? (Table 5)" in printed
    assert "| cifar10 | HAS-FL | 42 | allocations | 2 | 6 | -1.00 [-1.00, -1.00] (p=0) |" in printed
    pr = cf.per_run(str(tmp_path))
    assert pr.iloc[0]["final_frozen_params"] == 1 and pr.iloc[0]["best_accuracy"] == pytest.approx(0.6)
    # a results.load without the allocations table: read allocations/ from the folder directly
    real_load = cf.results.load
    monkeypatch.setattr(cf.results, "load", lambda p: SimpleNamespace(
        **{t: getattr(real_load(p), t) for t in ("runs", "rounds", "clients")}))
    assert cf.correlation_table(tmp_path).iloc[0]["r_H_TV"] == pytest.approx(-1.0)
    (tmp_path / "allocations" / "a.parquet").unlink()
    assert cf.correlation_table(tmp_path).empty  # no allocations and no clients rows: no Table 5 rows


# ----------------------------------------------------------------------------- Table 1, Figure 6, report

def test_cost_table_reproduces_papers003_table1_cnn_cifar() -> None:
    t = cf.cost_table("cnn_cifar", (3, 32, 32), 10)
    assert list(t["p"]) == [0.25, 0.5, 0.75, 1.0]
    assert [round(v, 2) for v in t["params_M"]] == [0.21, 0.82, 1.83, 3.25]
    assert [round(v, 1) for v in t["macs_M"]] == [10.0, 39.2, 87.4, 154.9]
    assert [round(v, 2) for v in t["upload_MB"]] == [0.82, 3.26, 7.32, 13.00]


def test_plot_frontier_writes_a_png(tmp_path) -> None:
    fr = cf.frontier(cf.per_run(two_seed_results()))
    assert set(fr["variant"]) >= {"HAS-FL", "FedAvg"}
    out = cf.plot_frontier(fr.dropna(subset=["final_mean"]), tmp_path / "fig" / "frontier.png")
    data = out.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_has_sections_for_present_variants() -> None:
    runs, rounds, allocs = [], [], []
    for s in (1, 2):
        for algo, accs, cap in (("hasfl", [0.5, 0.7], 0.5), ("random_budget", [0.5, 0.68], 0.48),
                                ("fedavg", [0.7, 0.9], 1.0)):
            rid = f"{algo}{s}"
            runs.append(run_row(rid, algo, s))
            rounds += round_rows(rid, accs, [cap, cap], [0, 0])
            if algo != "fedavg":
                allocs += alloc_rows(rid, 2, [v + 0.1 * s for v in TV], PMAX, PMAX, TV)
    md = cf.report(make_results(runs, rounds, allocations=allocs))
    assert "## Comparison with full-model methods (Table 6)" in md
    assert "## Matched-budget control (section 4.4)" in md
    assert "## Do the estimates measure data heterogeneity? (Table 5)" in md
    assert "## Accuracy-capacity frontier (Figure 6)" in md
    assert "Table 3" not in md and "Table 4" not in md  # FjORD / Uniform / no-coverage runs are absent
    assert "| cifar10 | HAS-FL | Sub-model (adaptive) | 2 | 70.0 ± 0.0 | 70.0 ± 0.0 | 0.50 ± 0.00 |" in md
    assert "| cifar10 | mean | 70.0 | 68.0 | 2.0 | 0.50 | 0.48 |" in md
    assert "| cifar10 | HAS-FL | 1 | allocations | 2 | 6 | 1.00 [1.00, 1.00] (p=0) |" in md


def test_widest_width_late_in_the_run_from_the_clients_table() -> None:
    """Mean over the last LATE_ROUNDS rounds of the widest width a participant trained (hand-computed)."""
    last = cf.LATE_ROUNDS + 2
    clients = []
    for t in range(1, last + 1):
        widths = [1.0, 0.25] if t <= 2 else ([0.6, 0.25] if t % 2 else [0.5, 0.4])
        clients += [{"run_id": "a", "round": t, "client_id": i, "capacity_used": w} for i, w in enumerate(widths)]
    res = make_results([run_row("a", "hasfl", 1, {"coverage": False})],
                       round_rows("a", [0.5] * last, [0.5] * last, [0] * last), clients)
    pr = cf.per_run(res).set_index("run_id")
    late = [0.6 if t % 2 else 0.5 for t in range(3, last + 1)]  # rounds 1-2 (width 1.0) are not late
    assert pr.loc["a", "widest_p_late"] == pytest.approx(np.mean(late))


# ----------------------------------------------------------------------------- issue 14

def _cfg_run(run_id: str, algorithm: str, seed: int, options: dict | None = None, **cfg) -> dict:
    """A runs row whose config_json holds more than the algorithm (rounds, width, ...)."""
    row = run_row(run_id, algorithm, seed, options)
    full = {"algorithm": {"name": algorithm, "options": options or {}}, "seed": seed, "study": "confound",
            "training": {"rounds": cfg.get("rounds", 30), "eval_every": cfg.get("eval_every", 1)},
            "model": {"name": "cnn_cifar", "width_mult": cfg.get("width_mult", 0.5)}}
    row["config_json"] = json.dumps(full)
    return row


def test_eval_every_2_report_keeps_accuracies_and_matched_budget() -> None:
    """Issue 14 item 1: rounds skipped by eval_every carry no eval mode; Table 3 and the matched budget stay filled."""
    runs, rounds = [], []
    for s in (1, 2):
        for algo, accs in (("hasfl", [None, 0.5, None, 0.7]), ("random_budget", [None, 0.4, None, 0.6]),
                           ("fjord", [None, 0.3, None, 0.5])):
            rid = f"{algo}{s}"
            runs.append(_cfg_run(rid, algo, s, eval_every=2))
            rr = round_rows(rid, accs, [0.5] * 4)
            for r in rr:
                if not r["evaluated"]:
                    r["eval_mode"] = None  # as the server writes a skipped round
            rounds += rr
    md = cf.report(make_results(runs, rounds))
    assert "| cifar10 | HAS-FL | 2 | 70.0 ± 0.0 | 70.0 ± 0.0 | 0.50 ± 0.00 |" in md
    assert "| cifar10 | mean | 70.0 | 60.0 | 10.0 |" in md
    assert "no run reached the adaptation phase (warm-up R=10" in md  # 4 rounds < the first step after round 10


def test_summary_table_splits_runs_with_different_configurations() -> None:
    """Issue 14 item 3: a 2-round full-width and a 30-round half-width HAS-FL run of one seed are not pooled."""
    runs = [_cfg_run("short", "hasfl", 0, rounds=2, width_mult=1.0), _cfg_run("long", "hasfl", 0, rounds=30),
            _cfg_run("fj", "fjord", 0, rounds=30)]
    rounds = round_rows("short", [0.1, 0.2], [0.5, 0.5]) + round_rows("long", [0.5, 0.8], [0.5, 0.5]) \
        + round_rows("fj", [0.5, 0.6], [0.4, 0.4])
    pr = cf.per_run(make_results(runs, rounds))
    with pytest.warns(UserWarning, match=r"model\.width_mult, training\.rounds"):
        t = cf.summary_table(pr, metrics=("final",))
    has = t[t["variant"] == "HAS-FL"]
    assert len(has) == 2 and sorted(has["final_mean"]) == pytest.approx([0.2, 0.8])
    assert set(has["config"]) == {"model.width_mult=1.0, training.rounds=2", "model.width_mult=0.5, training.rounds=30"}
    assert t.loc[t["variant"] == "FjORD", "config"].tolist() == [""]
    md = cf.report(make_results(runs, rounds))
    assert "**Warning:** runs of one group differ beyond the seed" in md and "cifar10 / HAS-FL: model.width_mult" in md
    # uniform configurations: no config column, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "config" not in cf.summary_table(pr[pr["run_id"] != "short"]).columns


def test_table5_p_is_the_allocation_of_the_final_estimates() -> None:
    """Issue 14 item 7: the allocations row of round T holds H~ after round T but the width used IN round T;
    Table 5's p is Eq. 6 (+ coverage) of that final H~, the same round."""
    from fedsap_ray.algorithms.hasfl import allocation_rule

    h = [0.4, 1.6, 0.7, 1.3, 0.9, 1.1]
    stale = [0.25, 0.25, 0.5, 0.45, 1.0, 1.0]
    allocs = alloc_rows("a", 10, h, stale, PMAX, TV) + alloc_rows("r", 10, h, stale, PMAX, TV)
    res = make_results([run_row("a", "hasfl", 0), run_row("r", "random_budget", 0)], [], allocations=allocs)
    st = cf.final_state(res).set_index(["run_id", "client_id"]).sort_index()
    want = allocation_rule(np.array(h), np.array(PMAX), 0.4, 0.25, 1e-8, True)
    np.testing.assert_allclose(st.loc["a", "p"].to_numpy(), want)
    assert not np.allclose(want, stale)
    assert st.loc["a", "p_round"].tolist() == stale and st.loc["r", "p"].tolist() == stale  # random draws: as used


def test_table5_before_the_first_adaptation_step_says_why() -> None:
    """Issue 14 item 7: a folder of pre-warm-up runs prints why Table 5 is empty."""
    runs = [run_row("a", "hasfl", 0), run_row("b", "fjord", 0)]
    rounds = round_rows("a", [0.3, 0.4], [0.5, 0.5]) + round_rows("b", [0.3, 0.4], [0.5, 0.5])
    allocs = alloc_rows("a", 2, [1.0] * 6, PMAX, PMAX, TV)
    md = cf.report(make_results(runs, rounds, allocations=allocs))
    assert "## Do the estimates measure data heterogeneity? (Table 5)" in md
    assert "Table 5: no run reached the adaptation phase (warm-up R=10, T_adapt=5: first step after round 10; " \
           "the runs stopped at round 2)" in md
    assert "matched-budget control: no finished Random-budget runs" in md


def test_main_on_a_missing_folder_exits_2_without_traceback(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cf.main([str(tmp_path / "nope")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and "nope" in err and "Traceback" not in err
