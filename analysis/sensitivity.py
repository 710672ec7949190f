"""FedSAP's one-factor hyperparameter sensitivity (papers/000 Table 7 and Figure 5).

The diagnostic runs ``fedsap_fixed`` (fixed masks, uniform layer budget) and changes one of
g_target, tau_var, beta_ema at a time around the reference point, which is the strategy's own
default (0.9, 0.1, 0.3 as in the paper's Appendix D; read from the registry, not repeated here).
Rows are picked from the runs' resolved options (:func:`analysis.sweep.select_runs`): a run at the
reference point belongs to all three factor curves, a run that changes two factors to none.
Accuracies are our runs' best-so-far / final global accuracy, mean ± std over seeds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Sequence

import pandas as pd

from analysis import sweep
from analysis.plots import finish, new_figure

ALGORITHM = "fedsap_fixed"
FACTORS = ("g_target", "tau_var", "beta_ema")  # papers/000 Table 7 row order
SYMBOLS = {"g_target": r"$g_{\mathrm{target}}$", "tau_var": r"$\tau_{\mathrm{var}}$",
           "beta_ema": r"$\beta_{\mathrm{EMA}}$"}
COLUMNS = ["factor", "value", "reference", "variants", "seeds", "best_mean", "best_std", "final_mean", "final_std"]


def reference_point(algorithm: str = ALGORITHM, factors: Sequence[str] = FACTORS) -> dict[str, float]:
    """The factors' values at the reference configuration: the strategy's defaults."""
    defaults = sweep.resolved_options(algorithm)
    return {f: defaults[f] for f in factors}


def sensitivity_table(res: Any, algorithm: str = ALGORITHM, factors: Sequence[str] = FACTORS) -> pd.DataFrame:
    """papers/000 Table 7: one row per (factor, value) with runs, ordered by factor (the paper's
    order) then value; the reference runs appear once per factor with ``reference`` True.

    Columns: factor, value, reference, variants (run-id labels), seeds, best_mean/std, final_mean/std.
    """
    res = sweep.load_sweep(res)
    ref = reference_point(algorithm, factors)
    runs = sweep.select_runs(res.runs, algorithm, factors)
    rows: list[tuple[str, dict[str, Any]]] = []
    where: dict[str, tuple[str, float, bool]] = {}
    for f in factors:
        others = [g for g in factors if g != f]
        values = {float(ref[f])}
        if not runs.empty:
            at_ref = pd.Series([all(sweep.same_value(r[sweep.OPT + g], ref[g]) for g in others)
                                for _, r in runs.iterrows()], index=runs.index, dtype=bool)
            values |= {float(v) for v in runs.loc[at_ref, sweep.OPT + f]}
        for v in sorted(values):
            label = f"{f}={v:g}"
            rows.append((label, {**ref, f: v}))
            where[label] = (f, v, sweep.same_value(v, ref[f]))
    table = sweep.option_table(res, algorithm, rows)
    if table.empty:
        return pd.DataFrame(columns=COLUMNS)
    info = pd.DataFrame([where[label] for label in table["row"]], columns=["factor", "value", "reference"])
    return pd.concat([info, table.drop(columns="row")], axis=1)[COLUMNS]


def plot_sensitivity(table: pd.DataFrame, path: str | Path | None = None, metric: str = "best") -> Any:
    """papers/000 Figure 5: one panel per factor, accuracy (``metric`` best or final, %) against the
    value with ± std error bars; the reference value is marked (star and dashed line)."""
    if metric not in ("best", "final"):
        raise ValueError(f"metric={metric!r}: allowed values are best, final")
    if table.empty:
        raise sweep.MissingData("no sensitivity runs")
    factors = list(dict.fromkeys(table["factor"]))
    fig, axes = new_figure(len(factors))
    for ax, f in zip(axes, factors):
        part = table[table["factor"] == f].sort_values("value")
        y, err = 100 * part[f"{metric}_mean"], 100 * part[f"{metric}_std"].fillna(0.0)
        ax.errorbar(part["value"], y, yerr=err, fmt="o-", capsize=3, label="mean ± std over seeds")
        ref = part[part["reference"].astype(bool)]
        if len(ref):
            ax.plot(ref["value"], 100 * ref[f"{metric}_mean"], "*", ms=14, color="tab:red", label="reference")
            ax.axvline(float(ref["value"].iloc[0]), ls="--", color="tab:red", lw=1, alpha=0.6)
        ax.set(xlabel=SYMBOLS.get(f, f), ylabel=f"{metric} global accuracy (%)", title=f"one-factor: {f}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    return finish(fig, path)


def display(table: pd.DataFrame) -> pd.DataFrame:
    """Table 7 for reading (text cells): hyperparameter, value (the reference marked "(ref.)"), seeds and
    best / final global accuracy (%, mean ± std over seeds), and the runs' variant names."""
    shown = sweep.pm_table(table)
    shown["value"] = [f"{v:g}" + (" (ref.)" if r else "") for v, r in zip(table["value"], table["reference"])]
    shown = shown.rename(columns={"factor": "hyperparameter", "best": "best global acc. (%)",
                                  "final": "final global acc. (%)", "variants": "runs"})
    return shown[["hyperparameter", "value", "seeds", "best global acc. (%)", "final global acc. (%)", "runs"]]


def to_markdown(table: pd.DataFrame) -> str:
    """:func:`display` through the one renderer (:func:`analysis.display.markdown`), or why there is no table."""
    if table.empty:
        return "No one-factor sensitivity runs (algorithm fedsap_fixed) in this folder."
    return sweep.markdown(display(table))
