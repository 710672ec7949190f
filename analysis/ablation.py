"""FedSAP's ablation tables from a results folder (papers/000 Figure 4, Tables 2 and 5, and the DGA
grouping controls).

Each table is a list of (label, options) rows matched against the runs' resolved options
(:func:`analysis.sweep.option_table`): a row's runs are those of its algorithm that set exactly
those options and leave every other one at its default (or at the study's shared protocol), so
rows never depend on run ids. Accuracies are our runs' best-so-far / final global accuracy (and
best-so-far per domain for Figure 4), mean ± std over seeds.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import stability, sweep
from analysis.plots import color, finish, new_figure

# papers/000 Figure 4: FedSAP (selected adaptive configuration) without DGA, SGP or both.
FIGURE4 = [("FedSAP", {"dga": "gradient", "sgp": True}), ("w/o DGA", {"dga": "none", "sgp": True}),
           ("w/o SGP", {"dga": "gradient", "sgp": False}), ("w/o DGA & SGP", {"dga": "none", "sgp": False})]
# papers/000 Table 5: rows = aggregation path (sgp), columns = layer-budget rule, both with DGA on.
PATHS = [("Single path (w/o Tri-State)", False), ("Tri-state type-matched (FedSAP)", True)]
BUDGETS = [("Uniform layer budget", 0), ("Adaptive layer budget", 1)]
# papers/000 Table 2: the layer whose gradients DGA compares, under the fixed-mask reference setting.
TABLE2 = [("Conv1", "conv1"), ("Layer1", "layer1"), ("Layer2", "layer2"), ("Layer3", "layer3")]
# DGA controls: how the pseudo-groups are formed (similarity of the probe gradient, FedSAP's default since
# issue 24, or of the trained gradient, the paper's signal; true domains, random, one group each). The
# controls run at the default, so they match dga_source=probe (the signal they do not use).
DGA_CONTROLS = [("gradient", {"dga": "gradient", "dga_source": "probe"}),
                ("gradient (trained)", {"dga": "gradient", "dga_source": "train"}),
                *((m, {"dga": m, "dga_source": "probe"}) for m in ("oracle", "random", "none"))]
# Stable masks (docs/readings.md#stable-masks): what line 14's selection smooths and how it resists swaps.
_TODAY = {"smoothing": "dispersion", "stability": "none", "ranking": "client", "masks": "dynamic"}
_EMA = {**_TODAY, "smoothing": "statistics"}
STABILITY_RULES = [("re-ranked every round", _TODAY), ("EMA", _EMA), ("EMA + hysteresis", {**_EMA, "stability": "hysteresis"}),
                   ("EMA + swap budget", {**_EMA, "stability": "swap_budget"}), ("EMA + pooled ranking", {**_EMA, "ranking": "pooled"}),
                   ("EMA + pooled ranking + swap budget", {**_EMA, "ranking": "pooled", "stability": "swap_budget"}),
                   ("fixed after warm-up", {**_TODAY, "masks": "fixed"})]
FEDSAP_ALGORITHMS = ("fedsap", "fedsap_fixed")
NON_DOMAIN = ("best", "final", "n_groups", "ari_domain", "ari_capacity", *sweep.DEVICE_COLUMNS)


def figure4_table(res: Any) -> pd.DataFrame:
    """papers/000 Figure 4: FedSAP, w/o DGA (``dga=none``), w/o SGP (``sgp=false``) and without both,
    with best / final global accuracy and the best-so-far accuracy of each domain."""
    return sweep.option_table(res, "fedsap", FIGURE4, domains=True).rename(columns={"row": "ablation"})


def table5_table(res: Any) -> pd.DataFrame:
    """papers/000 Table 5 as a long table: one row per (aggregation path, layer-budget rule) cell with
    runs (``fedsap``, DGA on); columns ``path`` and ``budget`` place it in the 2x2 (:func:`table5_grid`)."""
    cells = [(f"{p} / {b}", {"dga": "gradient", "sgp": sgp, "adaptive_layer_budget": ab})
             for p, sgp in PATHS for b, ab in BUDGETS]
    t = sweep.option_table(res, "fedsap", cells)
    where = {f"{p} / {b}": (p, b) for p, _ in PATHS for b, _ in BUDGETS}
    t.insert(0, "path", [where[r][0] for r in t["row"]])
    t.insert(1, "budget", [where[r][1] for r in t["row"]])
    return t.drop(columns="row")


def table5_grid(table: pd.DataFrame, value: str = "best_mean") -> pd.DataFrame:
    """The 2x2 view of :func:`table5_table` (rows: aggregation path, columns: budget rule, the
    paper's order; NaN for a cell without runs). ``value`` is any column, e.g. of :func:`sweep.pm_table`."""
    grid = table.pivot(index="path", columns="budget", values=value) if len(table) else pd.DataFrame()
    grid = grid.reindex(index=[p for p, _ in PATHS], columns=[b for b, _ in BUDGETS])
    grid.index.name, grid.columns.name = "aggregation path", "layer budget"
    return grid


def table2_table(res: Any) -> pd.DataFrame:
    """papers/000 Table 2: ``fedsap_fixed`` with DGA gradients from conv1 / layer1 / layer2 / layer3,
    in that order, with ``delta`` = best_mean minus Conv1's best_mean (NaN without a Conv1 row)."""
    t = sweep.option_table(res, "fedsap_fixed", [(label, {"dga_layer": layer}) for label, layer in TABLE2])
    t = t.rename(columns={"row": "gradient source"})
    base = t.loc[t["gradient source"] == TABLE2[0][0], "best_mean"]
    t["delta"] = t["best_mean"] - (float(base.iloc[0]) if len(base) else np.nan)
    return t


def dga_controls_table(res: Any) -> pd.DataFrame:
    """FedSAP with DGA from trained or probe gradients vs. the oracle (true domains), random groups and none, with how
    well the pseudo-groups matched: mean ARI vs. the domains and vs. the capacity tiers and the
    number of groups (each a mean over DGA rounds, then mean ± std over seeds)."""
    t = sweep.option_table(res, "fedsap", DGA_CONTROLS, grouping=True)
    return t.rename(columns={"row": "dga"})


def stability_table(res: Any) -> pd.DataFrame:
    """FedSAP under each mask-stability rule (:data:`STABILITY_RULES`), with the deployed models, the worst
    client and the mean swapped share of the narrowest clients after warm-up (``swap keep-min``)."""
    t = sweep.option_table(res, "fedsap", STABILITY_RULES)
    if t.empty:
        return t.rename(columns={"row": "rule"})
    pr = stability.per_run(res)
    rows = [pr.loc[pr["variant"].isin([v.strip() for v in names.split(",")]), "swap_narrow"] for names in t["variants"]]
    t["swap keep-min_mean"] = [r.mean() for r in rows]
    t["swap keep-min_std"] = [r.std() for r in rows]
    return t.rename(columns={"row": "rule"})


def mask_motion_table(res: Any) -> pd.DataFrame:
    """How FedSAP's masks moved, one row per run: mean client-channels re-activated per round and
    Global <-> Private switches per round (rounds 1..R-1: the last round prepares no masks), and the
    final share of trainable coordinates that some client of each domain has trained (``domain_coverage``
    at the last evaluated round, primary eval mode). Runs written before these columns existed are left out."""
    res = sweep.load_sweep(res)
    runs = res.runs[res.runs["algorithm"].isin(FEDSAP_ALGORITHMS) & (res.runs["status"] == "finished")]
    rounds = sweep.table(res, "rounds")
    if runs.empty or "n_reactivated" not in rounds.columns:
        return pd.DataFrame()
    rounds = rounds[rounds["run_id"].isin(runs["run_id"])]
    per_round = rounds.drop_duplicates(["run_id", "round"]).sort_values(["run_id", "round"])
    last = per_round.groupby("run_id")["round"].transform("max")
    moves = per_round[per_round["round"] < last].groupby("run_id")[["n_reactivated", "n_role_switches"]].mean()
    cov = stability.final_coverage(rounds)
    out = runs[["run_id", "variant", "seed"]].set_index("run_id").join(moves).join(cov.add_prefix("coverage "))
    shares = stability.swap_shares(res)
    if len(shares):  # the share of each capacity's active channels that are new per round, after warm-up
        keep = shares.pivot_table(index="run_id", columns="capacity_max", values="swap_share", aggfunc="first")
        out = out.join(keep.rename(columns=lambda k: f"swap keep {k:g}"))
    return out.dropna(subset=["n_reactivated"]).sort_values(["variant", "seed"]).reset_index()


def baselines_table(res: Any) -> pd.DataFrame:
    """The non-FedSAP runs of the folder (e.g. heterogeneous FedAvg at the same capacities, the floor
    under every ablation cell), one row per run label (:func:`analysis.labels.label`); runs of one label
    whose configurations differ beyond the seed get one row each, ``<label> [<differing keys>]``, with a
    :class:`UserWarning`."""
    res = sweep.load_sweep(res)
    pr = sweep.per_run(res)
    pr = pr[~pr["algorithm"].isin(FEDSAP_ALGORITHMS) & (pr["status"] == "finished")].assign(baseline=lambda d: d["label"])
    configs, mixed = sweep.split_configs(pr, ["baseline"])
    if mixed:
        warnings.warn(sweep.mixed_warning(mixed), UserWarning, stacklevel=2)
        pr["baseline"] = [f"{b} [{c}]" if c else b for b, c in zip(pr["baseline"], configs)]
    out = sweep.mean_std(pr, "baseline", {"best": "best_global_accuracy", "final": "final_global_accuracy"})
    names = pr.groupby("baseline", sort=False)["variant"].agg(lambda v: ", ".join(dict.fromkeys(v)))
    out.insert(1, "variants", out["baseline"].map(names))
    return out


def report(res: Any) -> str:
    """Every ablation table of a folder as markdown (accuracies in %, mean ± std over seeds); a table
    whose runs the folder lacks says so."""
    res = sweep.load_sweep(res)
    out = ["# FedSAP ablations (papers/000)", ""]

    def section(title: str, table: pd.DataFrame, note: str = "", empty: str = "No runs of this table in the folder.") -> None:
        body = sweep.markdown(sweep.drop_unrecorded(table)) if len(table) else empty
        out.extend([f"## {title}", ""] + ([note, ""] if note else []) + [body, ""])

    section("Component ablation (Figure 4)", sweep.pm_table(figure4_table(res)),
            "Per-domain columns: best-so-far accuracy of the domain; best / final: global accuracy.")
    t5 = table5_table(res)
    grid = table5_grid(sweep.pm_table(t5), "best") if len(t5) else t5
    section("Aggregation path x layer-budget rule (Table 5)", grid.reset_index() if len(t5) else grid,
            "Best-so-far global accuracy, DGA on.")
    device = sweep.pm_table(t5)[["path", "budget", "seeds", "best", "final", *sweep.DEVICE_COLUMNS]] if len(t5) else t5
    if len(device) and not set(sweep.DEVICE_COLUMNS) & set(sweep.drop_unrecorded(device).columns):
        device = device.iloc[0:0]
    section("Table 5: what each device ran and spent", device,
            "best / final: the group models (the paper's figure); deployed: each client's own model at its own "
            "channels on its own domain (best, final) and the worst client at the final round; train_gmacs: "
            "forward GMACs one client spent in local training per round (docs/readings.md#deployed-evaluation).",
            empty="No Table 5 run of the folder recorded deployed evaluation or training compute (results schema 4).")
    t2 = sweep.pm_table(table2_table(res))
    if len(t2):
        t2["delta"] = [f"{100 * d:+.1f}" if not pd.isna(d) else "–" for d in t2["delta"]]
    section("DGA gradient source (Table 2)", t2, "Fixed-mask reference setting; delta = best minus Conv1's (pp).")
    section("DGA controls", sweep.pm_table(dga_controls_table(res)),
            "ARI of the pseudo-groups vs. the true domains and vs. the capacity tiers, mean over DGA rounds.")
    motion = mask_motion_table(res)
    section("How the masks moved", motion.round(3),
            "Mean client-channels re-activated (Dropped -> active) and Global <-> Private switches per round; "
            "coverage: share of trainable coordinates some client of the domain trained since round 1; "
            "swap keep k: mean share of the active channels of keep-k clients that are new each round after warm-up.",
            empty="No FedSAP run of the folder recorded its mask motion (rounds.n_reactivated, written since "
                  "results schema 3).")
    section("Mask stability rules", sweep.pm_table(stability_table(res)),
            "Line 14's selection under each rule (docs/readings.md#stable-masks); swap keep-min: mean share of "
            "the narrowest clients' active channels that are new each round after warm-up (%).")
    section("Baselines", sweep.pm_table(baselines_table(res)))
    return "\n".join(out)


def _domains(table: pd.DataFrame) -> list[str]:
    stems = [c[:-5] for c in table.columns if c.endswith("_mean") and c[:-5] + "_std" in table.columns]
    return [s for s in stems if s not in NON_DOMAIN]


def plot_ablation(table: pd.DataFrame, path: str | Path | None = None, metric: str = "best") -> Any:
    """Figure 4 style grouped bars: for each domain (best-so-far) and the global accuracy
    (``metric``), one bar per row of ``table`` (any table here, e.g. :func:`figure4_table`), error
    bars = std over seeds."""
    if table.empty:
        raise sweep.MissingData("no runs for this table")
    label = table.columns[0]
    groups = [(d, d) for d in _domains(table)] + [(f"global ({metric})", metric)]
    fig, axes = new_figure(1, ncols=1, panel=(max(5.0, 1.5 + 0.35 * len(groups) * len(table)), 3.8))
    ax = axes[0]
    width = 0.8 / len(table)
    x = np.arange(len(groups))
    for i, (_, r) in enumerate(table.iterrows()):
        means = np.array([100 * r[f"{c}_mean"] for _, c in groups], dtype=float)
        stds = np.nan_to_num(np.array([100 * r[f"{c}_std"] for _, c in groups], dtype=float))
        ax.bar(x - 0.4 + width * (i + 0.5), means, width, yerr=stds, capsize=2, label=str(r[label]),
               color=color(i, len(table)))
    ax.set_xticks(x, [g for g, _ in groups])
    ax.set_ylabel("accuracy (%)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return finish(fig, path)


def plot_table5(table: pd.DataFrame, path: str | Path | None = None, metric: str = "best") -> Any:
    """The 2x2 of :func:`table5_table` as an annotated grid: colour = mean ``metric`` accuracy,
    text = mean ± std (%) and seeds; an empty cell says so."""
    if table.empty:
        raise sweep.MissingData("no Table 5 runs")
    mean, std = table5_grid(table, f"{metric}_mean"), table5_grid(table, f"{metric}_std")
    seeds = table5_grid(table, "seeds")
    fig, axes = new_figure(1, ncols=1, panel=(6.2, 3.6))
    ax = axes[0]
    im = ax.imshow(100 * mean.to_numpy(float), cmap="viridis")
    for i in range(mean.shape[0]):
        for j in range(mean.shape[1]):
            m, s, n = mean.iat[i, j], std.iat[i, j], seeds.iat[i, j]
            text = "no runs" if pd.isna(m) else f"{100 * m:.1f}" + ("" if pd.isna(s) else f" ± {100 * s:.1f}") + f"\n({int(n)} seeds)"
            ax.text(j, i, text, ha="center", va="center", color="white" if not pd.isna(m) else "black", fontsize=9)
    ax.set_xticks(range(mean.shape[1]), [c.replace(" layer", "\nlayer") for c in mean.columns])
    ax.set_yticks(range(mean.shape[0]), list(mean.index), fontsize=8)
    ax.set_title(f"{metric} global accuracy (%)")
    fig.colorbar(im, ax=ax, fraction=0.046)
    return finish(fig, path)
