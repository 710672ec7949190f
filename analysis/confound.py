"""Capacity-confound tables (papers/003, "Capacity Confounds in Adaptive Sub-model FL").

Rebuilds the paper's result tables from our Parquet results folder (docs/reference/results.md),
never from the paper's numbers:

- Tables 3 and 6 (sections 4.2, 4.5): best / final accuracy and average width p per
  allocation strategy, mean ± std over seeds (:func:`summary_table`);
- Table 4 (section 4.3): the coverage-guarantee ablation, with the peak-to-final drop and
  the coordinates left frozen at initialisation (:func:`coverage_table`);
- Table 5 (section 4.4): correlations of the final smoothed estimates H~_i (Eq. 5) with
  the ground-truth TV distance and the capacity p_max, plain and partial
  (:func:`correlation_table`);
- the matched-budget control of section 4.4 (:func:`matched_budget`);
- Figure 6: the accuracy-capacity frontier (:func:`frontier`, :func:`plot_frontier`);
- Table 1: per-client cost as a function of width, from the model itself (:func:`cost_table`).

Accuracies are fractions in the DataFrames and percent in the markdown; the
peak-to-final drop is ``final - best`` (a negative number, as in Table 4).
"""
from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from analysis import sweep
from fedsap_ray import results

GLOBAL = results.GLOBAL_DOMAIN

# Display label per registry name (variant_of); options refine a few of them.
LABELS = {
    "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "heterofl": "HeteroFL",
    "fjord": "FjORD", "uniform": "Uniform", "hasfl": "HAS-FL", "random_budget": "Random-budget",
}
HASFL, HASFL_NO_COVERAGE, RANDOM_BUDGET = "HAS-FL", "HAS-FL (no coverage)", "Random-budget"
# Paper Table 6 "Type" column.
VARIANT_TYPE = {
    "FedAvg": "Full-model", "SCAFFOLD": "Full-model + CV", "FedProx": "Full-model + prox",
    HASFL: "Sub-model (adaptive)", HASFL_NO_COVERAGE: "Sub-model (adaptive, no coverage)",
    RANDOM_BUDGET: "Sub-model (random)", "HeteroFL": "Sub-model (static)", "FjORD": "Sub-model (random tiers)",
    "Uniform": "Sub-model (fixed)",
}
TABLE3_VARIANTS = (HASFL, "FjORD", "Uniform")                      # section 4.2
TABLE4_VARIANTS = (HASFL, HASFL_NO_COVERAGE, "HeteroFL", "Uniform")  # section 4.3 (+ Uniform: Prop. 3's case)
TABLE6_VARIANTS = ("FedAvg", "SCAFFOLD", "FedProx", HASFL, RANDOM_BUDGET)  # section 4.5
VARIANT_ORDER = ("FedAvg", "SCAFFOLD", "FedProx", HASFL, HASFL_NO_COVERAGE, RANDOM_BUDGET,
                 "HeteroFL", "FjORD", "Uniform")

# summary name -> per_run column
METRICS = {"best": "best_accuracy", "final": "final_accuracy", "drop": "peak_to_final", "avg_p": "avg_p",
           "frozen": "final_frozen_params", "widest": "widest_p_late"}
# Table 5 columns: key -> (x, y, control or None)
CORRELATIONS = {
    "H_TV": ("h_tilde", "tv_distance", None),
    "H_pmax": ("h_tilde", "capacity_max", None),
    "H_TV|pmax": ("h_tilde", "tv_distance", "capacity_max"),
    "p_TV|pmax": ("p", "tv_distance", "capacity_max"),
}


# ----------------------------------------------------------------------------- loading

def _load(path_or_res: Any) -> Any:
    """A Results-like object with runs, rounds, clients and allocations DataFrames.

    ``path_or_res`` is a results folder or an object with those attributes. A folder whose
    ``allocations/`` table :func:`fedsap_ray.results.load` does not expose is read with
    :func:`pandas.read_parquet`; a missing table becomes an empty DataFrame.
    """
    folder: Path | None = None
    if isinstance(path_or_res, (str, Path)):
        folder = Path(path_or_res)
        res = results.load(folder)
    else:
        res = path_or_res
    tables = {}
    for name in ("runs", "rounds", "clients", "allocations"):
        df = getattr(res, name, None)
        if df is None and name == "allocations" and folder is not None and (folder / name).is_dir():
            files = [f for f in (folder / name).glob("*.parquet") if not f.name.startswith((".", "_"))]
            df = pd.concat([pd.read_parquet(f) for f in sorted(files)], ignore_index=True) if files else None
        tables[name] = df if df is not None else pd.DataFrame()
    return SimpleNamespace(**tables)


def _col(df: pd.DataFrame, name: str, default: Any = np.nan) -> pd.Series:
    return df[name] if name in df.columns else pd.Series(default, index=df.index, dtype=object if default is None else None)


# ----------------------------------------------------------------------------- variants

def _false(v: Any) -> bool:
    return v is False or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0) or \
        (isinstance(v, str) and v.strip().lower() in ("false", "0", "no", "off"))


def variant_of(run_row: Mapping[str, Any]) -> str:
    """Display label of a run (papers/003 Tables 3, 4, 6 row names) from its ``runs`` row.

    ``hasfl`` with ``algorithm.options.coverage`` false is "HAS-FL (no coverage)" (Table 4)
    (likewise "Random-budget (no coverage)");
    FedAvg/FedProx trained at capacity width get a suffix; unknown names fall back to the
    registry name.
    """
    cfg = run_row.get("config_json") if hasattr(run_row, "get") else None
    if isinstance(cfg, str) and cfg:
        cfg = json.loads(cfg)
    cfg = cfg if isinstance(cfg, Mapping) else {}
    algo_cfg = cfg.get("algorithm") or {}
    name = run_row.get("algorithm") if hasattr(run_row, "get") else None
    if not isinstance(name, str) or not name:
        name = algo_cfg.get("name", "")
    opts = algo_cfg.get("options") or {}
    label = LABELS.get(name, name)
    if name in ("hasfl", "random_budget") and _false(opts.get("coverage", True)):
        return HASFL_NO_COVERAGE if name == "hasfl" else f"{label} (no coverage)"
    if name in ("fedavg", "fedprox") and opts.get("width", "full") == "capacity":
        return f"{label} (capacity width)"
    return label


