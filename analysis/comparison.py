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

from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.ticker import FuncFormatter

from analysis import labels, plots, runs, sweep
from analysis.display import markdown
from fedsap_ray import results

GLOBAL = results.GLOBAL_DOMAIN
# papers/000 Table 1 rows, in its order: (row name, run label (analysis.labels.label), marked with system
# heterogeneity). papers/000's "FedDrop" row is Adaptive Federated Dropout; ours runs plain Federated Dropout by
# default, so it is named "FedDrop (FD)" (selection=afd: "FedDrop (AFD)", unvalidated; fedsap_ray/algorithms/feddrop.py);
# the paper's FedProx row trains nested sub-models (width=capacity).
TABLE1 = [
    ("FedAvg", "fedavg", False), ("MOON", "moon", False), ("FedSR", "fedsr", False), ("FPL", "fpl", False),
    ("FedSPU", "fedspu", False), ("FedDrop (FD)", "feddrop", True), ("FedProx", "fedprox (width=capacity)", True),
    ("FedMP", "fedmp", True), ("NeFL", "nefl", True), ("DapperFL", "dapperfl", True), ("FedSAP", "fedsap", True),
]
SYS_HET = {row: het for row, _, het in TABLE1}  # the paper's "sys. het." mark of each of its rows
# The Table 1 row name of each run label; a label not listed (a method outside the paper's table) keeps its own text.
TABLE1_ROWS = {
    **{run_label: row for row, run_label, _ in TABLE1},
    "fedavg (width=capacity)": "FedAvg (sub-models)", "fedprox": "FedProx (full model)",
    "feddrop (selection=afd)": "FedDrop (AFD)", "dapperfl (full_first_epoch=False)": "DapperFL (capacity)",
}
# row names of a Table 1 method run with a non-default option, listed right after it
VARIANT_LABELS = {"FedDrop (FD)": ("FedDrop (AFD)",), "DapperFL": ("DapperFL (capacity)",)}
EXTRA = sweep.DEVICE_COLUMNS  # per-run figures averaged over seeds
NOT_DOMAINS = ("global", "final_global", "global_std", "seeds", "sub_models", "deployed_std", "max_train_gmacs",
               *EXTRA)


def method_of(config: dict[str, Any]) -> str:
    """Table 1 row name of a run's config (:data:`TABLE1_ROWS` of :func:`analysis.labels.label`)."""
    return TABLE1_ROWS.get(name := labels.label(labels.config_of(config)), name)


def per_run(res: results.Results) -> pd.DataFrame:
    """One row per finished run of :func:`analysis.runs.per_run`: method (Table 1 row name), seed, dataset,
    best accuracy per domain, best and final global accuracy, the deployed evaluation and the training
    compute (module docstring)."""
    res = sweep.load_sweep(res)
    pr = runs.per_run(res, domains=True)
    pr = pr[pr["status"] == "finished"]
    domains = [c for c in sweep.domain_best(sweep.table(res, "rounds")).columns if c != "global"]
    out = pr[["run_id", "seed", "dataset"]].copy()
    out.insert(1, "method", [TABLE1_ROWS.get(x, x) for x in pr["label"]])
    out[domains] = pr[domains]
    out["global"], out["final_global"] = pr["best_global_accuracy"], pr["final_global_accuracy"]
    for c in ("deployed", "deployed_final", "worst_client", "train_gmacs", "max_train_gmacs"):
        out[c] = pr[c]
    return out.reset_index(drop=True)


def table1(res: results.Results) -> pd.DataFrame:
    """Mean over seeds per method (rows in the paper's order), with the seed count and global std."""
    res = sweep.load_sweep(res)
    pr = per_run(res)
    cols = [c for c in pr.columns if c not in ("run_id", "method", "seed", "dataset")]
    domains = [c for c in cols if c not in ("global", "final_global", *EXTRA)]
    agg = pr.groupby("method")[domains + ["global", "final_global", *EXTRA]].mean()
    agg["max_train_gmacs"] = pr.groupby("method")["max_train_gmacs"].max()
    agg["global_std"] = pr.groupby("method")["global"].std()
    agg["deployed_std"] = pr.groupby("method")["deployed"].std()
    agg["seeds"] = pr.groupby("method")["seed"].nunique()
    # methods outside the paper's table: "sub-models" when some client trained less than the full model
    narrow = trains_sub_models(sweep.table(res, "clients"))
    agg["sub_models"] = pr.assign(narrow=pr["run_id"].map(narrow).fillna(False).astype(bool)).groupby("method")[
        "narrow"].any()
    return agg.loc[in_table1_order(agg.index)]


def trains_sub_models(clients: pd.DataFrame) -> pd.Series:
    """Per run id: whether some client of the run trained less than the full model (``capacity_used`` < 1 in
    some round), the runs' own answer to the 'sys. het.' question for a method outside the paper's table."""
    return clients.groupby("run_id")["capacity_used"].min() < 1 - 1e-9


def sys_het(method: str, runs_narrow: bool) -> bool:
    """Table 1's "sys. het." mark of a row: the paper's for its own rows (FedSPU is ✗ though its clients
    freeze neurons, since they still run the full model forward), else whether our runs trained sub-models
    (a "sub-models" variant, or ``runs_narrow``: :func:`trains_sub_models` of some run)."""
    return SYS_HET.get(method, "sub-models" in method or runs_narrow)


def in_table1_order(methods: Any) -> list[str]:
    """Method labels in the paper's Table 1 order (each variant label right after its method), then the rest
    alphabetically."""
    known = [x for label, _, _ in TABLE1 for x in (label, *VARIANT_LABELS.get(label, ()))]
    present = set(methods)
    return [m for m in known if m in present] + sorted(present - set(known))


def display(table: pd.DataFrame) -> pd.DataFrame:
    """The README's Table 1 (text cells): accuracies in percent; the 'sys. het.' column says who trained
    sub-models (the paper's marks for its Table 1 methods, our runs' clients table for the others)."""
    domains = [c for c in table.columns if c not in NOT_DOMAINS]
    head = ["method", "sys. het.", "seeds", *domains, "global (best)", "global (final)", "deployed (best)",
            "deployed (final)", "worst client (final)", "train GMACs / client-round (max)"]

    def pct(v: Any) -> str:
        return "–" if pd.isna(v) else f"{100 * v:.2f}"

    def pm(v: Any, sd: Any) -> str:
        return "–" if pd.isna(v) else f"{100 * v:.2f} ± {100 * (0.0 if pd.isna(sd) else sd):.2f}"

    rows = []
    for m, r in table.iterrows():
        cells = [m, "✓" if sys_het(m, bool(r.get("sub_models", False))) else "✗",
                 str(int(r["seeds"]))]
        cells += [pct(r[d]) for d in domains]
        cells += [pm(r["global"], r["global_std"]), pct(r["final_global"]),
                  pm(r.get("deployed"), r.get("deployed_std")), pct(r.get("deployed_final")), pct(r.get("worst_client")),
                  "–" if pd.isna(r.get("train_gmacs")) else f"{r['train_gmacs']:.2f} ({r['max_train_gmacs']:.2f})"]
        rows.append(cells)
    return pd.DataFrame(rows, columns=head, dtype=object)


def to_markdown(table: pd.DataFrame) -> str:
    """:func:`display` through the one renderer, :func:`analysis.display.markdown`."""
    return markdown(display(table))


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
