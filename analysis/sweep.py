"""Mean ± std over seeds, and FedSAP-style tables whose rows are option settings.

The building blocks live in their own modules and are re-exported here, so ``from analysis import
sweep`` reaches all of them: loading and the per-run table (:mod:`analysis.runs`), the run label and
resolved options (:mod:`analysis.labels`), per-run figures (:mod:`analysis.metrics`) and display
(:mod:`analysis.display`).
"""
from __future__ import annotations

import warnings
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import pandas as pd

from analysis.display import MISSING, NOT_PERCENT, drop_unrecorded, markdown, pm_table, show
from analysis.labels import (OPT, differing_keys, label, mixed_warning, protocol, resolved_options, same_value,
                             split_configs)
from analysis.metrics import (DEPLOYED, DEVICE_COLUMNS, GLOBAL, deployed_accuracy, domain_best, global_accuracy,
                              grouping_stats, primary_rounds, train_compute, width_stats)
from analysis.runs import (IDENTITY, RUN_COLUMNS, TABLES, MissingData, annotate_runs, join_runs, joined, load_sweep, locate,
                           per_run, table)

__all__ = ["DEPLOYED", "DEVICE_COLUMNS", "GLOBAL", "IDENTITY", "MISSING", "NOT_PERCENT", "OPT", "RUN_COLUMNS", "TABLES",
           "MissingData", "annotate_runs", "deployed_accuracy", "differing_keys", "domain_best", "drop_unrecorded",
           "global_accuracy", "grouping_stats", "join_runs", "joined", "label", "load_sweep", "locate", "markdown",
           "mean_std", "mixed_warning", "option_table", "per_run", "pm_table", "primary_rounds", "protocol",
           "resolved_options", "same_value", "select_runs", "show", "split_configs", "table", "train_compute",
           "width_stats"]


def mean_std(df: pd.DataFrame, by: str | Sequence[str], cols: Sequence[str] | Mapping[str, str],
             seed: str = "seed") -> pd.DataFrame:
    """Mean and sample std (NaN for one seed) over the rows of each ``by`` group: columns ``by``,
    ``seeds`` (distinct values of ``seed``, or rows when there is no such column), ``<name>_mean``,
    ``<name>_std``. ``cols`` is a list of columns or a mapping output name -> column. Groups keep
    their first-appearance order."""
    by = [by] if isinstance(by, str) else list(by)
    cols = dict(cols) if isinstance(cols, Mapping) else {c: c for c in cols}
    named: dict[str, tuple[str, Any]] = {"seeds": (seed, "nunique") if seed in df.columns else (by[0], "size")}
    for name, c in cols.items():
        named[f"{name}_mean"] = (c, "mean")
        named[f"{name}_std"] = (c, "std")
    if df.empty:
        return pd.DataFrame(columns=[*by, *named])
    num = df.assign(**{c: pd.to_numeric(df[c], errors="coerce") for c in set(cols.values())})
    return num.groupby(by, sort=False, dropna=False).agg(**named).reset_index()


# ----------------------------------------------------------------------------- selecting runs by config

def select_runs(runs: pd.DataFrame, algorithm: str, vary: Iterable[str] = ()) -> pd.DataFrame:
    """The runs of ``algorithm`` that change at most the options ``vary`` from the strategy's defaults.

    Options on which every run of ``algorithm`` in the folder agrees are the study's protocol
    (e.g. a preset's warm-up) and are not compared; any other option must be at its default, so a
    run that changes something else (e.g. ``dga_layer`` in a Table 2 run) belongs to another table.
    """
    runs = runs if "label" in runs.columns else annotate_runs(runs)
    cand = runs[runs["algorithm"] == algorithm]
    if cand.empty:
        return cand
    defaults = resolved_options(algorithm)
    unknown = sorted(set(vary) - set(defaults))
    if unknown:
        raise ValueError(f"vary={unknown}: not options of algorithm {algorithm!r}; allowed: {', '.join(defaults)}")
    ok = pd.Series(True, index=cand.index)
    for name, default in defaults.items():
        col = OPT + name
        if name in vary or col not in cand.columns:
            continue
        values = cand[col].tolist()
        if all(same_value(v, values[0]) for v in values):
            continue  # the protocol: shared by every run of this algorithm
        ok &= cand[col].map(lambda v, d=default: same_value(v, d))
    return cand[ok]


def option_table(res: Any, algorithm: str, rows: Sequence[tuple[str, Mapping[str, Any]]], *,
                 domains: bool = False, grouping: bool = False, finished_only: bool = True) -> pd.DataFrame:
    """Mean ± std over seeds of best / final global accuracy for each ``(label, options)`` row: the
    runs of ``algorithm`` (see :func:`select_runs`) whose resolved options equal ``options``. A run can
    fall in several rows (a one-factor study's reference run). Rows without runs are left out.

    Columns: ``row``, ``variants`` (the run ids' variant names), ``seeds``, ``best_mean``/``_std``,
    ``final_mean``/``_std``; ``domains`` adds ``<domain>_mean``/``_std`` (best-so-far per domain),
    ``grouping`` adds the DGA means/stds of ``n_groups``, ``ari_domain``, ``ari_capacity``. Every table
    also has :data:`DEVICE_COLUMNS` (NaN where the runs did not record them): the deployed models' best
    and final accuracy, the worst client, and the training GMACs per client-round.
    Runs of one row whose protocols (:func:`protocol` without the algorithm) differ beyond the seed
    are split into rows ``<label> [<differing keys>]`` with a :class:`UserWarning`.
    """
    res = load_sweep(res)
    vary = sorted({k for _, opts in rows for k in opts})
    runs = select_runs(res.runs, algorithm, vary)
    if finished_only and "status" in runs.columns:
        runs = runs[runs["status"] == "finished"]
    every = per_run(res, domains=domains).set_index("run_id")
    cols: dict[str, str] = {"best": "best_global_accuracy", "final": "final_global_accuracy"}
    if domains:
        cols.update({d: d for d in domain_best(table(res, "rounds")).columns if d != "global"})
    if grouping:
        cols.update({c: c for c in ("n_groups", "ari_domain", "ari_capacity")})
    # what each client really ran and spent (issue 13): the deployed models' accuracy and the training compute
    cols.update({c: c for c in DEVICE_COLUMNS})
    config = [c for c in every.columns if str(c).startswith("config.")]
    pr = every.loc[runs["run_id"], ["variant", "seed", *cols.values(), *config]]
    parts = []
    for name, opts in rows:
        match = pd.Series(True, index=runs.index)
        for k, v in opts.items():
            match &= runs[OPT + k].map(lambda x, v=v: same_value(x, v)) if OPT + k in runs.columns else False
        ids = runs.loc[match, "run_id"]
        if len(ids):
            parts.append(pr.loc[ids].assign(row=name).reset_index())
    if not parts:
        return pd.DataFrame(columns=["row", "variants", *mean_std(pd.DataFrame(), ["row"], cols).columns[1:]])
    long = pd.concat(parts, ignore_index=True)
    # never pool runs whose protocols differ beyond the seed (issue 14)
    row_configs, mixed = split_configs(long, ["row"], algorithm=False)
    if mixed:
        warnings.warn(mixed_warning(mixed), UserWarning, stacklevel=2)
        long["row"] = [f"{r} [{c}]" if c else r for r, c in zip(long["row"], row_configs)]
    out = mean_std(long, "row", cols)
    names = long.groupby("row", sort=False)["variant"].agg(lambda s: ", ".join(dict.fromkeys(s)))
    out.insert(1, "variants", out["row"].map(names))
    return out
