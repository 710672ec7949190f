"""Figures of a sweep folder: convergence per domain, the accuracy-capacity frontier, HAS-FL's
allocations and estimates, and where FedSAP's layer budgets went.

Every function takes a results folder or a loaded sweep (:func:`analysis.sweep.load_sweep`),
returns a matplotlib Figure drawn on an Agg canvas (no pyplot state, so it works headless and
in notebooks: ``display(fig)``), writes it as PNG when ``path`` is given, and raises
:class:`analysis.sweep.MissingData` when the folder has nothing to draw.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis import confound, sweep

STATE_COLORS = {"global": "tab:blue", "private": "tab:orange", "dropped": "lightgray"}


def new_figure(n_panels: int, ncols: int = 3, panel: tuple[float, float] = (4.2, 3.3)) -> tuple[Any, list[Any]]:
    """A Figure with ``n_panels`` axes on a grid of at most ``ncols`` columns (unused ones hidden)."""
    n = max(1, n_panels)
    cols = min(n, ncols)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(panel[0] * cols, panel[1] * rows))
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).ravel())
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def finish(fig: Any, path: str | Path | None = None) -> Any:
    """Lay the figure out and write it as PNG when ``path`` is given; return the figure."""
    fig.tight_layout()
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=120)
    return fig


def color(i: int, n: int) -> Any:
    """Colour of the i-th of n lines: the default cycle, or tab20 when there are more than ten."""
    if n <= 10:
        return f"C{i}"
    from matplotlib import colormaps

    return colormaps["tab20"](i % 20)


def _variants(res: Any, df: pd.DataFrame, variants: Sequence[str] | None) -> list[str]:
    """Variants present in ``df``, in the runs table's order (or the order given)."""
    have = set(df["variant"])
    order = list(variants) if variants is not None else list(dict.fromkeys(res.runs["variant"]))
    return [v for v in order if v in have]


# ----------------------------------------------------------------------------- convergence

def plot_convergence(res: Any, variants: Sequence[str] | None = None, *, domains: bool = True,
                     path: str | Path | None = None) -> Any:
    """Accuracy vs. round (primary eval mode, evaluated rounds): one panel for the global accuracy
    and, with ``domains``, one per test domain; one line per variant, the mean over its seeds, with
    a ± std band when it has several."""
    res = sweep.load_sweep(res)
    r = sweep.join_runs(sweep.primary_rounds(sweep.table(res, "rounds")), res.runs, ("variant", "seed"))
    if r.empty:
        raise sweep.MissingData("no evaluated rounds")
    panels = [sweep.GLOBAL] + ([d for d in dict.fromkeys(r["domain"]) if d != sweep.GLOBAL] if domains else [])
    names = _variants(res, r, variants)
    fig, axes = new_figure(len(panels))
    for ax, dom in zip(axes, panels):
        part = r[r["domain"] == dom]
        for i, v in enumerate(names):
            curve = part[part["variant"] == v].pivot_table(index="round", columns="seed", values="acc", aggfunc="mean")
            if curve.empty:
                continue
            mean, std = 100 * curve.mean(axis=1), 100 * curve.std(axis=1)
            c = color(i, len(names))
            ax.plot(curve.index, mean, marker="o" if len(curve) < 12 else None, ms=3, color=c, label=v)
            if curve.shape[1] > 1:
                ax.fill_between(curve.index, mean - std, mean + std, color=c, alpha=0.2, linewidth=0)
        ax.set_title("global (mean over domains)" if dom == sweep.GLOBAL else dom)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7 if len(names) > 6 else 8, loc="best")
    return finish(fig, path)


# ----------------------------------------------------------------------------- frontier (papers/003 Figure 6)

def plot_frontier(res: Any, path: str | Path | None = None, finished_only: bool = True) -> Any:
    """papers/003 Figure 6: final accuracy vs. average per-round width p̄ per variant
    (:func:`analysis.confound.frontier` drawn by :func:`analysis.confound.frontier_figure`)."""
    pr = confound.per_run(sweep.load_sweep(res))
    if finished_only:
        pr = pr[pr["status"] == "finished"]
    fr = confound.frontier(pr.dropna(subset=["final_accuracy"]))
    if fr.empty:
        raise sweep.MissingData("no finished run with an evaluated round")
    return finish(confound.frontier_figure(fr), path)


# ----------------------------------------------------------------------------- HAS-FL allocations

def final_allocations(res: Any) -> pd.DataFrame:
    """The ``allocations`` rows of each run's last round (all N clients), with variant and seed."""
    res = sweep.load_sweep(res)
    al = sweep.table(res, "allocations")
    if al.empty:
        raise sweep.MissingData("no allocations rows (only sub-model allocation strategies write them)")
    last = al.groupby("run_id")["round"].transform("max")
    return sweep.join_runs(al[al["round"] == last], res.runs, ("variant", "seed"))