def _order(variants: Iterable[str]) -> list[str]:
    vs = list(dict.fromkeys(variants))
    rank = {v: i for i, v in enumerate(VARIANT_ORDER)}
    return sorted(vs, key=lambda v: (rank.get(v, len(rank)), v))


# ----------------------------------------------------------------------------- per run

def per_run(res: Any) -> pd.DataFrame:
    """One row per run: variant, seed, best / final global accuracy, peak-to-final drop,
    average width p and the final count of never-covered coordinates.

    Accuracy is ``global_accuracy`` (``accuracy`` where null) of the ``__global__`` rows on
    evaluated rounds of the run's primary eval mode (the first one written); best is the
    maximum, final the last evaluated round, peak_to_final = final - best (Table 4 "Peak→final Δ").
    avg_p is the mean over rounds of ``avg_capacity`` (Tables 3/6 "Avg. p", Figure 6 p̄);
    ``final_frozen_params`` is ``frozen_params`` at the last round that reports it
    (Proposition 3's frozen coordinates); ``widest_p_late`` is the mean over the last
    :data:`LATE_ROUNDS` rounds of the widest width any participant trained (from the
    ``clients`` table): below 1, the outer slice of every layer went untrained in those
    rounds even when it was covered earlier (HAS-FL without the guarantee after warm-up).
    """
    res = _load(res)
    runs = res.runs.copy()
    out = pd.DataFrame({
        "run_id": runs["run_id"],
        "study": _col(runs, "study", None), "dataset": _col(runs, "dataset", None),
        "algorithm": _col(runs, "algorithm", None),
        "variant": [variant_of(r) for _, r in runs.iterrows()],
        "seed": _col(runs, "seed", None), "status": _col(runs, "status", None),
        "config_json": _col(runs, "config_json", None),
    }).set_index("run_id")
    rounds = res.rounds
    cols = ["rounds", "best_accuracy", "final_accuracy", "peak_to_final", "avg_p", "final_frozen_params", "widest_p_late"]
    if rounds.empty:
        for c in cols:
            out[c] = np.nan
        return out.reset_index()
    stats_ = sweep.global_accuracy(rounds).rename(columns={"best_global_accuracy": "best_accuracy",
                                                            "final_global_accuracy": "final_accuracy"})
    stats_["peak_to_final"] = stats_["final_accuracy"] - stats_["best_accuracy"]
    # per-round quantities: the same on every row of a round, so take one per (run, round)
    all_rows = rounds.assign(avg_capacity=pd.to_numeric(_col(rounds, "avg_capacity"), errors="coerce"),
                             frozen=pd.to_numeric(_col(rounds, "frozen_params"), errors="coerce"))
    per_round = all_rows.sort_values(["run_id", "round"]).groupby(["run_id", "round"]).agg(
        avg_capacity=("avg_capacity", "first"), frozen=("frozen", "first")).reset_index()
    stats_ = stats_.join(per_round.groupby("run_id").agg(
        rounds=("round", "max"),
        avg_p=("avg_capacity", "mean"),
        final_frozen_params=("frozen", lambda s: s.dropna().iloc[-1] if s.notna().any() else np.nan)), how="outer")
    stats_ = stats_.join(_widest_late(res.clients).rename("widest_p_late"), how="left")
    out = out.join(stats_[cols])
    return out.reset_index()


LATE_ROUNDS = 10


def _widest_late(clients: pd.DataFrame) -> pd.Series:
    """Per run: mean over its last LATE_ROUNDS rounds of max(capacity_used) over that round's clients."""
    if clients is None or clients.empty or "capacity_used" not in clients.columns:
        return pd.Series(dtype=float)
    widest = clients.groupby(["run_id", "round"])["capacity_used"].max().reset_index()
    last = widest.groupby("run_id")["round"].transform("max")
    late = widest[widest["round"] > last - LATE_ROUNDS]
    return late.groupby("run_id")["capacity_used"].mean()


def _finished(pr: pd.DataFrame) -> pd.DataFrame:
    if "status" not in pr.columns:
        return pr
    return pr[pr["status"].isna() | (pr["status"] == "finished")]


def _groups(pr: pd.DataFrame) -> list[str]:
    return ["dataset", "variant"] if "dataset" in pr.columns else ["variant"]


