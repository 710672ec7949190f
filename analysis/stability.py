"""FedSAP's mask stability study (sweeps/mask_stability.py, docs/studies/mask-stability.md): per reading,
what the full-width model, the deployed models and the narrowest clients got, and how much the masks moved.

The measures were fixed before the study ran (issue 24): full-width best; deployed best and final;
worst client at the final round; the mean share of a keep-min client's active channels that are new
each round after warm-up (``clients.n_new_channels``); the minimum over domains of the final
``domain_coverage``; DGA's ARI against the true domains and against the capacities (mean over DGA rounds).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from analysis import display, sweep

MEASURES = {"full-width best": "best_global_accuracy", "deployed best": "deployed", "deployed final": "deployed_final",
            "worst client final": "worst_client", "swap share keep-min": "swap_narrow",
            "min domain coverage": "min_coverage", "ARI domains": "ari_domain", "ARI capacities": "ari_capacity"}
NOT_PERCENT = ("ARI domains", "ARI capacities")


def swap_shares(res: Any) -> pd.DataFrame:
    """Per run and capacity (``capacity_max``): the mean share of a client's active channels that were not
    active in the mask it last trained under, over the rounds after warm-up (``round > warmup``)."""
    res = sweep.load_sweep(res)
    clients = sweep.table(res, "clients")
    if "n_new_channels" not in clients.columns:
        return pd.DataFrame(columns=["run_id", "capacity_max", "swap_share"])
    warmup = res.runs.set_index("run_id")[sweep.OPT + "warmup"] if sweep.OPT + "warmup" in res.runs.columns else None
    c = clients.dropna(subset=["n_new_channels"]).copy()
    if warmup is not None:
        c = c[c["round"] > c["run_id"].map(warmup).fillna(0).astype(float)]
    c["swap_share"] = c["n_new_channels"].astype(float) / (c["n_global"] + c["n_private"]).clip(lower=1)
    return c.groupby(["run_id", "capacity_max"], as_index=False)["swap_share"].mean()


def final_coverage(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per run (rows) and test domain (columns, in the rounds table's order) of a ``rounds`` table:
    ``domain_coverage`` at the run's last evaluated round of its primary eval mode."""
    cov = sweep.primary_rounds(rounds)
    cov = cov[cov["round"] == cov.groupby("run_id")["round"].transform("max")]
    cov = cov.pivot_table(index="run_id", columns="domain", values="domain_coverage", aggfunc="first")
    return cov[[d for d in dict.fromkeys(rounds["domain"]) if d in cov.columns and d != sweep.GLOBAL]]


def min_coverage(res: Any) -> pd.Series:
    """Per run, the least over the test domains of ``domain_coverage`` at the last evaluated round."""
    return final_coverage(sweep.table(sweep.load_sweep(res), "rounds")).min(axis=1).rename("min_coverage")


def per_run(res: Any) -> pd.DataFrame:
    """:func:`analysis.sweep.per_run` of the finished FedSAP runs plus ``swap_narrow`` and ``min_coverage``."""
    res = sweep.load_sweep(res)
    pr = sweep.per_run(res)
    pr = pr[pr["algorithm"].isin(("fedsap", "fedsap_fixed")) & (pr["status"] == "finished")].set_index("run_id")
    shares = swap_shares(res)
    narrow = shares[shares["capacity_max"] == shares.groupby("run_id")["capacity_max"].transform("min")]
    pr = pr.join(narrow.set_index("run_id")["swap_share"].rename("swap_narrow")).join(min_coverage(res))
    return pr.reset_index()


def table(res: Any) -> pd.DataFrame:
    """Mean and std over seeds of every measure, one row per variant (in run-id order)."""
    return sweep.mean_std(per_run(res), "variant", MEASURES)


def by_capacity(res: Any) -> pd.DataFrame:
    """Mean swapped share after warm-up per variant (rows) and capacity (columns ``keep 0.2`` ..., the
    report's historical label), over seeds."""
    res = sweep.load_sweep(res)
    shares = swap_shares(res).merge(res.runs[["run_id", "variant"]], on="run_id")
    if shares.empty:
        return pd.DataFrame()
    out = shares.pivot_table(index="variant", columns="capacity_max", values="swap_share", aggfunc="mean", sort=False)
    out.columns = [f"keep {k:g}" for k in out.columns]
    return out.reset_index()


def report(res: Any) -> str:
    """The study's tables as markdown: per variant mean ± std over seeds, per seed, and swaps per capacity."""
    res = sweep.load_sweep(res)
    pr = per_run(res)
    if pr.empty:
        return "No FedSAP run in the folder."
    main = sweep.markdown(sweep.pm_table(table(res), not_percent=NOT_PERCENT))
    seeds = display.per_seed(pr, ["deployed_final", "worst_client", "swap_narrow"])
    keep = by_capacity(res)
    return "\n".join(["# FedSAP mask stability", "", "Mean ± std over seeds (accuracies and shares in %).", "", main, "",
                      "## Per seed", "", sweep.markdown(seeds), "",
                      "## Swapped share after warm-up, per keep ratio (%)", "",
                      sweep.markdown((keep.set_index("variant") * 100).round(1).reset_index()) if len(keep) else "–", ""])
