"""The authors'-code readings study (sweeps/readings.py, docs/studies/readings.md): per method and reading, what
the full-width model, the deployed models and the worst client got, and the compute a client spent.

The measures were fixed before the study ran (issue 55 item 4), per run and then mean ± std over seeds: the
full-width (global) model's best and final accuracy; the deployed models' (each client's own sub-model on its
own domain, evaluated every 5th round) best and final accuracy; the worst client at the final round; the mean
forward GMACs one client spent training in one round (``clients.train_macs``: under FjORD's per-step widths,
each step at the width it drew). A difference between two readings of one method is read as a change only when
it exceeds the larger of their seed standard deviations; below that it is noise.

    python -m analysis.readings runs/readings
"""
from __future__ import annotations

import sys
from typing import Any

import pandas as pd

from analysis import display, runs, sweep
from fedsap_ray.cli import OneLineParser

MEASURES = {"full-width best": "best_global_accuracy", "full-width final": "final_global_accuracy",
            "deployed best": "deployed", "deployed final": "deployed_final", "worst client final": "worst_client",
            "GMACs / client-round": "train_gmacs"}
NOT_PERCENT = ("GMACs / client-round",)
# the measures compared between readings of a method (the verdict table), in order
COMPARED = ("full-width best", "deployed final", "worst client final")


def method_of(variant: str) -> str:
    """The method a variant reads (``fjord-batch`` -> ``fjord``): the part of its name before the first dash."""
    return variant.split("-", 1)[0]


def per_run(res: Any) -> pd.DataFrame:
    """:func:`analysis.sweep.per_run` of the study's finished runs, with each run's ``method``."""
    pr = sweep.per_run(sweep.load_sweep(res))
    pr = pr[pr["status"] == "finished"].copy()
    pr["method"] = pr["variant"].map(method_of)
    # each method's rows together, its default reading first
    order = pr["variant"].map(lambda v: (method_of(v), v != method_of(v), v))
    return pr.iloc[sorted(range(len(pr)), key=lambda i: (order.iloc[i], pr["seed"].iloc[i]))]


def table(res: Any) -> pd.DataFrame:
    """Mean and std over seeds of every measure, one row per variant (in run-id order)."""
    return sweep.mean_std(per_run(res), "variant", MEASURES)


def verdicts(res: Any) -> pd.DataFrame:
    """Per method's non-default reading and compared measure: the mean difference to the method's default
    reading (the variant named as the method), the noise it must exceed (the larger of the two seed stds) and
    whether it does; in points of accuracy."""
    pr = per_run(res)
    rows = []
    for variant, own in pr.groupby("variant", sort=False):
        method = method_of(str(variant))
        base = pr[pr["variant"] == method]
        if variant == method or base.empty:
            continue
        for name in COMPARED:
            col = MEASURES[name]
            diff = own[col].mean() - base[col].mean()
            noise = max(own[col].std(ddof=1), base[col].std(ddof=1))
            rows.append({"reading": variant, "against": method, "measure": name, "difference": 100 * diff,
                         "noise (larger std)": 100 * noise, "beyond noise": bool(abs(diff) > noise)})
    return pd.DataFrame(rows)


def report(res: Any) -> str:
    """The study's tables as markdown: mean ± std per variant, per seed, and each reading against its default."""
    res = sweep.load_sweep(res)
    pr = per_run(res)
    if pr.empty:
        return "No finished run of the readings study in the folder."
    main = sweep.markdown(sweep.pm_table(table(res), not_percent=NOT_PERCENT))
    seeds = display.per_seed(pr, ["best_global_accuracy", "deployed_final", "worst_client"])
    v = verdicts(res)
    return "\n".join(["# Readings of HeteroFL, FjORD and FedRolex", "",
                      "Mean ± std over seeds (accuracies in %).", "", main, "",
                      "## Per seed (%)", "", sweep.markdown(seeds), "",
                      "## Each reading against the method's default (points; beyond noise: |difference| > the "
                      "larger std)", "",
                      sweep.markdown(v.round(1)) if len(v) else "–", ""])


def main(argv: list[str] | None = None) -> int:
    """``python -m analysis.readings FOLDER``: the readings study's tables."""
    p = OneLineParser(prog="python -m analysis.readings", description=main.__doc__)
    p.add_argument("folder", help="the study's results folder (sweeps/readings.py --out)")
    args = p.parse_args(argv)
    print(report(runs.open_or_exit(args.folder, "analysis.readings")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
