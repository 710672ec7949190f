"""All papers/003 tables of a results folder as markdown (:func:`report`), through the one renderer
:func:`analysis.display.markdown`: :func:`display` formats a table built here (accuracies in percent,
"mean ± std", correlations as "r [low, high] (p=…)") and :func:`to_markdown` prints it."""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from analysis import labels, runs
from analysis.display import markdown
from analysis.metrics import LATE_ROUNDS
from analysis.confound.figures import plot_frontier
from analysis.confound.stats import CONTROLS, correlation_table, matched_budget
from analysis.confound.tables import (HASFL, RANDOM_BUDGET, TABLE3_VARIANTS, TABLE4_VARIANTS,
                                      TABLE6_VARIANTS, VARIANT_TYPE, cost_table, finished_runs, frontier, per_run,
                                      summary_table)

__all__ = ["CONTROLS", "report", "to_markdown"]


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


def display(table: pd.DataFrame, headers: Mapping[str, str] | None = None) -> pd.DataFrame:
    """A display copy (text cells, titled columns) of any frame built here.

    ``<m>_mean`` / ``<m>_std`` pairs become one "mean ± std" column; ``r_<k>`` with its
    ``ci_low_``/``ci_high_``/``pval_``/``n_`` columns becomes "r [low, high] (p=…)";
    accuracies and differences are shown in percent; identity and config columns are left out.
    ``headers`` overrides column titles.
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
        elif c in ("run_id", "algorithm", "study", "status", "label", "config_json") or \
                str(c).startswith(("pval_", "ci_low_", "ci_high_", "config.", labels.OPT)):
            continue
        else:
            shown.append((c, lambda r, c=c: _fmt(c, r[c])))
    rows = [[f(r) for _, f in shown] for _, r in table.iterrows()]
    return pd.DataFrame(rows, columns=[heads.get(k, k) for k, _ in shown], dtype=object)


def to_markdown(table: pd.DataFrame, headers: Mapping[str, str] | None = None) -> str:
    """A README-ready markdown table of any frame built here (:func:`display` through
    :func:`analysis.display.markdown`)."""
    return markdown(display(table, headers))


# ----------------------------------------------------------------------------- report

def _present(pr: pd.DataFrame, variants: Sequence[str]) -> list[str]:
    have = set(pr["variant"])
    return [v for v in variants if v in have]


def _mixed_note(table: pd.DataFrame) -> str:
    """A warning line when a grouping table split runs whose configurations differ beyond the seed."""
    mixed = table.attrs.get("mixed") or {}
    return f"**Warning:** {labels.mixed_warning(mixed)}." if mixed else ""


def _first_adaptation(pr: pd.DataFrame) -> dict[str, tuple[int, int, int]]:
    """Per HAS-FL / Random-budget run: (warm-up R, T_adapt, first adaptation round) from its resolved options
    (Algorithm 1: adaptation after rounds t >= R with t mod T_adapt = 0)."""
    out = {}
    for _, r in pr.iterrows():
        if labels.algorithm_of(r) not in ("hasfl", "random_budget"):
            continue
        o = labels.options_of(r)
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
    res = runs.load_sweep(path_or_res)
    pr = per_run(res)
    if finished_only:
        pr = finished_runs(pr)
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
                    f"**Warning:** {labels.mixed_warning(mb.attrs['mixed'], 'matched-budget runs')}."
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


