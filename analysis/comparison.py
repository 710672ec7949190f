"""The main comparison (papers/000 Table 1) from a results folder: per-domain and global accuracy
of every method, mean over seeds.

As in the paper's Table 1 (following DapperFL): each domain column is that domain's
best-so-far accuracy over the evaluated rounds, and ``global`` is the best-so-far
unweighted mean of the domain accuracies at the same round, so it need not equal the
mean of the domain columns. We also give the final-round global accuracy. Every number
comes from our runs' Parquet rows (the primary eval mode of each run: ``group`` for
FedSAP, ``global`` otherwise), never from the paper.

Beside the paper's figures, what each device really got and spent:

- ``deployed`` / ``deployed_final``: the ``deployed`` eval mode (each client's own model at its own
  mask on its own domain; per domain the sample-weighted mean over its clients, then the unweighted
  mean over domains), best-so-far and final; ``worst_client``: the lowest client figure at the final
  round (docs/readings.md#deployed-evaluation);
- ``train_gmacs``: forward GMACs a client spent in local training per round (the ``clients`` table's
  ``train_macs``, mean over client-rounds), and ``max_train_gmacs`` its largest value, so a method
  that trains beyond a device's capacity shows it. :func:`compute_figure` draws accuracy against it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.ticker import FuncFormatter

from analysis import plots, sweep
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
# labels method_of gives to a Table 1 method run with a non-default option, listed right after it
VARIANT_LABELS = {"FedDrop (FD)": ("FedDrop (AFD)",), "DapperFL": ("DapperFL (capacity)",)}
EXTRA = sweep.DEVICE_COLUMNS  # per-run figures averaged over seeds
NOT_DOMAINS = ("global", "final_global", "global_std", "seeds", "sub_models", "deployed_std", "max_train_gmacs",
               *EXTRA)


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
    if algo["name"] == "dapperfl" and (algo.get("options") or {}).get("full_first_epoch") is False:
        return "DapperFL (capacity)"
    return label


def per_run(res: results.Results) -> pd.DataFrame:
    """One row per finished run: method, seed, best accuracy per domain, best and final global accuracy,
    the deployed evaluation and the training compute (module docstring)."""
    runs = res.runs[res.runs["status"] == "finished"].copy()
    runs["method"] = [method_of(json.loads(c)) for c in runs["config_json"]]
    best = sweep.domain_best(res.rounds).join(sweep.global_accuracy(res.rounds)["final_global_accuracy"])
    best = best.rename(columns={"final_global_accuracy": "final_global"})
    best = best.join(sweep.deployed_accuracy(res.rounds), how="left").join(sweep.train_compute(res.clients), how="left")
    return runs[["run_id", "method", "seed", "dataset"]].set_index("run_id").join(best).reset_index()


def table1(res: results.Results) -> pd.DataFrame:
    """Mean over seeds per method (rows in the paper's order), with the seed count and global std."""
    pr = per_run(res)
    cols = [c for c in pr.columns if c not in ("run_id", "method", "seed", "dataset")]
    domains = [c for c in cols if c not in ("global", "final_global", *EXTRA)]
    agg = pr.groupby("method")[domains + ["global", "final_global", *EXTRA]].mean()
    agg["max_train_gmacs"] = pr.groupby("method")["max_train_gmacs"].max()
    agg["global_std"] = pr.groupby("method")["global"].std()
    agg["deployed_std"] = pr.groupby("method")["deployed"].std()
    agg["seeds"] = pr.groupby("method")["seed"].nunique()
    # methods outside the paper's table: "sub-models" when some client trained less than the full model
    narrow = res.clients.groupby("run_id")["capacity_used"].min() < 1 - 1e-9
    agg["sub_models"] = pr.assign(narrow=pr["run_id"].map(narrow).fillna(False).astype(bool)).groupby("method")[
        "narrow"].any()
    return agg.loc[in_table1_order(agg.index)]


def in_table1_order(methods: Any) -> list[str]:
    """Method labels in the paper's Table 1 order (each variant label right after its method), then the rest
    alphabetically."""
    known = [x for label, _, _ in TABLE1 for x in (label, *VARIANT_LABELS.get(label, ()))]
    present = set(methods)
    return [m for m in known if m in present] + sorted(present - set(known))


def to_markdown(table: pd.DataFrame) -> str:
    """README table: accuracies in percent; the 'sys. het.' column says who trained sub-models (the
    paper's marks for its Table 1 methods, our runs' clients table for the others)."""
    het = {label: h for label, _, h in TABLE1}
    domains = [c for c in table.columns if c not in NOT_DOMAINS]
    head = ["method", "sys. het.", "seeds", *domains, "global (best)", "global (final)", "deployed (best)",
            "deployed (final)", "worst client (final)", "train GMACs / client-round (max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]

    def pct(v: Any) -> str:
        return "–" if pd.isna(v) else f"{100 * v:.2f}"

    def pm(v: Any, sd: Any) -> str:
        return "–" if pd.isna(v) else f"{100 * v:.2f} ± {100 * (0.0 if pd.isna(sd) else sd):.2f}"

    for m, r in table.iterrows():
        cells = [m, "✓" if het.get(m, "sub-models" in m or bool(r.get("sub_models", False))) else "✗",
                 str(int(r["seeds"]))]
        cells += [pct(r[d]) for d in domains]
        cells += [pm(r["global"], r["global_std"]), pct(r["final_global"]),
                  pm(r.get("deployed"), r.get("deployed_std")), pct(r.get("deployed_final")), pct(r.get("worst_client")),
                  "–" if pd.isna(r.get("train_gmacs")) else f"{r['train_gmacs']:.2f} ({r['max_train_gmacs']:.2f})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compute_figure(res: results.Results, path: str | Path | None = None) -> Any:
    """Accuracy against compute: one point per (method, seed) at its mean forward GMACs per client-round
    (log scale); filled markers the deployed models' final accuracy, hollow ones the full-width model's
    (each method's primary eval mode), joined by a line, so who buys accuracy with compute, and who
    loses it when judged by what a device runs, shows at a glance."""
    pr = per_run(res).dropna(subset=["train_gmacs"])
    if pr.empty:
        raise sweep.MissingData("no finished run with a train_macs column (results written before schema 4?)")
    methods = in_table1_order(pr["method"])
    fig, (ax,) = plots.new_figure(1, panel=(7.5, 5.0))
    for i, m in enumerate(methods):
        d = pr[pr["method"] == m]
        c = plots.color(i, len(methods))
        ax.scatter(d["train_gmacs"], 100 * d["deployed_final"], color=c, label=m, s=36, zorder=3)
        ax.scatter(d["train_gmacs"], 100 * d["final_global"], facecolors="none", edgecolors=c, s=36, zorder=3)
        for _, r in d.iterrows():
            ax.plot([r["train_gmacs"]] * 2, [100 * r["deployed_final"], 100 * r["final_global"]], color=c,
                    lw=0.8, alpha=0.6)
    ax.set_xscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.set_xlabel("forward GMACs per client per round (local training)")
    ax.set_ylabel("final accuracy (%): ● deployed  ○ full-width")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="best")
    return plots.finish(fig, path)


def load_table(path: str | Path) -> pd.DataFrame:
    return table1(results.load(path))