def summary_table(per_run_df: pd.DataFrame, variants: Sequence[str] | None = None,
                  metrics: Sequence[str] = ("best", "final", "drop", "avg_p")) -> pd.DataFrame:
    """Mean and std over seeds per (dataset, variant) of best / final accuracy, peak-to-final
    drop and average width p: the layout of papers/003 Tables 3, 4 and 6.

    Columns ``<metric>_mean`` / ``<metric>_std`` (sample std, NaN for one seed) for each name
    in ``metrics`` (keys of :data:`METRICS`), plus ``seeds``. ``variants`` selects and orders
    the rows; by default every variant in the paper's order.

    Runs of one (dataset, variant) whose resolved configurations differ beyond the seed
    (:func:`analysis.sweep.split_configs`, e.g. 2 rounds at full width and 30 at half width) are
    never pooled: the table gains a ``config`` column with the differing keys' values, one row per
    configuration, a :class:`UserWarning` names the keys, and ``attrs["mixed"]`` holds them.
    """
    pr = per_run_df
    if variants is not None:
        pr = pr[pr["variant"].isin(list(variants))]
    keys = _groups(pr)
    labels, mixed = sweep.split_configs(pr, keys)
    if mixed:
        warnings.warn(sweep.mixed_warning(mixed), UserWarning, stacklevel=2)
        pr = pr.assign(config=labels)
        keys = [*keys, "config"]
    named = {"seeds": ("seed", "nunique")}
    for m in metrics:
        named[f"{m}_mean"] = (METRICS[m], "mean")
        named[f"{m}_std"] = (METRICS[m], "std")
    if pr.empty:
        return pd.DataFrame(columns=[*keys, *named])
    pr = pr.assign(**{METRICS[m]: pd.to_numeric(pr[METRICS[m]], errors="coerce") for m in metrics})
    agg = pr.groupby(keys, dropna=False).agg(**named).reset_index()
    order = list(variants) if variants is not None else _order(agg["variant"])
    agg["_rank"] = agg["variant"].map({v: i for i, v in enumerate(order)})
    sort = (["dataset", "_rank"] if "dataset" in keys else ["_rank"]) + (["config"] if mixed else [])
    out = agg.sort_values(sort, kind="stable").drop(columns="_rank").reset_index(drop=True)
    out.attrs["mixed"] = mixed
    return out


def coverage_table(per_run_df: pd.DataFrame) -> pd.DataFrame:
    """papers/003 Table 4: HAS-FL with and without the coverage guarantee and HeteroFL (plus Uniform,
    the every-client-capped case of Proposition 3) — best, final, peak-to-final drop, average p,
    final frozen coordinates and the widest width trained late in the run (mean ± std)."""
    return summary_table(per_run_df, TABLE4_VARIANTS, metrics=("best", "final", "drop", "avg_p", "frozen", "widest"))


def frontier(per_run_df: pd.DataFrame) -> pd.DataFrame:
    """papers/003 Figure 6 data: per (dataset, variant) mean/std of final accuracy and of
    the average per-round width p̄."""
    return summary_table(per_run_df, metrics=("final", "avg_p"))


def frontier_figure(df: pd.DataFrame) -> Any:
    """Figure 6 as a matplotlib Figure (Agg canvas, no pyplot state): final accuracy vs. average
    per-round capacity, error bars = std over seeds in both axes, one labelled point per variant;
    one panel per dataset. ``df`` is :func:`frontier`'s table."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    datasets = list(dict.fromkeys(df["dataset"])) if "dataset" in df.columns else [None]
    fig = Figure(figsize=(5.0 * max(1, len(datasets)), 4.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(datasets)), squeeze=False)[0]
    for ax, ds in zip(axes, datasets):
        part = df if ds is None else df[df["dataset"] == ds]
        for _, r in part.iterrows():
            x, y = r["avg_p_mean"], 100 * r["final_mean"]
            xerr = 0.0 if pd.isna(r["avg_p_std"]) else r["avg_p_std"]
            yerr = 0.0 if pd.isna(r["final_std"]) else 100 * r["final_std"]
            ax.errorbar([x], [y], xerr=[xerr], yerr=[yerr], fmt="o", capsize=3, label=r["variant"])
            ax.annotate(str(r["variant"]), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel("Average per-round capacity p̄")
        ax.set_ylabel("Final accuracy (%)")
        if ds is not None:
            ax.set_title(str(ds))
        ax.grid(alpha=0.3)
        if len(part):
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def plot_frontier(df: pd.DataFrame, path: str | Path) -> Path:
    """Write Figure 6 (:func:`frontier_figure`) as a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frontier_figure(df).savefig(path, format="png", dpi=120)
    return path


# ----------------------------------------------------------------------------- correlations

class Corr(NamedTuple):
    """A (partial) correlation with its two-sided p-value, 95% CI and sample size."""
    r: float
    pvalue: float
    ci_low: float
    ci_high: float
    n: int


def _nan_corr(n: int) -> Corr:
    return Corr(math.nan, math.nan, math.nan, math.nan, int(n))


def _complete(*cols: np.ndarray) -> list[np.ndarray]:
    arrs = [np.asarray(c, dtype=float) for c in cols]
    ok = np.ones(len(arrs[0]), dtype=bool)
    for a in arrs:
        ok &= np.isfinite(a).all(axis=1) if a.ndim == 2 else np.isfinite(a)
    return [a[ok] for a in arrs]


def _constant(v: np.ndarray) -> bool:
    return v.size == 0 or float(np.ptp(v)) == 0.0


def _fisher_ci(r: float, n_eff: int, level: float = 0.95) -> tuple[float, float]:
    """Fisher z interval: atanh(r) ± z_{(1+level)/2} / sqrt(n_eff)."""
    if n_eff <= 0:
        return math.nan, math.nan
    with np.errstate(divide="ignore"):
        z = np.arctanh(np.clip(r, -1.0, 1.0))
    half = stats.norm.ppf(0.5 + level / 2) / math.sqrt(n_eff)
    return float(np.tanh(z - half)), float(np.tanh(z + half))


def pearson(x: Sequence[float], y: Sequence[float]) -> Corr:
    """Pearson r (scipy.stats.pearsonr) with its p-value and 95% CI (Fisher z, n-3) over the
    pairwise-complete observations; NaN (no exception) for a constant input or n < 3."""
    x, y = _complete(x, y)
    n = len(x)
    if n < 3 or _constant(x) or _constant(y):
        return _nan_corr(n)
    res = stats.pearsonr(x, y)
    lo, hi = (math.nan, math.nan)
    if n > 3:
        ci = res.confidence_interval(confidence_level=0.95)
        lo, hi = float(ci.low), float(ci.high)
    return Corr(float(res.statistic), float(res.pvalue), lo, hi, n)


