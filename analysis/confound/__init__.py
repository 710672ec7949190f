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

One module per responsibility: :mod:`.tables` (row names, per-run table, Tables 1/3/4/6, Figure 6
data), :mod:`.stats` (Table 5's correlations, the matched-budget test), :mod:`.figures`,
:mod:`.report` (markdown) and :mod:`.cli` (``python -m analysis.confound OUT``). Accuracies are
fractions in the DataFrames and percent in the markdown; the peak-to-final drop is ``final - best``
(a negative number, as in Table 4).
"""
from analysis.confound.cli import main
from analysis.confound.figures import frontier_figure, plot_frontier
from analysis.confound.report import display, report, to_markdown
from analysis.confound.stats import (CONTROLS, CORRELATIONS, Corr, correlation_table, correlations, final_state,
                                     matched_budget, partial_corr, pearson, tier_dummies)
from analysis.confound.tables import (HASFL, HASFL_NO_COVERAGE, METRICS, RANDOM_BUDGET, ROWS, TABLE3_VARIANTS,
                                      TABLE4_VARIANTS, TABLE6_VARIANTS, VARIANT_ORDER, VARIANT_TYPE, cost_table,
                                      coverage_table, frontier, per_run, summary_table, variant_of)
from analysis.metrics import LATE_ROUNDS
from fedsap_ray import results

__all__ = ["CONTROLS", "CORRELATIONS", "Corr", "HASFL", "HASFL_NO_COVERAGE", "LATE_ROUNDS", "METRICS", "RANDOM_BUDGET",
           "ROWS", "TABLE3_VARIANTS", "TABLE4_VARIANTS", "TABLE6_VARIANTS", "VARIANT_ORDER", "VARIANT_TYPE",
           "correlation_table", "correlations", "cost_table", "coverage_table", "display", "final_state", "frontier",
           "frontier_figure", "main", "matched_budget", "partial_corr", "pearson", "per_run", "plot_frontier",
           "report", "results", "summary_table", "tier_dummies", "to_markdown", "variant_of"]
