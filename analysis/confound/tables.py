"""papers/003's accuracy tables (3, 4, 6), Figure 6's data and Table 1 (cost per width).

Rows are named by :data:`ROWS`, the paper's names for :func:`analysis.labels.label`'s run labels;
per-run figures come from :func:`analysis.runs.per_run`. Accuracies are fractions; the peak-to-final
drop is ``final - best`` (a negative number, as in Table 4).
"""
from __future__ import annotations

import warnings
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import pandas as pd

from analysis import labels, runs

# The paper's row name of each run label (:func:`analysis.labels.label`); a label not listed keeps its own text.
ROWS = {
    "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "heterofl": "HeteroFL",
    "fjord": "FjORD", "uniform": "Uniform", "hasfl": "HAS-FL", "random_budget": "Random-budget", "fedrolex": "FedRolex",
    "hasfl (coverage=False)": "HAS-FL (no coverage)", "random_budget (coverage=False)": "Random-budget (no coverage)",
    "fedavg (width=capacity)": "FedAvg (capacity width)", "fedprox (width=capacity)": "FedProx (capacity width)",
}
HASFL, HASFL_NO_COVERAGE, RANDOM_BUDGET = "HAS-FL", "HAS-FL (no coverage)", "Random-budget"
# Paper Table 6 "Type" column.
VARIANT_TYPE = {
    "FedAvg": "Full-model", "SCAFFOLD": "Full-model + CV", "FedProx": "Full-model + prox",
    HASFL: "Sub-model (adaptive)", HASFL_NO_COVERAGE: "Sub-model (adaptive, no coverage)",
    RANDOM_BUDGET: "Sub-model (random)", "HeteroFL": "Sub-model (static)", "FjORD": "Sub-model (random tiers)",
    "Uniform": "Sub-model (fixed)", "FedRolex": "Sub-model (rolling)",
}
TABLE3_VARIANTS = (HASFL, "FjORD", "Uniform")                      # section 4.2
TABLE4_VARIANTS = (HASFL, HASFL_NO_COVERAGE, "HeteroFL", "Uniform")  # section 4.3 (+ Uniform: Prop. 3's case)
TABLE6_VARIANTS = ("FedAvg", "SCAFFOLD", "FedProx", HASFL, RANDOM_BUDGET)  # section 4.5
VARIANT_ORDER = ("FedAvg", "SCAFFOLD", "FedProx", HASFL, HASFL_NO_COVERAGE, RANDOM_BUDGET,
                 "HeteroFL", "FjORD", "Uniform", "FedRolex")

# summary name -> per_run column
METRICS = {"best": "best_accuracy", "final": "final_accuracy", "drop": "peak_to_final", "avg_p": "avg_p",
           "frozen": "final_frozen_params", "widest": "widest_p_late"}


def variant_of(run: Mapping[str, Any]) -> str:
    """Display label of a run (papers/003 Tables 3, 4, 6 row names): the paper's name (:data:`ROWS`) of its
    :func:`analysis.labels.label`; ``run`` is a row of an annotated runs table (``config.*`` columns)."""
    name = labels.label(run)
    return ROWS.get(name, name)


def _order(variants: Iterable[str]) -> list[str]:
    vs = list(dict.fromkeys(variants))
    rank = {v: i for i, v in enumerate(VARIANT_ORDER)}
    return sorted(vs, key=lambda v: (rank.get(v, len(rank)), v))



def per_run(res: Any) -> pd.DataFrame:
    """:func:`analysis.runs.per_run` with papers/003's names: ``variant`` is :func:`variant_of` (the row
    name), ``best_accuracy`` / ``final_accuracy`` the best / final global accuracy of the run's primary
    eval mode, ``peak_to_final`` = final - best (Table 4 "Peak→final Δ"); ``avg_p``,
    ``final_frozen_params`` and ``widest_p_late`` as :func:`analysis.metrics.width_stats` defines them."""
    pr = runs.per_run(res)
    pr = pr.rename(columns={"best_global_accuracy": "best_accuracy", "final_global_accuracy": "final_accuracy"})
    pr["variant"] = [ROWS.get(x, x) for x in pr["label"]]
    pr["peak_to_final"] = pr["final_accuracy"] - pr["best_accuracy"]
    return pr


def finished_runs(pr: pd.DataFrame) -> pd.DataFrame:
    """The finished rows of a per-run table (a run without a status counts as finished)."""
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
    (:func:`analysis.labels.split_configs`, e.g. 2 rounds at full width and 30 at half width) are
    never pooled: the table gains a ``config`` column with the differing keys' values, one row per
    configuration, a :class:`UserWarning` names the keys, and ``attrs["mixed"]`` holds them.
    """
    pr = per_run_df
    if variants is not None:
        pr = pr[pr["variant"].isin(list(variants))]
    keys = _groups(pr)
    configs, mixed = labels.split_configs(pr, keys)
    if mixed:
        warnings.warn(labels.mixed_warning(mixed), UserWarning, stacklevel=2)
        pr = pr.assign(config=configs)
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



# ----------------------------------------------------------------------------- costs

def cost_table(model_name: str, input_shape: tuple[int, ...], num_classes: int,
               widths: Sequence[float] = (0.25, 0.5, 0.75, 1.0), vocab_size: int | None = None,
               width_mult: float = 1.0) -> pd.DataFrame:
    """papers/003 Table 1 from the model itself: per width p (nested channel masks) the
    trainable parameters, MACs per sample (models.model_macs) and upload size
    (4 bytes x params). Columns p, params, macs, params_M, macs_M, upload_MB."""
    from fedsap_ray.models.masks import ParamLayout, nested_channel_masks, param_mask, params_in_mask
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