def tier_dummies(z: Sequence[float] | np.ndarray) -> np.ndarray:
    """One 0/1 column per capacity tier except the first (sorted) level: the categorical control of
    :func:`partial_corr` (the first tier is the baseline absorbed by the intercept)."""
    z = np.asarray(z, dtype=float).ravel()
    levels = np.unique(z[np.isfinite(z)])
    out = (z[:, None] == levels[None, 1:]).astype(float)
    out[~np.isfinite(z)] = np.nan
    return out


CONTROLS = ("tiers", "linear")  # how p_max is controlled in Table 5's partial correlations


def partial_corr(x: Sequence[float], y: Sequence[float], z: Sequence[float] | np.ndarray,
                 control: str = "linear") -> Corr:
    """Partial correlation r(x, y | z) (papers/003 Table 5): regress x and y on [1, Z] by
    least squares and correlate the residuals.

    ``control="linear"``: Z = ``z`` itself (k columns; 1-D for one control), the form of the
    textbook partial correlation. ``control="tiers"``: ``z`` is one categorical variable (the
    capacity tier p_max) and Z its k = levels - 1 dummy columns (:func:`tier_dummies`), i.e. the
    residuals are deviations from each tier's mean. Table 5 uses the tiers by default: most clients
    train exactly at their cap, so p is a step function of p_max, not a line, and a linear
    control leaves tier-mean differences in the residuals (a spurious r(p, TV | p_max); issue 14).

    p-value: t = r sqrt(df / (1 - r^2)) with df = n - 2 - k (the t-test of x's coefficient in the
    regression of y on [1, x, Z]); 95% CI: Fisher z with n - 3 - k (both lose one degree of freedom
    per control column, so per dummy). A constant variable or control (e.g. every p_max equal
    under the linear form) or too few observations give NaN without an exception.
    """
    if control not in CONTROLS:
        raise ValueError(f"control={control!r}: allowed values are {', '.join(CONTROLS)}")
    z = np.asarray(z, dtype=float)
    if control == "tiers":
        x, y, zc = _complete(x, y, z.ravel())
        z = tier_dummies(zc)
    else:
        z = z[:, None] if z.ndim == 1 else z
        x, y, z = _complete(x, y, z)
    n, k = len(x), z.shape[1]
    df = n - 2 - k
    if df < 1 or _constant(x) or _constant(y) or any(_constant(z[:, j]) for j in range(k)):
        return _nan_corr(n)
    design = np.column_stack([np.ones(n), z])
    if np.linalg.matrix_rank(design) < k + 1:
        return _nan_corr(n)
    rx = x - design @ np.linalg.lstsq(design, x, rcond=None)[0]
    ry = y - design @ np.linalg.lstsq(design, y, rcond=None)[0]
    tol = 1e-10
    if np.linalg.norm(rx) <= tol * np.linalg.norm(x - x.mean()) or \
            np.linalg.norm(ry) <= tol * np.linalg.norm(y - y.mean()):
        return _nan_corr(n)  # x or y is an exact linear function of the controls
    r = float(np.clip(np.dot(rx, ry) / (np.linalg.norm(rx) * np.linalg.norm(ry)), -1.0, 1.0))
    if abs(r) == 1.0:
        p = 0.0
    else:
        t = r * math.sqrt(df / (1.0 - r * r))
        p = float(2 * stats.t.sf(abs(t), df))
    lo, hi = _fisher_ci(r, n - 3 - k)
    return Corr(r, p, lo, hi, n)


def final_state(res: Any) -> pd.DataFrame:
    """The final per-client state of every run: the last round of the ``allocations`` table
    (all N clients: h_tilde, p, capacity_max, tv_distance) or, for a run without allocation
    rows, each client's last ``clients`` row (p = capacity_used). Column ``source`` says which.

    p is aligned with H~ (docs/readings.md, "Table 5's p"): the ``allocations`` row of round T holds
    H~ at the END of round T but the width the client was assigned FOR round T (computed from H~ one
    adaptation step earlier). For HAS-FL, ``p`` is therefore Eq. 6 + the coverage guarantee
    (:func:`fedsap_ray.algorithms.hasfl.allocation_rule`, with the run's resolved options) applied
    to the final H~ -- the allocation those estimates produce; ``p_round`` keeps the width used in
    round T. Other strategies (Random-budget's random draws, static rules) keep the round-T width.
    """
    res = _load(res)
    cols = ["run_id", "round", "client_id", "h_tilde", "p", "capacity_max", "tv_distance"]
    parts = []
    al = res.allocations
    have = set()
    if not al.empty:
        last = al.groupby("run_id")["round"].transform("max")
        a = al[al["round"] == last]
        a = pd.DataFrame({c: _col(a, c) for c in cols})
        a["p_round"] = a["p"]
        a["p"] = _aligned_p(a, res.runs)
        a["source"] = "allocations"
        parts.append(a)
        have = set(a["run_id"])
    cl = res.clients
    if not cl.empty:
        c = cl[~cl["run_id"].isin(have)].sort_values(["run_id", "client_id", "round"])
        c = c.groupby(["run_id", "client_id"], as_index=False).last()
        c = c.assign(p=_col(c, "capacity_used"))
        c = pd.DataFrame({k: _col(c, k) for k in cols})
        c["p_round"] = c["p"]
        c["source"] = "clients"
        parts.append(c)
    parts = [p for p in parts if not p.empty]
    if not parts:
        return pd.DataFrame(columns=[*cols, "p_round", "source"])
    return pd.concat(parts, ignore_index=True)


