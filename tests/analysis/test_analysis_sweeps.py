"""analysis.sweep / sensitivity / ablation / plots on small hand-built Results (numbers computed by hand)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import ablation, comparison, plots, sensitivity, sweep
from analysis import confound, labels, runs
from fedsap_ray import results

G = results.GLOBAL_DOMAIN
DOMAINS = ("mnist", "svhn")


def run_row(run_id: str, algorithm: str, seed: int, status: str = "finished", study: str = "s", **options) -> dict:
    cfg = {"algorithm": {"name": algorithm, "options": options}, "study": study, "seed": seed}
    return {"run_id": run_id, "study": study, "algorithm": algorithm, "dataset": "digits", "seed": seed,
            "config_json": json.dumps(cfg), "status": status}


def round_rows(run_id: str, accs: list, modes: tuple[str, ...] = ("global",), domain_accs: dict | None = None,
               dga: list | None = None) -> list[dict]:
    """Global rows per round and mode (None = not evaluated); the second mode's rows are a decoy 0.99.
    ``domain_accs`` gives each domain's accuracy per round; ``dga`` (n_groups, ari_domain, ari_capacity)
    per round or None on non-DGA rounds."""
    rows = []
    for t, a in enumerate(accs, start=1):
        n, ad, ac = (dga[t - 1] or (None, None, None)) if dga else (None, None, None)
        for i, mode in enumerate(modes):
            acc = a if i == 0 or a is None else 0.99
            base = {"run_id": run_id, "round": t, "eval_mode": mode, "evaluated": a is not None,
                    "n_groups": n, "ari_domain": ad, "ari_capacity": ac}
            for d in DOMAINS:
                da = (domain_accs or {}).get(d, [a] * len(accs))[t - 1]
                rows.append({**base, "domain": d, "accuracy": None if a is None else (da if i == 0 else 0.99)})
            rows.append({**base, "domain": G, "accuracy": acc, "global_accuracy": acc})
    return rows


def make(runs: list[dict], rounds: list[dict], clients: list[dict] = (), layers: list[dict] = (),
         allocations: list[dict] = ()) -> results.Results:
    """A Results typed exactly as results.load returns it."""
    def frame(name, rows):
        return results.to_table(name, [{"schema_version": 2, **r} for r in rows]).to_pandas()
    return results.Results(frame("runs", runs), frame("rounds", rounds), frame("clients", list(clients)),
                           frame("layers", list(layers)), frame("allocations", list(allocations)))


def sample_std(*xs: float) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


# ----------------------------------------------------------------------------- loading and per-run accuracy

def test_load_sweep_labels_variants_and_resolves_options_from_the_config(tmp_path) -> None:
    rows = {"runs": [run_row("ref-s0", "fedsap_fixed", 0), run_row("g_target=0.5-s12", "fedsap_fixed", 12, g_target=0.5),
                     run_row("main-s3", "fedsap", 3, study="other"), run_row("odd", "fedavg", 1, width="capacity")],
            "rounds": round_rows("ref-s0", [0.5])}
    for name, rs in rows.items():  # through a real folder (one file per run), as a notebook reads it
        for run_id in {r["run_id"] for r in rs}:
            mine = [{"schema_version": 2, **r} for r in rs if r["run_id"] == run_id]
            results.write_atomic(results.to_table(name, mine), tmp_path / name / f"{run_id}.parquet")
    s = sweep.load_sweep(tmp_path)
    runs = s.runs.set_index("run_id")
    assert runs.loc["g_target=0.5-s12", "variant"] == "g_target=0.5" and runs.loc["odd", "variant"] == "odd"
    # stored options only hold what was set; the columns are resolved against each strategy's own defaults
    assert runs.loc["ref-s0", "opt_g_target"] == 0.9 and runs.loc["ref-s0", "opt_tau_var"] == 0.1
    assert runs.loc["g_target=0.5-s12", "opt_g_target"] == 0.5
    assert runs.loc["main-s3", "opt_tau_var"] == 0.05 and runs.loc["main-s3", "opt_masks"] == "dynamic"
    assert runs.loc["odd", "opt_width"] == "capacity" and pd.isna(runs.loc["ref-s0", "opt_width"])
    # an option this version rejects keeps its stored value, over the strategy's defaults
    assert sweep.resolved_options("fedsap_fixed", {"retired": 1})["retired"] == 1
    assert sweep.resolved_options("fedsap_fixed", {"retired": 1})["g_target"] == 0.9
    other = sweep.load_sweep(s, study="other")
    assert list(other.runs["run_id"]) == ["main-s3"] and other.rounds.empty
    j = sweep.joined(s, "rounds", ("variant", "seed"))
    assert set(j["variant"]) == {"ref"} and (j["seed"] == 0).all()


def test_locate_finds_a_relative_folder_under_the_repository_root(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert sweep.locate("analysis") == str(Path(runs.__file__).resolve().parents[1] / "analysis")
    assert sweep.locate("s3://bucket/runs") == "s3://bucket/runs"
    assert sweep.locate("no/such/folder") == "no/such/folder"


def test_per_run_accuracy_reads_the_primary_mode_up_to_the_last_evaluated_round() -> None:
    res = make([run_row("a-s0", "fedsap", 0), run_row("b-s0", "fedavg", 0), run_row("c-s0", "fedavg", 0, status="running")],
               round_rows("a-s0", [0.4, 0.7, 0.6, None], modes=("group", "global_only"),
                          domain_accs={"mnist": [0.9, 0.5, 0.95, None], "svhn": [0.2, 0.8, 0.3, None]})
               + round_rows("b-s0", [0.3, 0.2]))
    pr = runs.per_run(res).set_index("run_id")
    assert pr.loc["a-s0", "best_global_accuracy"] == pytest.approx(0.7)   # not the 0.99 decoy mode
    assert pr.loc["a-s0", "final_global_accuracy"] == pytest.approx(0.6)  # round 4 was not evaluated
    assert pr.loc["b-s0", "best_global_accuracy"] == pytest.approx(0.3)
    assert pr.loc["b-s0", "final_global_accuracy"] == pytest.approx(0.2)
    assert np.isnan(pr.loc["c-s0", "best_global_accuracy"]) and pr.loc["a-s0", "variant"] == "a"
    best = sweep.domain_best(res.rounds)
    assert list(best.columns) == [*DOMAINS, "global"]
    assert best.loc["a-s0", "mnist"] == pytest.approx(0.95) and best.loc["a-s0", "svhn"] == pytest.approx(0.8)
    # the refactored callers read the same numbers
    cf = confound.per_run(res).set_index("run_id")
    assert cf.loc["a-s0", "best_accuracy"] == pytest.approx(0.7)
    assert cf.loc["a-s0", "final_accuracy"] == pytest.approx(0.6)
    cmp = comparison.per_run(res).set_index("run_id")
    assert cmp.loc["a-s0", "global"] == pytest.approx(0.7) and cmp.loc["a-s0", "final_global"] == pytest.approx(0.6)
    assert cmp.loc["a-s0", "mnist"] == pytest.approx(0.95) and "c-s0" not in cmp.index


def test_comparison_reports_the_deployed_models_and_the_compute_beside_the_global_model(tmp_path) -> None:
    """Deployed best/final/worst client from the 'deployed' global rows only; GMACs from clients.train_macs."""
    runs = [run_row("a-s0", "heterofl", 0), run_row("a-s1", "heterofl", 1)]
    rounds = round_rows("a-s0", [0.5, 0.6]) + round_rows("a-s1", [0.7, 0.8])
    for rid, accs, worst in (("a-s0", [0.3, 0.2], 0.1), ("a-s1", [0.4, 0.5], 0.25)):
        for t, a in enumerate(accs, start=1):
            rounds.append({"run_id": rid, "round": t, "eval_mode": "deployed", "evaluated": True, "domain": G,
                           "accuracy": a, "global_accuracy": a, "worst_client_accuracy": worst if t == 2 else 0.0})
            rounds.append({"run_id": rid, "round": t, "eval_mode": "deployed", "evaluated": True, "domain": "mnist",
                           "accuracy": 0.99, "global_accuracy": a})  # a domain row: never the global figure
    clients = [{"run_id": "a-s0", "round": 1, "client_id": 0, "train_macs": 2_000_000_000},
               {"run_id": "a-s0", "round": 1, "client_id": 1, "train_macs": 4_000_000_000},
               {"run_id": "a-s1", "round": 1, "client_id": 0, "train_macs": 3_000_000_000}]
    res = make(runs, rounds, clients)
    pr = comparison.per_run(res).set_index("run_id")
    assert pr.loc["a-s0", "global"] == pytest.approx(0.6)  # the primary mode, not the deployed rows
    assert pr.loc["a-s0", "deployed"] == pytest.approx(0.3) and pr.loc["a-s0", "deployed_final"] == pytest.approx(0.2)
    assert pr.loc["a-s0", "worst_client"] == pytest.approx(0.1)
    assert pr.loc["a-s0", "train_gmacs"] == pytest.approx(3.0) and pr.loc["a-s0", "max_train_gmacs"] == pytest.approx(4.0)
    t = comparison.table1(res).loc["heterofl"]
    assert t["deployed"] == pytest.approx(0.4) and t["deployed_std"] == pytest.approx(sample_std(0.3, 0.5))
    assert t["train_gmacs"] == pytest.approx(3.0) and t["max_train_gmacs"] == pytest.approx(4.0)
    md = comparison.to_markdown(comparison.table1(res))
    assert "| 40.00 ± 14.14 | 35.00 | 17.50 | 3.00 (4.00) |" in md
    fig = comparison.compute_figure(res, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0 and len(fig.axes[0].collections) == 2  # deployed + full-width
    with pytest.raises(sweep.MissingData):
        comparison.compute_figure(make(runs, rounds))


def test_mean_std_is_the_sample_std_over_seeds_in_first_appearance_order() -> None:
    df = pd.DataFrame({"v": ["z", "z", "a", "z"], "seed": [0, 1, 0, 2], "x": [0.5, 0.7, 0.3, 0.6],
                       "y": [1.0, 2.0, 3.0, 6.0]})
    t = sweep.mean_std(df, "v", {"acc": "x", "y": "y"})
    assert list(t["v"]) == ["z", "a"] and list(t.columns) == ["v", "seeds", "acc_mean", "acc_std", "y_mean", "y_std"]
    z = t.iloc[0]
    assert z["seeds"] == 3 and z["acc_mean"] == pytest.approx(0.6) and z["acc_std"] == pytest.approx(0.1)
    assert z["y_std"] == pytest.approx(sample_std(1.0, 2.0, 6.0))
    assert t.iloc[1]["seeds"] == 1 and np.isnan(t.iloc[1]["acc_std"])  # one seed: no spread
    shown = sweep.pm_table(t, not_percent=("y",))
    assert list(shown.columns) == ["v", "seeds", "acc", "y"]
    assert shown.iloc[0]["acc"] == "60.0 ± 10.0" and shown.iloc[1]["acc"] == "30.0" and shown.iloc[1]["y"] == "3.00"


# ----------------------------------------------------------------------------- sensitivity (Table 7)

def sensitivity_results() -> results.Results:
    spec = [  # (run id, seed, options, best accuracy)
        ("ref-s0", 0, {}, 0.60), ("ref-s1", 1, {}, 0.64),
        ("g_target=0.5-s0", 0, {"g_target": 0.5}, 0.50), ("g_target=0.5-s1", 1, {"g_target": 0.5}, 0.56),
        ("g_target=0.95-s0", 0, {"g_target": 0.95}, 0.58),
        ("tau_var=0.2-s0", 0, {"tau_var": 0.2}, 0.40), ("tau_var=0.2-s1", 1, {"tau_var": 0.2}, 0.44),
        ("beta_ema=0.7-s0", 0, {"beta_ema": 0.7}, 0.70),
        ("two-factors-s0", 0, {"g_target": 0.5, "tau_var": 0.2}, 0.10),   # not a one-factor run
        ("other-layer-s0", 0, {"dga_layer": "layer2"}, 0.11),              # a Table 2 run, not Table 7
        ("unfinished-s2", 2, {}, 0.12),
    ]
    runs = [run_row(r, "fedsap_fixed", s, status="running" if r.startswith("unfinished") else "finished",
                    warmup=5, **o) for r, s, o, _ in spec]
    runs.append(run_row("fedsap-s0", "fedsap", 0, g_target=0.5))       # another algorithm
    rounds = [row for r, _, _, a in spec for row in round_rows(r, [a - 0.05, a, a - 0.01])]
    rounds += round_rows("fedsap-s0", [0.13])
    return make(runs, rounds)


def test_sensitivity_table_one_factor_rows_share_the_reference() -> None:
    t = sensitivity.sensitivity_table(sensitivity_results())
    assert list(t.columns) == sensitivity.COLUMNS
    assert list(zip(t["factor"], t["value"])) == [("g_target", 0.5), ("g_target", 0.9), ("g_target", 0.95),
                                                  ("tau_var", 0.1), ("tau_var", 0.2),
                                                  ("beta_ema", 0.3), ("beta_ema", 0.7)]
    ref = t[t["reference"]]
    assert list(ref["factor"]) == list(sensitivity.FACTORS) and list(ref["value"]) == [0.9, 0.1, 0.3]
    assert (ref["variants"] == "ref").all() and (ref["seeds"] == 2).all()
    assert ref["best_mean"].to_numpy() == pytest.approx([0.62] * 3)
    assert ref["best_std"].to_numpy() == pytest.approx([sample_std(0.60, 0.64)] * 3)
    assert ref["final_mean"].to_numpy() == pytest.approx([0.61] * 3)
    g = t[(t["factor"] == "g_target") & (t["value"] == 0.5)].iloc[0]
    assert g["best_mean"] == pytest.approx(0.53) and g["best_std"] == pytest.approx(sample_std(0.50, 0.56))
    assert g["variants"] == "g_target=0.5" and not g["reference"]
    tau = t[(t["factor"] == "tau_var") & (t["value"] == 0.2)].iloc[0]
    assert tau["seeds"] == 2 and tau["best_mean"] == pytest.approx(0.42)
    single = t[(t["factor"] == "beta_ema")].iloc[1]
    assert single["seeds"] == 1 and np.isnan(single["best_std"])
    shown = " ".join(t["variants"])
    for excluded in ("two-factors", "other-layer", "unfinished", "fedsap"):
        assert excluded not in shown.split(", ") and excluded not in shown.split()


def test_plot_sensitivity_marks_the_reference_in_three_panels(tmp_path) -> None:
    t = sensitivity.sensitivity_table(sensitivity_results())
    fig = sensitivity.plot_sensitivity(t, tmp_path / "f5.png")
    assert (tmp_path / "f5.png").read_bytes()[:4] == b"\x89PNG"
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 3
    for ax, ref in zip(axes, (0.9, 0.1, 0.3)):
        stars = [ln for ln in ax.get_lines() if ln.get_marker() == "*"]
        assert len(stars) == 1 and list(stars[0].get_xdata()) == [ref]
        assert stars[0].get_ydata()[0] == pytest.approx(62.0)
    with pytest.raises(ValueError, match="metric"):
        sensitivity.plot_sensitivity(t, metric="worst")
    with pytest.raises(sweep.MissingData):
        sensitivity.plot_sensitivity(t.iloc[0:0])


# ----------------------------------------------------------------------------- ablation (Figure 4, Tables 5, 2, DGA)

def ablation_results(extra_rounds: list[dict] = (), clients: list[dict] = ()) -> results.Results:
    fedsap_runs = [  # (run id, seed, options, best accuracy, mnist best, dga per round)
        ("full-s0", 0, {}, 0.80, 0.90, [(2, 0.5, 0.1), None, (3, 0.7, 0.3)]),
        ("full-s1", 1, {}, 0.76, 0.94, [(2, 0.3, 0.0), None, (2, 0.3, 0.0)]),
        ("no-dga-s0", 0, {"dga": "none"}, 0.70, 0.85, None),
        ("no-sgp-s0", 0, {"sgp": False}, 0.72, 0.88, [(2, 0.1, 0.2), None, None]),
        ("x-s0", 0, {"sgp": False, "dga": "none"}, 0.65, 0.80, None),
        ("uniform-budget-s0", 0, {"adaptive_layer_budget": 0}, 0.74, 0.86, [(4, 0.9, 0.9), None, None]),
        # the id says "full", the config says single path + uniform budget: the config decides
        ("full-mislabelled-s0", 0, {"sgp": False, "adaptive_layer_budget": 0}, 0.60, 0.70, None),
        ("dga-oracle-s0", 0, {"dga": "oracle"}, 0.82, 0.91, [(4, 1.0, -0.1), None, None]),
    ]
    fixed_runs = [("b-s0", 0, {"dga_layer": "layer3"}, 0.55), ("a-s0", 0, {"dga_layer": "layer1"}, 0.61),
                  ("c-s0", 0, {"dga_layer": "conv1"}, 0.58), ("c-s1", 1, {"dga_layer": "conv1"}, 0.60)]
    runs = [run_row(r, "fedsap", s, warmup=5, **o) for r, s, o, *_ in fedsap_runs]
    runs += [run_row(r, "fedsap_fixed", s, **o) for r, s, o, _ in fixed_runs] + [run_row("avg-s0", "fedavg", 0)]
    rounds = []
    for r, _, _, a, m, dga in fedsap_runs:
        rounds += round_rows(r, [a - 0.1, a, a - 0.02], modes=("group", "global_only"),
                             domain_accs={"mnist": [m - 0.1, m, m - 0.2]}, dga=dga)
    for r, _, _, a in fixed_runs:
        rounds += round_rows(r, [a, a - 0.03], modes=("group", "global_only"))
    return make(runs, rounds + round_rows("avg-s0", [0.9]) + list(extra_rounds), clients)


def test_figure4_rows_come_from_the_dga_and_sgp_options() -> None:
    t = ablation.figure4_table(ablation_results())
    assert list(t["ablation"]) == ["FedSAP", "w/o DGA", "w/o SGP", "w/o DGA & SGP"]
    assert list(t["variants"]) == ["full", "no-dga", "no-sgp", "x"]  # uniform-budget / oracle runs are elsewhere
    full = t.iloc[0]
    assert full["seeds"] == 2 and full["best_mean"] == pytest.approx(0.78)
    assert full["final_mean"] == pytest.approx(0.76) and full["best_std"] == pytest.approx(sample_std(0.80, 0.76))
    assert full["mnist_mean"] == pytest.approx(0.92) and full["svhn_mean"] == pytest.approx(0.78)
    fig = ablation.plot_ablation(t)
    assert len(fig.axes[0].patches) == 4 * (len(DOMAINS) + 1)  # one bar per row and domain, plus global


def test_table5_places_each_run_in_its_2x2_cell_by_config() -> None:
    t = ablation.table5_table(ablation_results())
    grid = ablation.table5_grid(t)
    assert list(grid.index) == [p for p, _ in ablation.PATHS] and list(grid.columns) == [b for b, _ in ablation.BUDGETS]
    tri, single = "Tri-state type-matched (FedSAP)", "Single path (w/o Tri-State)"
    assert grid.loc[tri, "Adaptive layer budget"] == pytest.approx(0.78)
    assert grid.loc[tri, "Uniform layer budget"] == pytest.approx(0.74)
    assert grid.loc[single, "Adaptive layer budget"] == pytest.approx(0.72)
    assert grid.loc[single, "Uniform layer budget"] == pytest.approx(0.60)
    assert t.set_index("variants").loc["full-mislabelled", "path"] == single
    shown = ablation.table5_grid(sweep.pm_table(t), "best")
    assert shown.loc[tri, "Adaptive layer budget"] == f"78.0 ± {100 * sample_std(0.80, 0.76):.1f}"
    # a missing cell is NaN in the grid and "no runs" in the 2x2 view
    part = t[t["variants"] != "uniform-budget"]
    assert np.isnan(ablation.table5_grid(part).loc[tri, "Uniform layer budget"])
    texts = [x.get_text() for x in ablation.plot_table5(part).axes[0].texts]
    assert "no runs" in texts and len(texts) == 4


def test_table5_gains_the_deployed_models_and_the_compute_of_each_cell() -> None:
    """Issue 13: each 2x2 cell also says what its clients ran (deployed rows only, never the group rows) and
    spent (clients.train_macs), mean over seeds; a cell whose runs recorded neither shows NaN, not 0."""
    extra_rounds, clients = [], []
    for rid, accs, worst, macs in (("full-s0", [0.5, 0.7], 0.4, [2e9, 4e9]), ("full-s1", [0.6, 0.5], 0.2, [3e9])):
        for t, a in enumerate(accs, start=1):
            extra_rounds.append({"run_id": rid, "round": t, "eval_mode": "deployed", "evaluated": True, "domain": G,
                                 "accuracy": a, "worst_client_accuracy": worst})
        clients += [{"run_id": rid, "round": 1, "client_id": i, "train_macs": m} for i, m in enumerate(macs)]
    res = ablation_results(extra_rounds, clients)
    t = ablation.table5_table(res).set_index(["path", "budget"])
    cell = t.loc[("Tri-state type-matched (FedSAP)", "Adaptive layer budget")]
    assert cell["best_mean"] == pytest.approx(0.78)  # the group models, untouched by the deployed rows
    assert cell["deployed_mean"] == pytest.approx((0.7 + 0.6) / 2)  # best so far per run, then over seeds
    assert cell["deployed_final_mean"] == pytest.approx((0.7 + 0.5) / 2)
    assert cell["worst_client_mean"] == pytest.approx(0.3)
    assert cell["train_gmacs_mean"] == pytest.approx((3.0 + 3.0) / 2)  # per run: mean over its client-rounds
    other = t.loc[("Single path (w/o Tri-State)", "Uniform layer budget")]
    assert np.isnan(other["deployed_mean"]) and np.isnan(other["train_gmacs_mean"])
    printed = ablation.report(res)
    assert "## Table 5: what each device ran and spent" in printed and "| 3.00 ± 0.00 |" in printed
    assert "No Table 5 run of the folder recorded deployed evaluation" in ablation.report(ablation_results())


def test_table2_rows_follow_the_layer_order_with_deltas_from_conv1() -> None:
    t = ablation.table2_table(ablation_results())
    assert list(t["gradient source"]) == ["Conv1", "Layer1", "Layer3"]  # no Layer2 runs
    assert list(t["variants"]) == ["c", "a", "b"]
    assert t["best_mean"].to_numpy() == pytest.approx([0.59, 0.61, 0.55])
    assert t["delta"].to_numpy() == pytest.approx([0.0, 0.02, -0.04])


def test_dga_controls_average_the_grouping_over_dga_rounds_then_seeds() -> None:
    t = ablation.dga_controls_table(ablation_results()).set_index("dga")
    assert list(t.index) == ["gradient", "oracle", "none"]  # no random-grouping runs
    # full-s0: ARI domain mean(0.5, 0.7) = 0.6, full-s1: 0.3 -> 0.45 over seeds; n_groups (2.5, 2) -> 2.25
    assert t.loc["gradient", "ari_domain_mean"] == pytest.approx(0.45)
    assert t.loc["gradient", "ari_domain_std"] == pytest.approx(sample_std(0.6, 0.3))
    assert t.loc["gradient", "ari_capacity_mean"] == pytest.approx(0.1)
    assert t.loc["gradient", "n_groups_mean"] == pytest.approx(2.25)
    assert t.loc["oracle", "ari_domain_mean"] == pytest.approx(1.0) and np.isnan(t.loc["none", "ari_domain_mean"])
    assert sweep.pm_table(t.reset_index()).set_index("dga").loc["oracle", "n_groups"] == "4.00"


def test_every_analysis_names_a_run_by_the_one_label_of_its_resolved_options() -> None:
    """One label per run, from the config.* columns: the studies' row names are renamings of it, so two
    tables never disagree about what a run ran (FedProx's mu is a hyperparameter, not part of a label)."""
    rows = [run_row("p-s0", "fedprox", 0, width="capacity", mu=1.0), run_row("q-s0", "fedprox", 0),
            run_row("h-s0", "hasfl", 0, coverage="false"), run_row("d-s0", "feddrop", 0, selection="afd"),
            run_row("x-s0", "dapperfl", 0, full_first_epoch=False), run_row("f-s0", "fedavg", 0, width="full")]
    res = make(rows, [r for row in rows for r in round_rows(row["run_id"], [0.5])])
    pr = runs.per_run(res).set_index("run_id")
    assert pr["label"].to_dict() == {"p-s0": "fedprox (width=capacity)", "q-s0": "fedprox",
                                     "h-s0": "hasfl (coverage=False)", "d-s0": "feddrop (selection=afd)",
                                     "x-s0": "dapperfl (full_first_epoch=False)", "f-s0": "fedavg"}
    assert "config.algorithm.options.mu" in pr.columns and pr.loc["p-s0", "opt_mu"] == 1.0
    method = comparison.per_run(res).set_index("run_id")["method"]
    assert method.to_dict() == {"p-s0": "FedProx", "q-s0": "FedProx (full model)", "h-s0": "hasfl (coverage=False)",
                                "d-s0": "FedDrop (AFD)", "x-s0": "DapperFL (capacity)", "f-s0": "FedAvg"}
    variant = confound.per_run(res).set_index("run_id")["variant"]
    assert variant["h-s0"] == "HAS-FL (no coverage)" and variant["p-s0"] == "FedProx (capacity width)"
    for rid, name in method.items():  # the Table 1 name is the same map of the same label from a bare config
        assert comparison.method_of(json.loads(res.runs.set_index("run_id").loc[rid, "config_json"])) == name
    assert labels.protocol(pr.loc["p-s0"])["algorithm.options.mu"] == 1.0


def test_reports_render_every_table_as_markdown() -> None:
    text = ablation.report(ablation_results())
    assert f"| FedSAP | full | 2 | 78.0 ± {100 * sample_std(0.80, 0.76):.1f} | 76.0 ± " in text
    assert "| Tri-state type-matched (FedSAP) | 74.0 | 78.0 ± 2.8 |" in text  # the 2x2: uniform, adaptive
    assert "| Layer1 | a | 1 | 61.0 | 58.0 | +2.0 |" in text and "| oracle | dga-oracle | 1 | 82.0 |" in text
    assert "| fedavg | avg | 1 | 90.0 | 90.0 |" in text  # a baseline, labelled from its config
    assert "No runs of this table" not in text
    md = sensitivity.to_markdown(sensitivity.sensitivity_table(sensitivity_results()))
    assert "| tau_var | 0.1 (ref.) | 2 | 62.0 ± 2.8 | 61.0 ± 2.8 | ref |" in md
    assert "| beta_ema | 0.7 | 1 | 70.0 | 69.0 | beta_ema=0.7 |" in md
    het = make([run_row("fedavg-het-s0", "fedavg", 0, width="capacity")], round_rows("fedavg-het-s0", [0.3]))
    assert list(ablation.baselines_table(het)["baseline"]) == ["fedavg (width=capacity)"]
    assert "No runs of this table in the folder." in ablation.report(het)


def test_select_runs_ignores_protocol_options_shared_by_every_run() -> None:
    runs = sweep.annotate_runs(ablation_results().runs)
    # warmup=5 everywhere (the protocol); adaptive_layer_budget differs between runs, so it must be default
    ids = set(sweep.select_runs(runs, "fedsap", ["dga"])["run_id"])
    assert ids == {"full-s0", "full-s1", "no-dga-s0", "dga-oracle-s0"}
    with pytest.raises(ValueError, match="not options of algorithm 'fedsap'"):
        sweep.select_runs(runs, "fedsap", ["mu"])


# ----------------------------------------------------------------------------- plots

def test_convergence_plot_has_a_panel_per_domain_and_a_band_for_several_seeds(tmp_path) -> None:
    res = ablation_results()
    fig = plots.plot_convergence(res, variants=["full", "no-dga"], path=tmp_path / "c.png")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["global (mean over domains)", *DOMAINS]
    lines = {ln.get_label(): ln for ln in axes[0].get_lines()}
    assert set(lines) == {"full", "no-dga"}
    assert list(lines["full"].get_ydata()) == pytest.approx([68.0, 78.0, 76.0])  # mean over the two seeds
    assert len(axes[0].collections) == 1  # the std band: only "full" has two seeds
    assert (tmp_path / "c.png").stat().st_size > 0
    assert len(plots.plot_convergence(res, domains=False).axes) == 1
    with pytest.raises(sweep.MissingData):
        plots.plot_convergence(make([run_row("a-s0", "fedavg", 0)], []))


def layer_results() -> results.Results:
    runs = [run_row("full-s0", "fedsap", 0), run_row("full-s1", "fedsap", 1)]
    clients = [{"run_id": r, "round": 1, "client_id": c, "capacity_max": cap}
               for r in ("full-s0", "full-s1") for c, cap in ((0, 1.0), (1, 0.5))]
    layers = []
    for r, (g0, p0) in (("full-s0", (6, 2)), ("full-s1", (4, 4))):
        layers += [{"run_id": r, "round": 1, "client_id": 0, "layer": "layer1", "channels": 8, "n_global": g0,
                    "n_private": p0, "n_dropped": 8 - g0 - p0},
                   {"run_id": r, "round": 1, "client_id": 0, "layer": "conv1", "channels": 4, "n_global": 4,
                    "n_private": 0, "n_dropped": 0},
                   {"run_id": r, "round": 1, "client_id": 1, "layer": "layer1", "channels": 8, "n_global": 2,
                    "n_private": 0, "n_dropped": 6},
                   {"run_id": r, "round": 1, "client_id": 1, "layer": "conv1", "channels": 4, "n_global": 1,
                    "n_private": 1, "n_dropped": 2}]
    return make(runs, round_rows("full-s0", [0.5]), clients=clients, layers=layers)


def test_layer_budget_table_is_the_mean_state_fraction_per_capacity_and_layer() -> None:
    t = plots.layer_budget_table(layer_results())
    assert list(zip(t["capacity"], t["layer"])) == [(1.0, "layer1"), (1.0, "conv1"), (0.5, "layer1"), (0.5, "conv1")]
    wide = t.iloc[0]
    assert wide["global"] == pytest.approx((6 / 8 + 4 / 8) / 2) and wide["private"] == pytest.approx((2 / 8 + 4 / 8) / 2)
    assert wide["dropped"] == pytest.approx(0.0) and wide["rows"] == 2
    assert t.iloc[3][["global", "private", "dropped"]].tolist() == pytest.approx([0.25, 0.25, 0.5])
    fig = plots.plot_layer_budgets(layer_results())
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["full: capacity 1.00", "full: capacity 0.50"]
    with pytest.raises(sweep.MissingData, match="no layers rows"):
        plots.layer_budget_table(ablation_results())


def test_allocation_and_estimate_plots_use_each_runs_final_state() -> None:
    runs = [run_row("hasfl-s0", "hasfl", 0), run_row("uniform-s0", "uniform", 0)]
    alloc = [{"run_id": r, "round": t, "client_id": c, "capacity_max": pm, "p": p if t == 2 else 0.1,
              "h_tilde": (h if t == 2 else 9.0) if r == "hasfl-s0" else None, "tv_distance": tv}
             for r in ("hasfl-s0", "uniform-s0") for t in (1, 2)
             for c, pm, p, h, tv in ((0, 1.0, 0.75, 0.2, 0.1), (1, 0.5, 0.5, 0.4, 0.3), (2, 0.25, 0.25, 0.6, 0.5))]
    res = make(runs, round_rows("hasfl-s0", [0.5]), allocations=alloc)
    fa = plots.final_allocations(res)
    assert (fa["round"] == 2).all() and len(fa) == 6
    fig = plots.plot_allocations(res)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["hasfl", "uniform"]
    assert sorted(axes[0].collections[0].get_offsets()[:, 1]) == [0.25, 0.5, 0.75]
    fig = plots.plot_estimates(res)
    ys = sorted(y for ax in fig.axes[:1] for c in ax.collections for _, y in c.get_offsets())
    assert ys == pytest.approx([0.2, 0.4, 0.6])  # the final H~ of the HAS-FL run only
    with pytest.raises(sweep.MissingData, match="allocations"):
        plots.plot_allocations(ablation_results())


def test_eval_every_2_keeps_best_and_final_accuracy() -> None:
    """Issue 14 item 1: with training.eval_every=2 round 1 is not evaluated and its rows carry no eval mode;
    the primary mode comes from the evaluated rows, so no accuracy goes blank."""
    rows = round_rows("a-s0", [None, 0.5, None, 0.7, 0.6], modes=("group", "global_only")) \
        + round_rows("b-s0", [None, 0.3, None, 0.2])
    for r in rows:
        if not r["evaluated"]:
            r["eval_mode"] = None  # as the server writes a skipped round
    res = make([run_row("a-s0", "fedsap", 0), run_row("b-s0", "fedavg", 0)], rows)
    pr = runs.per_run(res).set_index("run_id")
    assert pr.loc["a-s0", "best_global_accuracy"] == pytest.approx(0.7)
    assert pr.loc["a-s0", "final_global_accuracy"] == pytest.approx(0.6)
    assert pr.loc["b-s0", "best_global_accuracy"] == pytest.approx(0.3)
    assert pr.loc["b-s0", "final_global_accuracy"] == pytest.approx(0.2)
    assert sweep.domain_best(res.rounds).loc["a-s0", "mnist"] == pytest.approx(0.7)
    cmp = comparison.per_run(res).set_index("run_id")
    assert cmp.loc["b-s0", "global"] == pytest.approx(0.3) and cmp.loc["b-s0", "final_global"] == pytest.approx(0.2)
    assert confound.per_run(res).set_index("run_id").loc["a-s0", "final_accuracy"] == pytest.approx(0.6)
    table = sweep.option_table(res, "fedavg", [("FedAvg", {})])
    assert table.loc[0, "best_mean"] == pytest.approx(0.3) and table.loc[0, "final_mean"] == pytest.approx(0.2)


def test_option_table_splits_a_row_whose_runs_differ_beyond_the_seed() -> None:
    """Issue 14 item 3: a grouping table never pools runs with different resolved configurations."""
    runs = [run_row("a-s0", "fedavg", 0), run_row("a-s1", "fedavg", 1)]
    for r, rounds in zip(runs, (2, 30)):
        cfg = json.loads(r["config_json"])
        cfg["training"] = {"rounds": rounds}
        r["config_json"] = json.dumps(cfg)
    res = make(runs, round_rows("a-s0", [0.2]) + round_rows("a-s1", [0.8]))
    with pytest.warns(UserWarning, match="training.rounds"):
        t = sweep.option_table(res, "fedavg", [("FedAvg", {})])
    assert sorted(t["row"]) == ["FedAvg [training.rounds=2]", "FedAvg [training.rounds=30]"]
    assert sorted(t["best_mean"]) == pytest.approx([0.2, 0.8])


def test_markdown_renders_text_cells_as_given_with_one_space_padding() -> None:
    """The one renderer (DataFrame.to_markdown): numbers are never re-parsed ("0.50" stays), missing cells
    print "–", cells are not padded to the column width, and a title holding "|" keeps one rule per column."""
    df = pd.DataFrame({"method": ["FedAvg", "a much longer name"], "r(x, y | z)": ["0.50", np.nan], "n": [3, 12]})
    assert sweep.markdown(df).splitlines() == ["| method | r(x, y | z) | n |", "| --- | --- | --- |",
                                               "| FedAvg | 0.50 | 3 |", "| a much longer name | – | 12 |"]
    assert sweep.markdown(df.iloc[0:0]).splitlines() == ["| method | r(x, y | z) | n |", "| --- | --- | --- |"]
