"""Accuracy against simulated device time (issue 28; docs/guides/device-time.md).

Every figure here is read from the runs' own rows: ``rounds.sim_elapsed_s`` (simulated device seconds
of rounds 1..t, fedsap_ray.devices) against the best-so-far accuracy up to round t of the run's primary
eval mode (``full_width``: the server's models, as the papers report) or of its ``deployed`` mode (each
client's own model). Methods are the Table 1 row names (:func:`analysis.comparison.method_of`); seeds
are averaged round by round (every seed of a method runs the same rounds).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import comparison, plots, runs
from analysis.metrics import primary_rounds
from fedsap_ray import results

GLOBAL = results.GLOBAL_DOMAIN
MEASURES = ("full_width", "deployed")


def elapsed(res: Any) -> pd.DataFrame:
    """One row per (run, round): method, seed, ``hours`` (simulated elapsed), and the best-so-far
    ``full_width`` and ``deployed`` accuracy up to that round (NaN before its first evaluation)."""
    res = runs.load_sweep(res)
    rounds = runs.table(res, "rounds")
    if "sim_elapsed_s" not in rounds.columns:
        raise ValueError("these runs record no simulated device time (rounds.sim_elapsed_s, results schema >= 6)")
    clock = rounds.drop_duplicates(["run_id", "round"])[["run_id", "round", "sim_elapsed_s"]]
    out = clock.assign(hours=clock["sim_elapsed_s"] / 3600.0).drop(columns="sim_elapsed_s")
    full = primary_rounds(rounds)
    full = full[full["domain"] == GLOBAL][["run_id", "round", "acc"]].rename(columns={"acc": "full_width"})
    dep = rounds[(rounds["eval_mode"] == "deployed") & (rounds["domain"] == GLOBAL) & rounds["accuracy"].notna()]
    dep = dep[["run_id", "round", "accuracy"]].rename(columns={"accuracy": "deployed"})
    out = out.merge(full, on=["run_id", "round"], how="left").merge(dep, on=["run_id", "round"], how="left")
    out = out.sort_values(["run_id", "round"], kind="stable")
    for m in MEASURES:  # best so far: what a reader of the run at that hour could have deployed
        out[m] = out.groupby("run_id", sort=False)[m].cummax()
    pr = runs.per_run(res).set_index("run_id")
    out["method"] = out["run_id"].map({rid: comparison.TABLE1_ROWS.get(x, x) for rid, x in pr["label"].items()})
    out["seed"] = out["run_id"].map(pr["seed"])
    return out.reset_index(drop=True)


def time_to_accuracy(res: Any, *, full_width: float | None = None, deployed: float | None = None) -> pd.DataFrame:
    """Per method: simulated hours until the best-so-far accuracy first reaches each target (mean and
    std over the seeds that reached it) and how many seeds did (``reached``: "2/3")."""
    e = elapsed(res)
    rows = []
    for method, g in e.groupby("method", sort=False):
        row: dict[str, Any] = {"method": method}
        n = g["run_id"].nunique()
        for measure, target in (("full_width", full_width), ("deployed", deployed)):
            if target is None:
                continue
            hit = g[g[measure] >= target].groupby("run_id")["hours"].min()
            row[f"{measure}_hours"] = hit.mean() if len(hit) else np.nan
            row[f"{measure}_hours_std"] = hit.std(ddof=0) if len(hit) > 1 else np.nan
            row[f"{measure}_reached"] = f"{len(hit)}/{n}"
        row["total_hours"] = g.groupby("run_id")["hours"].max().mean()
        rows.append(row)
    return pd.DataFrame(rows)


def curves(res: Any, measure: str = "deployed") -> pd.DataFrame:
    """Per method and round: mean simulated hours and mean best-so-far ``measure`` accuracy over seeds."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    e = elapsed(res)
    return e.groupby(["method", "round"], sort=False).agg(hours=("hours", "mean"), accuracy=(measure, "mean"),
                                                         seeds=("run_id", "nunique")).reset_index()


def plot_curves(res: Any, measure: str = "deployed", path: str | Path | None = None) -> Any:
    """Best-so-far accuracy against simulated hours, one line per method (the figure to read rather than a table)."""
    c = curves(res, measure)
    fig, (ax,) = plots.new_figure(1, ncols=1, panel=(6.0, 4.0))
    methods = list(dict.fromkeys(c["method"]))
    for i, m in enumerate(methods):
        g = c[c["method"] == m]
        ax.plot(g["hours"], 100 * g["accuracy"], label=m, color=plots.color(i, len(methods)))
    ax.set_xlabel("simulated device time (hours)")
    ax.set_ylabel(f"best-so-far {'deployed' if measure == 'deployed' else 'full-width'} accuracy (%)")
    ax.legend(fontsize=8)
    return plots.finish(fig, path)