def _aligned_p(last: pd.DataFrame, runs: pd.DataFrame) -> pd.Series:
    """Per final-round allocation row: Eq. 6 (+ coverage) of the run's final H~ for HAS-FL runs, else p."""
    from fedsap_ray.algorithms.hasfl import allocation_rule

    out = pd.to_numeric(last["p"], errors="coerce").astype(float).copy()
    if runs is None or runs.empty or "config_json" not in runs.columns:
        return out
    cfgs = runs.drop_duplicates("run_id").set_index("run_id")["config_json"]
    for run_id, part in last.groupby("run_id", sort=False):
        cfg = json.loads(cfgs[run_id]) if run_id in cfgs.index and isinstance(cfgs[run_id], str) else {}
        algo = cfg.get("algorithm") or {}
        h = pd.to_numeric(part["h_tilde"], errors="coerce").to_numpy(float)
        pmax = pd.to_numeric(part["capacity_max"], errors="coerce").to_numpy(float)
        if algo.get("name") != "hasfl" or not (np.isfinite(h).all() and np.isfinite(pmax).all()):
            continue
        o = sweep.resolved_options("hasfl", algo.get("options"))
        T = int(pd.to_numeric(part["round"], errors="coerce").max())
        first_step = max(int(o["warmup"]), 1)
        first_step += (-first_step) % int(o["t_adapt"])  # first round >= warm-up that is a multiple of T_adapt
        if T < first_step:
            continue  # no adaptation step yet: the allocation is still p_max (Algorithm 1 line 3)
        out.loc[part.index] = allocation_rule(h, pmax, o["p_min"], o["gamma"], o["eps"], bool(o["coverage"]))
    return out


def correlations(state: pd.DataFrame, control: str = "tiers") -> dict[str, Corr]:
    """The four Table 5 correlations of one run's final client state; ``control`` is how the partial
    ones control for p_max (:func:`partial_corr`: ``tiers`` dummies by default, or ``linear``)."""
    out = {}
    for key, (x, y, z) in CORRELATIONS.items():
        xs, ys = _col(state, x), _col(state, y)
        out[key] = pearson(xs, ys) if z is None else partial_corr(xs, ys, _col(state, z), control=control)
    return out


def correlation_table(res: Any, variants: Sequence[str] | None = None, control: str = "tiers") -> pd.DataFrame:
    """papers/003 Table 5, one row per run: r(H~, TV), r(H~, p_max), r(H~, TV | p_max) and
    r(p, TV | p_max) over the final state of the clients (:func:`final_state`), each as
    ``r_<key>``, ``pval_<key>``, ``ci_low_<key>``, ``ci_high_<key>``, ``n_<key>``; the partial ones
    control for p_max as ``control`` says (:func:`partial_corr`), also stored in ``attrs["control"]``."""
    if control not in CONTROLS:
        raise ValueError(f"control={control!r}: allowed values are {', '.join(CONTROLS)}")
    res = _load(res)
    pr = per_run(res).set_index("run_id")
    state = final_state(res)
    rows = []
    for run_id, s in state.groupby("run_id", sort=False):
        info = pr.loc[run_id] if run_id in pr.index else pd.Series(dtype=object)
        variant = info.get("variant", None)
        if variants is not None and variant not in variants:
            continue
        row = {"run_id": run_id, "dataset": info.get("dataset", None), "variant": variant,
               "seed": info.get("seed", None), "source": s["source"].iloc[0],
               "round": int(s["round"].max()), "n": int(len(s))}
        for key, c in correlations(s, control).items():
            row.update({f"r_{key}": c.r, f"pval_{key}": c.pvalue, f"ci_low_{key}": c.ci_low,
                        f"ci_high_{key}": c.ci_high, f"n_{key}": c.n})
        rows.append(row)
    if not rows:
        out = pd.DataFrame(columns=["run_id", "dataset", "variant", "seed", "source", "round", "n"])
    else:
        out = pd.DataFrame(rows).sort_values(["dataset", "variant", "seed"], na_position="last").reset_index(drop=True)
    out.attrs["control"] = control
    return out


# ----------------------------------------------------------------------------- matched budget

def matched_budget(per_run_df: pd.DataFrame, a: str = HASFL, b: str = RANDOM_BUDGET) -> pd.DataFrame:
    """Section 4.4 matched-budget control: per (dataset, seed) the final accuracy of ``a``
    and ``b``, the paired difference a - b and each one's average width p; then one summary
    row per dataset (seed ``"mean"``) with the mean difference, its std, the number of pairs
    and the paired t-test p-value (scipy.stats.ttest_rel; NaN with fewer than two seeds).
    Duplicate runs of one (dataset, variant, seed) are averaged; runs whose protocols (the resolved
    config without the algorithm section, :func:`analysis.sweep.protocol`) differ beyond the seed
    are paired and summarised separately, with a ``config`` column and a warning."""
    keys = ["dataset", "seed"] if "dataset" in per_run_df.columns else ["seed"]
    pr = per_run_df[per_run_df["variant"].isin([a, b])]
    labels, mixed = sweep.split_configs(pr.assign(_all=0), keys[:-1] or ["_all"], algorithm=False)
    if mixed:
        warnings.warn(sweep.mixed_warning(mixed, "matched-budget runs"), UserWarning, stacklevel=2)
        pr = pr.assign(config=labels)
        keys = [*keys[:-1], "config", "seed"]
    cols = [*keys, "final_a", "final_b", "diff", "avg_p_a", "avg_p_b", "diff_std", "n_pairs", "p_value"]
    if pr.empty:
        out = pd.DataFrame(columns=cols)
        out.attrs.update(a=a, b=b)
        return out
    m = pr.groupby([*keys, "variant"], dropna=False)[["final_accuracy", "avg_p"]].mean().unstack("variant")
    if (("final_accuracy", a) not in m.columns) or (("final_accuracy", b) not in m.columns):
        out = pd.DataFrame(columns=cols)
        out.attrs.update(a=a, b=b)
        return out
    paired = pd.DataFrame({"final_a": m[("final_accuracy", a)], "final_b": m[("final_accuracy", b)],
                           "avg_p_a": m[("avg_p", a)], "avg_p_b": m[("avg_p", b)]}).dropna(subset=["final_a", "final_b"])
    paired["diff"] = paired["final_a"] - paired["final_b"]
    paired = paired.reset_index()
    rows = []
    outer = [k for k in keys if k != "seed"]
    groups = paired.groupby(outer, sort=True, dropna=False) if outer else [((), paired)]
    for ds, part in groups:
        ds = ds if isinstance(ds, tuple) else (ds,)
        part = part.sort_values("seed")
        for _, r in part.iterrows():
            rows.append({**{k: r[k] for k in keys}, "final_a": r["final_a"], "final_b": r["final_b"],
                         "diff": r["diff"], "avg_p_a": r["avg_p_a"], "avg_p_b": r["avg_p_b"],
                         "diff_std": math.nan, "n_pairs": 1, "p_value": math.nan})
        d = part["diff"].to_numpy(float)
        p = math.nan
        if len(d) >= 2 and np.std(d) > 0:
            p = float(stats.ttest_rel(part["final_a"].to_numpy(float), part["final_b"].to_numpy(float)).pvalue)
        summary = {"seed": "mean", "final_a": part["final_a"].mean(), "final_b": part["final_b"].mean(),
                   "diff": float(d.mean()), "avg_p_a": part["avg_p_a"].mean(), "avg_p_b": part["avg_p_b"].mean(),
                   "diff_std": float(np.std(d, ddof=1)) if len(d) >= 2 else math.nan,
                   "n_pairs": len(d), "p_value": p}
        summary.update(dict(zip(outer, ds)))
        rows.append(summary)
    out = pd.DataFrame(rows, columns=cols)
    if mixed:
        out.attrs["mixed"] = mixed
    out["seed"] = out["seed"].astype(object)
    out.attrs.update(a=a, b=b)
    return out


