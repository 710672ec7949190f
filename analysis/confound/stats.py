"""papers/003 Table 5 and the matched-budget control: (partial) correlations of the final client
state and the paired test of HAS-FL against Random-budget (section 4.4)."""
from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pandas as pd
from scipy import stats

from analysis import labels, runs
from analysis.confound.tables import HASFL, RANDOM_BUDGET, per_run

# Table 5 columns: key -> (x, y, control or None)
CORRELATIONS = {
    "H_TV": ("h_tilde", "tv_distance", None),
    "H_pmax": ("h_tilde", "capacity_max", None),
    "H_TV|pmax": ("h_tilde", "tv_distance", "capacity_max"),
    "p_TV|pmax": ("p", "tv_distance", "capacity_max"),
}



def _col(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name] if name in df.columns else pd.Series(np.nan, index=df.index)


class Corr(NamedTuple):
    """A (partial) correlation with its two-sided p-value, 95% CI and sample size."""
    r: float
    pvalue: float
    ci_low: float
    ci_high: float
    n: int


def _nan_corr(n: int) -> Corr:
    return Corr(math.nan, math.nan, math.nan, math.nan, int(n))


def _complete(*cols: npt.ArrayLike) -> list[np.ndarray]:
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


def pearson(x: npt.ArrayLike, y: npt.ArrayLike) -> Corr:
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


def partial_corr(x: npt.ArrayLike, y: npt.ArrayLike, z: npt.ArrayLike,
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
    res = runs.load_sweep(res)
    cols = ["run_id", "round", "client_id", "h_tilde", "p", "capacity_max", "tv_distance"]
    parts = []
    al = runs.table(res, "allocations")
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
    cl = runs.table(res, "clients")
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


def _aligned_p(last: pd.DataFrame, run_table: pd.DataFrame) -> pd.Series:
    """Per final-round allocation row: Eq. 6 (+ coverage) of the run's final H~ for HAS-FL runs, else p."""
    from fedsap_ray.algorithms.hasfl import allocation_rule

    out = pd.to_numeric(last["p"], errors="coerce").astype(float).copy()
    rows = {r["run_id"]: r for _, r in run_table.drop_duplicates("run_id").iterrows()}
    for run_id, part in last.groupby("run_id", sort=False):
        run = rows.get(run_id, {})
        h = pd.to_numeric(part["h_tilde"], errors="coerce").to_numpy(float)
        pmax = pd.to_numeric(part["capacity_max"], errors="coerce").to_numpy(float)
        if labels.algorithm_of(run) != "hasfl" or not (np.isfinite(h).all() and np.isfinite(pmax).all()):
            continue
        o = labels.options_of(run)
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
    res = runs.load_sweep(res)
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
    config without the algorithm section, :func:`analysis.labels.protocol`) differ beyond the seed
    are paired and summarised separately, with a ``config`` column and a warning."""
    keys = ["dataset", "seed"] if "dataset" in per_run_df.columns else ["seed"]
    pr = per_run_df[per_run_df["variant"].isin([a, b])]
    configs, mixed = labels.split_configs(pr.assign(_all=0), keys[:-1] or ["_all"], algorithm=False)
    if mixed:
        warnings.warn(labels.mixed_warning(mixed, "matched-budget runs"), UserWarning, stacklevel=2)
        pr = pr.assign(config=configs)
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