def plot_allocations(res: Any, variants: Sequence[str] | None = None, path: str | Path | None = None) -> Any:
    """Final-round width p of every client against its constraint p_max, one panel per variant
    (points of all seeds, slightly jittered); the diagonal p = p_max is the most a client may train."""
    res = sweep.load_sweep(res)
    al = final_allocations(res)
    names = _variants(res, al, variants)
    fig, axes = new_figure(len(names))
    rng = np.random.default_rng(0)  # jitter only: fixed so the figure is reproducible
    for ax, v in zip(axes, names):
        part = al[al["variant"] == v]
        x = part["capacity_max"].to_numpy(float)
        ax.scatter(x + rng.uniform(-0.015, 0.015, len(x)), part["p"].to_numpy(float), s=14, alpha=0.7)
        means = part.groupby("capacity_max")["p"].mean()
        ax.plot(means.index, means.values, "_", ms=22, mew=2, color="black", label="mean p per p_max")
        ax.plot([0, 1], [0, 1], "--", color="gray", lw=1, label="p = p_max")
        ax.set(xlim=(0, 1.05), ylim=(0, 1.05), xlabel="p_max (capacity)", ylabel="final p", title=v)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    return finish(fig, path)


def plot_estimates(res: Any, variants: Sequence[str] | None = None, path: str | Path | None = None) -> Any:
    """HAS-FL's final smoothed estimates H~_i (Eq. 5) against the ground-truth label TV distance and
    against the capacity p_max (papers/003 Table 5's question), every client of every run
    (:func:`analysis.confound.final_state`), coloured by variant."""
    res = sweep.load_sweep(res)
    st = confound.final_state(res)
    st = sweep.join_runs(st[pd.to_numeric(st["h_tilde"], errors="coerce").notna()], res.runs, ("variant", "seed"))
    if st.empty:
        raise sweep.MissingData("no client has an H~ estimate (only HAS-FL-style strategies write them)")
    names = _variants(res, st, variants)
    fig, axes = new_figure(2, ncols=2)
    for ax, (x, label) in zip(axes, (("tv_distance", "TV(client labels, global labels)"), ("capacity_max", "p_max"))):
        for i, v in enumerate(names):
            part = st[st["variant"] == v]
            ax.scatter(pd.to_numeric(part[x], errors="coerce"), pd.to_numeric(part["h_tilde"], errors="coerce"),
                       s=14, alpha=0.7, color=color(i, len(names)), label=v)
        ax.set(xlabel=label, ylabel="final H~ (Eq. 5)", title=f"H~ vs. {label.split('(')[0].strip()}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    return finish(fig, path)


# ----------------------------------------------------------------------------- FedSAP layer budgets

def layer_budget_table(res: Any, variant: str | None = None, final_only: bool = False) -> pd.DataFrame:
    """Where FedSAP's channel budget went: per (client capacity, layer) the mean fraction of the
    layer's channels that were Global, Private and Dropped (``layers`` table, all clients of all
    rounds and seeds of ``variant``; ``final_only``: each run's last round). ``variant`` defaults to
    the first one (runs order) with layer rows. Capacity is the client's ``capacity_max`` (kappa_i)."""
    res = sweep.load_sweep(res)
    layers = sweep.join_runs(sweep.table(res, "layers"), res.runs, ("variant",))
    if layers.empty:
        raise sweep.MissingData("no layers rows (only FedSAP writes them)")
    if variant is None:
        variant = _variants(res, layers, None)[0]
    layers = layers[layers["variant"] == variant]
    if layers.empty:
        raise sweep.MissingData(f"variant {variant!r} has no layers rows")
    if final_only:
        layers = layers[layers["round"] == layers.groupby("run_id")["round"].transform("max")]
    cap = sweep.table(res, "clients")[["run_id", "round", "client_id", "capacity_max"]]
    df = layers.merge(cap, on=["run_id", "round", "client_id"], how="left")
    ch = df["channels"].astype(float)
    df = df.assign(**{s: df[f"n_{s}"] / ch for s in STATE_COLORS}, capacity=df["capacity_max"].astype(float))
    order = list(dict.fromkeys(df["layer"]))
    out = df.groupby(["capacity", "layer"], dropna=False).agg(
        **{s: (s, "mean") for s in STATE_COLORS}, rows=("layer", "size")).reset_index()
    out["_rank"] = out["layer"].map({name: i for i, name in enumerate(order)})
    out = out.sort_values(["capacity", "_rank"], ascending=[False, True]).drop(columns="_rank")
    return out.assign(variant=variant)[["variant", "capacity", "layer", *STATE_COLORS, "rows"]].reset_index(drop=True)


def plot_layer_budgets(res: Any, variant: str | None = None, final_only: bool = False,
                       path: str | Path | None = None) -> Any:
    """Stacked bars of :func:`layer_budget_table`: per layer the Global / Private / Dropped share of
    its channels, one panel per client capacity (widest first)."""
    t = layer_budget_table(res, variant, final_only)
    caps = list(dict.fromkeys(t["capacity"]))
    fig, axes = new_figure(len(caps), ncols=3, panel=(4.6, 3.4))
    for ax, cap in zip(axes, caps):
        part = t[t["capacity"] == cap] if not pd.isna(cap) else t[t["capacity"].isna()]
        x = np.arange(len(part))
        bottom = np.zeros(len(part))
        for state, color in STATE_COLORS.items():
            vals = part[state].to_numpy(float)
            ax.bar(x, vals, bottom=bottom, color=color, label=state.capitalize())
            bottom += vals
        ax.set_xticks(x, part["layer"], rotation=60, ha="right", fontsize=7)
        ax.set(ylim=(0, 1.0), ylabel="fraction of channels",
               title=f"{t['variant'].iloc[0]}: capacity {cap:.2f}" if not pd.isna(cap) else "capacity unknown")
    axes[0].legend(fontsize=7, loc="lower left")
    return finish(fig, path)