# ----------------------------------------------------------------------------- costs

def cost_table(model_name: str, input_shape: tuple[int, ...], num_classes: int,
               widths: Sequence[float] = (0.25, 0.5, 0.75, 1.0), vocab_size: int | None = None,
               width_mult: float = 1.0) -> pd.DataFrame:
    """papers/003 Table 1 from the model itself: per width p (nested channel masks) the
    trainable parameters, MACs per sample (models.model_macs) and upload size
    (4 bytes x params). Columns p, params, macs, params_M, macs_M, upload_MB."""
    from fedsap_ray.masks import ParamLayout, nested_channel_masks, param_mask, params_in_mask
    from fedsap_ray.models import build_model, model_macs

    m = build_model(model_name, num_classes=num_classes, input_shape=tuple(input_shape), vocab_size=vocab_size,
                    width_mult=width_mult)
    space, layout = m.channel_space(), ParamLayout.from_model(m)
    rows = []
    for p in widths:
        cm = nested_channel_masks(space, p)
        n = int(params_in_mask(layout, param_mask(space, layout, cm)))
        macs = int(model_macs(m, tuple(input_shape), cm))
        rows.append({"p": float(p), "params": n, "macs": macs, "params_M": n / 1e6, "macs_M": macs / 1e6,
                     "upload_MB": 4 * n / 1e6})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- markdown

HEADERS = {
    "dataset": "dataset", "variant": "variant", "type": "type", "seeds": "seeds", "seed": "seed",
    "best": "Best acc. (%)", "final": "Final acc. (%)", "drop": "Peak→final Δ (pp)", "avg_p": "Avg. p",
    "frozen": "Frozen params (final)", "widest": "Widest p (last 10 rounds)", "n": "clients", "source": "source", "round": "round",
    "H_TV": "r(H̃, TV)", "H_pmax": "r(H̃, p_max)", "H_TV|pmax": "r(H̃, TV | p_max)", "p_TV|pmax": "r(p, TV | p_max)",
    "final_a": "final a (%)", "final_b": "final b (%)", "diff": "a − b (pp)", "diff_std": "std (pp)",
    "avg_p_a": "avg. p a", "avg_p_b": "avg. p b", "n_pairs": "pairs", "p_value": "paired t p-value",
    "p": "p", "params_M": "Params (M)", "macs_M": "MACs/sample (M)", "upload_MB": "Upload (MB)",
    "params": "params", "macs": "MACs/sample",
}
_PERCENT = {"best", "final", "drop", "peak_to_final", "final_a", "final_b", "diff", "diff_std", "best_accuracy", "final_accuracy"}
_COUNT = {"seeds", "seed", "n", "n_pairs", "round", "rounds", "frozen", "final_frozen_params", "params", "macs"}
_DIGITS = {"params_M": 2, "macs_M": 1, "upload_MB": 2, "p": 2}


