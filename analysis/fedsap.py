"""FedSAP ablation tables from a results folder (papers/000 Table 5 layout plus a baseline row).

``variant_of`` names a run from its stored config, so the table is rebuilt from the
Parquet files alone; accuracies are the runs' own best-so-far global accuracies
(``eval_mode='group'`` for FedSAP, ``global`` for FedAvg), never the paper's numbers.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from analysis import sweep
from fedsap_ray import results

GLOBAL = "__global__"


def variant_of(config: dict) -> str:
    algo = config["algorithm"]
    opts = algo.get("options") or {}
    if algo["name"] in ("fedsap", "fedsap_fixed"):
        path = "tri-state" if opts.get("sgp", True) else "single path"
        default_budget = 1 if algo["name"] == "fedsap" else 0
        rule = "adaptive" if opts.get("adaptive_layer_budget", default_budget) else "uniform"
        return f"{algo['name']}: {path}, {rule} budget"
    width = opts.get("width", "full")
    return f"{algo['name']} ({'heterogeneous' if width == 'capacity' else 'full model'})"


def per_run(res: results.Results) -> pd.DataFrame:
    """One row per run: variant, seed, best / final global accuracy, DGA agreement (mean over DGA rounds)."""
    runs = res.runs.copy()
    runs["variant"] = [variant_of(json.loads(c)) for c in runs["config_json"]]
    out = runs[["run_id", "variant", "seed", "status", "rounds_done"]].set_index("run_id")
    out = out.join(sweep.global_accuracy(res.rounds)).join(sweep.grouping_stats(res.rounds))
    return out.reset_index()


def ablation_table(res: results.Results) -> pd.DataFrame:
    """Mean and std over seeds of best/final global accuracy and DGA ARI, per variant."""
    pr = per_run(res)
    pr = pr[pr["status"] == "finished"]
    agg = pr.groupby("variant").agg(
        seeds=("seed", "nunique"),
        best_mean=("best_global_accuracy", "mean"), best_std=("best_global_accuracy", "std"),
        final_mean=("final_global_accuracy", "mean"), final_std=("final_global_accuracy", "std"),
        n_groups=("n_groups", "mean"), ari_domain=("ari_domain", "mean"), ari_capacity=("ari_capacity", "mean"))
    return agg.sort_values("best_mean", ascending=False)


def load_table(path: str | Path) -> pd.DataFrame:
    return ablation_table(results.load(path))


def to_markdown(table: pd.DataFrame) -> str:
    """A README-ready table: accuracies as mean +- std in percent."""
    lines = ["| variant | seeds | best global acc. (%) | final global acc. (%) | DGA groups | ARI vs domains | ARI vs capacities |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def pm(m, s):
        return f"{100 * m:.1f} ± {100 * (0 if pd.isna(s) else s):.1f}"

    def num(x):
        return "–" if pd.isna(x) else f"{x:.2f}"

    for v, r in table.iterrows():
        lines.append(f"| {v} | {int(r.seeds)} | {pm(r.best_mean, r.best_std)} | {pm(r.final_mean, r.final_std)} | "
                     f"{num(r.n_groups)} | {num(r.ari_domain)} | {num(r.ari_capacity)} |")
    return "\n".join(lines)
