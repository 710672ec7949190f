"""The main comparison (papers/000 Table 1) from a results folder: per-domain and global accuracy
of every method, mean over seeds.

As in the paper's Table 1 (following DapperFL): each domain column is that domain's
best-so-far accuracy over the evaluated rounds, and ``global`` is the best-so-far
unweighted mean of the domain accuracies at the same round, so it need not equal the
mean of the domain columns. We also give the final-round global accuracy. Every number
comes from our runs' Parquet rows (the primary eval mode of each run: ``group`` for
FedSAP, ``global`` otherwise), never from the paper.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import sweep
from fedsap_ray import results

GLOBAL = results.GLOBAL_DOMAIN
# papers/000 Table 1 rows, in its order: (label, registry name, marked with system heterogeneity). papers/000's
# "FedDrop" row is Adaptive Federated Dropout; ours runs plain Federated Dropout by default, so it is labelled
# "FedDrop (FD)" (selection=afd: "FedDrop (AFD)", unvalidated; fedsap_ray/algorithms/feddrop.py)
TABLE1 = [
    ("FedAvg", "fedavg", False), ("MOON", "moon", False), ("FedSR", "fedsr", False), ("FPL", "fpl", False),
    ("FedSPU", "fedspu", False), ("FedDrop (FD)", "feddrop", True), ("FedProx", "fedprox", True), ("FedMP", "fedmp", True),
    ("NeFL", "nefl", True), ("DapperFL", "dapperfl", True), ("FedSAP", "fedsap", True),
]
LABEL = {name: label for label, name, _ in TABLE1}


def method_of(config: dict[str, Any]) -> str:
    """Table 1 label of a run (FedAvg / FedProx note the width they trained at)."""
    algo = config["algorithm"]
    label = LABEL.get(algo["name"], algo["name"])
    width = (algo.get("options") or {}).get("width")
    if algo["name"] == "fedavg" and width == "capacity":
        return "FedAvg (sub-models)"
    if algo["name"] == "fedprox" and width != "capacity":
        return "FedProx (full model)"
    if algo["name"] == "feddrop" and (algo.get("options") or {}).get("selection") == "afd":
        return "FedDrop (AFD)"
    return label


def per_run(res: results.Results) -> pd.DataFrame:
    """One row per finished run: method, seed, best accuracy per domain, best and final global accuracy."""
    runs = res.runs[res.runs["status"] == "finished"].copy()
    runs["method"] = [method_of(json.loads(c)) for c in runs["config_json"]]
    best = sweep.domain_best(res.rounds).join(sweep.global_accuracy(res.rounds)["final_global_accuracy"])
    best = best.rename(columns={"final_global_accuracy": "final_global"})
    return runs[["run_id", "method", "seed", "dataset"]].set_index("run_id").join(best).reset_index()


def table1(res: results.Results) -> pd.DataFrame:
    """Mean over seeds per method (rows in the paper's order), with the seed count and global std."""
    pr = per_run(res)
    cols = [c for c in pr.columns if c not in ("run_id", "method", "seed", "dataset")]
    domains = [c for c in cols if c not in ("global", "final_global")]
    agg = pr.groupby("method")[domains + ["global", "final_global"]].mean()
    agg["global_std"] = pr.groupby("method")["global"].std()
    agg["seeds"] = pr.groupby("method")["seed"].nunique()
    # methods outside the paper's table: "sub-models" when some client trained less than the full model
    narrow = res.clients.groupby("run_id")["capacity_used"].min() < 1 - 1e-9
    agg["sub_models"] = pr.assign(narrow=pr["run_id"].map(narrow).fillna(False).astype(bool)).groupby("method")[
        "narrow"].any()
    order = [label for label, _, _ in TABLE1 if label in agg.index] + sorted(set(agg.index) - set(LABEL.values()))
    return agg.loc[order]


def to_markdown(table: pd.DataFrame) -> str:
    """README table: accuracies in percent; the 'sys. het.' column says who trained sub-models (the
    paper's marks for its Table 1 methods, our runs' clients table for the others)."""
    het = {label: h for label, _, h in TABLE1}
    domains = [c for c in table.columns if c not in ("global", "final_global", "global_std", "seeds", "sub_models")]
    head = ["method", "sys. het.", "seeds", *domains, "global (best)", "global (final)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for m, r in table.iterrows():
        cells = [m, "✓" if het.get(m, "sub-models" in m or bool(r.get("sub_models", False))) else "✗",
                 str(int(r["seeds"]))]
        cells += [f"{100 * r[d]:.2f}" for d in domains]
        std = 0.0 if pd.isna(r["global_std"]) else r["global_std"]
        cells += [f"{100 * r['global']:.2f} ± {100 * std:.2f}", f"{100 * r['final_global']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_table(path: str | Path) -> pd.DataFrame:
    return table1(results.load(path))