def _fmt(col: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or (not isinstance(v, str) and pd.isna(v)):
        return "–"
    if isinstance(v, str):
        return v
    if col in _PERCENT:  # rounded to 1e-6 first: the same mean reached by two summation orders prints alike
        return f"{round(100 * float(v), 6):.1f}"
    if col in _COUNT:
        return f"{int(round(float(v))):,}" if col in ("frozen", "final_frozen_params", "params", "macs") else f"{int(round(float(v)))}"
    if col.startswith("avg_p") or col == "widest":
        return f"{float(v):.2f}"
    if col in _DIGITS:
        return f"{float(v):.{_DIGITS[col]}f}"
    if col.startswith("pval") or col == "p_value":
        return f"{float(v):.2g}"
    if col.startswith("r_") or col.startswith("ci_"):
        return f"{float(v):.2f}"
    return f"{float(v):.3g}" if isinstance(v, (float, np.floating)) else str(v)


def to_markdown(table: pd.DataFrame, headers: Mapping[str, str] | None = None) -> str:
    """A README-ready markdown table of any frame built here.

    ``<m>_mean`` / ``<m>_std`` pairs become one "mean ± std" column; ``r_<k>`` with its
    ``ci_low_``/``ci_high_``/``pval_``/``n_`` columns becomes "r [low, high] (p=…)";
    accuracies and differences are shown in percent. ``headers`` overrides column titles.
    """
    heads = {**HEADERS, **(headers or {})}
    cols = list(table.columns)
    shown: list[tuple[str, Any]] = []  # (title key, formatter of a row)
    skip: set[str] = set()
    for c in cols:
        if c in skip:
            continue
        if c.endswith("_mean") and c[:-5] + "_std" in cols:
            m = c[:-5]
            skip.add(m + "_std")

            def cell(r, m=m):
                mean, std = _fmt(m, r[m + "_mean"]), r[m + "_std"]
                return mean if mean == "–" or pd.isna(std) else f"{mean} ± {_fmt(m, std)}"
            shown.append((m, cell))
        elif c.startswith("r_") and f"pval_{c[2:]}" in cols:
            k = c[2:]
            skip.update({f"pval_{k}", f"ci_low_{k}", f"ci_high_{k}", f"n_{k}"})

            def cell(r, k=k):
                s = _fmt(f"r_{k}", r[f"r_{k}"])
                if s == "–":
                    return s
                if f"ci_low_{k}" in r and not pd.isna(r[f"ci_low_{k}"]):
                    s += f" [{_fmt('ci_', r[f'ci_low_{k}'])}, {_fmt('ci_', r[f'ci_high_{k}'])}]"
                return s + f" (p={_fmt('pval', r[f'pval_{k}'])})"
            shown.append((k, cell))
        elif c in ("run_id", "algorithm", "study", "status", "config_json") or c.startswith(("pval_", "ci_low_", "ci_high_")):
            continue
        else:
            shown.append((c, lambda r, c=c: _fmt(c, r[c])))
    lines = ["| " + " | ".join(heads.get(k, k) for k, _ in shown) + " |",
             "| " + " | ".join("---" for _ in shown) + " |"]
    for _, r in table.iterrows():
        lines.append("| " + " | ".join(f(r) for _, f in shown) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- report

def _present(pr: pd.DataFrame, variants: Sequence[str]) -> list[str]:
    have = set(pr["variant"])
    return [v for v in variants if v in have]


def _mixed_note(table: pd.DataFrame) -> str:
    """A warning line when a grouping table split runs whose configurations differ beyond the seed."""
    mixed = table.attrs.get("mixed") or {}
    return f"**Warning:** {sweep.mixed_warning(mixed)}." if mixed else ""


def _first_adaptation(pr: pd.DataFrame) -> dict[str, tuple[int, int, int]]:
    """Per HAS-FL / Random-budget run: (warm-up R, T_adapt, first adaptation round) from its resolved options
    (Algorithm 1: adaptation after rounds t >= R with t mod T_adapt = 0)."""
    out = {}
    for _, r in pr.iterrows():
        cfg = json.loads(r["config_json"]) if isinstance(r.get("config_json"), str) else {}
        algo = cfg.get("algorithm") or {}
        if algo.get("name") not in ("hasfl", "random_budget"):
            continue
        o = sweep.resolved_options(algo["name"], algo.get("options"))
        first = max(int(o["warmup"]), 1)
        first += (-first) % int(o["t_adapt"])
        out[r["run_id"]] = (int(o["warmup"]), int(o["t_adapt"]), first)
    return out


def _pre_adaptation_reason(pr: pd.DataFrame, what: str) -> str | None:
    """Why ``what`` is empty when every HAS-FL / Random-budget run stopped before its first adaptation step."""
    steps = _first_adaptation(pr)
    if not steps:
        return None
    last = pr.set_index("run_id")["rounds"]
    early = {rid: v for rid, v in steps.items() if pd.isna(last.get(rid)) or int(last.get(rid)) < v[2]}
    if len(early) < len(steps):
        return None
    ws = sorted({f"warm-up R={w}, T_adapt={a}: first step after round {f}" for w, a, f in steps.values()})
    done = sorted({int(last[r]) for r in early if not pd.isna(last.get(r))})
    return (f"{what}: no run reached the adaptation phase ({'; '.join(ws)}; the runs stopped at round "
            f"{', '.join(map(str, done)) or '0'}), so every H̃ is still its initial 1 and every width its p_max.")


def report(path_or_res: Any, *, finished_only: bool = True, frontier_png: str | Path | None = None,
           cost_models: Mapping[str, Mapping[str, Any]] | None = None, control: str = "tiers") -> str:
    """All the papers/003 tables of a results folder (or Results-like object) as markdown.

    Comparison sections (Tables 3, 4, 6) appear when at least two of their variants have
    runs, the matched-budget section when both HAS-FL and Random-budget do, Table 5 for
    runs that logged H~ estimates. ``frontier_png`` also writes Figure 6 there;
    ``cost_models`` maps a title to :func:`cost_table` keyword arguments (Table 1); ``control`` is
    how Table 5's partial correlations control for p_max (:func:`partial_corr`). A section that
    cannot be built says why instead of disappearing (e.g. runs stopped before HAS-FL's first
    adaptation step), and a table that had to split runs with different configurations says so.
    """
    res = _load(path_or_res)
    pr = per_run(res)
    if finished_only:
        pr = _finished(pr)
    out = ["# Capacity-confound analysis (papers/003)", ""]
    if pr.empty:
        return "\n".join([*out, "No runs.", ""])

    def section(title: str, body: str, note: str = "") -> None:
        out.extend([f"## {title}", ""] + ([note, ""] if note else []) + [body, ""])

    def summary(variants: Sequence[str], metrics: Sequence[str]) -> pd.DataFrame:
        with warnings.catch_warnings():  # the report prints the warning as a line of its own
            warnings.simplefilter("ignore", UserWarning)
            return summary_table(pr, variants, metrics=metrics)

    def join(*notes: str) -> str:
        return "\n\n".join(n for n in notes if n)

    v3 = _present(pr, TABLE3_VARIANTS)
    if len(v3) >= 2:
        t3 = summary(v3, ("best", "final", "avg_p"))
        section("Sub-model allocation strategies (Table 3)", to_markdown(t3),
                join("Mean ± std over seeds; accuracies are the global test accuracy (%).", _mixed_note(t3)))
    v4 = _present(pr, TABLE4_VARIANTS)
    if len(v4) >= 2:
        t4 = summary(v4, ("best", "final", "drop", "avg_p", "frozen", "widest"))
        section("Coverage-guarantee ablation (Table 4)", to_markdown(t4), join(
            "Peak→final Δ = final − best accuracy; frozen params = coordinates no client has covered since "
            "initialisation, at the end of training; widest p = the widest width any sampled client trained, "
            f"mean over the last {LATE_ROUNDS} rounds (below 1: the outer slices went untrained late in the run).",
            _mixed_note(t4)))
    state_runs = set(pr["run_id"])
    t5 = "Do the estimates measure data heterogeneity? (Table 5)"
    ct = correlation_table(res, control=control)
    estimated = not ct.empty
    if not ct.empty:
        ct = ct[ct["run_id"].isin(state_runs)]
        if "n_H_TV" in ct.columns:
            ct = ct[ct["r_H_TV"].notna() | ct["r_H_pmax"].notna() | ct["r_H_TV|pmax"].notna()]
    how = ("as tier categories (one dummy per tier but the first; df = n − 2 − (tiers − 1))" if control == "tiers"
           else "as a straight line in p_max (df = n − 3)")
    if not ct.empty:
        section(t5, to_markdown(ct),
                "Final smoothed estimates H̃ and widths p of all clients vs. ground-truth label TV distance and "
                f"capacity p_max; r [95% CI] (p-value); partial correlations control for p_max {how}. For HAS-FL, "
                "p is the allocation Eq. 6 gives the final H̃ (the same round as H̃, not the width trained in the "
                "last round, which came from the estimates one adaptation step earlier).")
    elif estimated or _first_adaptation(pr):
        why = _pre_adaptation_reason(pr, "Table 5") or (
            "Table 5: no run's final state has H̃ estimates that vary across clients (every correlation is "
            "undefined), e.g. runs without HAS-FL estimates.")
        section(t5, "_(empty)_", why)
    variants = set(pr["variant"])
    if HASFL in variants or RANDOM_BUDGET in variants:
        mb_title = "Matched-budget control (section 4.4)"
        missing = [v for v in (HASFL, RANDOM_BUDGET) if v not in variants]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            mb = matched_budget(pr, HASFL, RANDOM_BUDGET) if not missing else pd.DataFrame()
        if missing:
            section(mb_title, "_(empty)_", f"matched-budget control: no finished {' or '.join(missing)} runs in "
                    "the folder (the control pairs HAS-FL and Random-budget runs of the same seed).")
        elif mb.empty:
            section(mb_title, "_(empty)_", "matched-budget control: no seed has both a HAS-FL and a Random-budget "
                    "run with an evaluated final accuracy.")
        else:
            pre = _pre_adaptation_reason(pr, "matched-budget control")
            section(mb_title, to_markdown(mb, headers={
                "final_a": f"{HASFL} final (%)", "final_b": f"{RANDOM_BUDGET} final (%)",
                "diff": f"{HASFL} − {RANDOM_BUDGET} (pp)", "avg_p_a": f"{HASFL} avg. p",
                "avg_p_b": f"{RANDOM_BUDGET} avg. p"}), join(
                    "Paired by seed; the 'mean' rows give the paired t-test.",
                    f"**Note:** {pre} The two strategies have allocated identically so far." if pre else "",
                    f"**Warning:** {sweep.mixed_warning(mb.attrs['mixed'], 'matched-budget runs')}."
                    if mb.attrs.get("mixed") else ""))
    v6 = _present(pr, TABLE6_VARIANTS)
    if len(v6) >= 2:
        t6 = summary(v6, ("best", "final", "avg_p"))
        t6.insert(t6.columns.get_loc("variant") + 1, "type", t6["variant"].map(VARIANT_TYPE))
        section("Comparison with full-model methods (Table 6)", to_markdown(t6), _mixed_note(t6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fr = frontier(pr)
    if not fr.empty:
        body = to_markdown(fr)
        if frontier_png is not None:
            png = plot_frontier(fr, frontier_png)
            body += f"\n\n![Accuracy-capacity frontier]({png})"
        section("Accuracy-capacity frontier (Figure 6)", body, _mixed_note(fr))
    for title, kw in (cost_models or {}).items():
        section(f"Per-client cost: {title} (Table 1)", to_markdown(cost_table(**kw)[["p", "params_M", "macs_M", "upload_MB"]]))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m analysis.confound OUT [--png FIGURE.png]``: print :func:`report` of a results folder."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("results", type=Path, help="results folder (runs/, rounds/, clients/, allocations/)")
    ap.add_argument("--png", type=Path, default=None, help="also write the Figure 6 frontier here")
    ap.add_argument("--all", action="store_true", help="include runs that did not finish")
    ap.add_argument("--control", choices=CONTROLS, default="tiers",
                    help="how Table 5's partial correlations control for p_max: tier dummies (default) or linear")
    args = ap.parse_args(argv)
    folder = str(args.results)
    if "://" not in folder and not args.results.is_dir():
        print(f"analysis.confound: results={folder!r}: no such folder (give the --out folder of "
              "sweeps/capacity_confound.py or of fedsap-ray run)", file=sys.stderr)
        raise SystemExit(2)
    print(report(args.results, finished_only=not args.all, frontier_png=args.png, control=args.control))


if __name__ == "__main__":
    main()
