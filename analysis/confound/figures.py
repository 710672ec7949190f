"""papers/003 Figure 6, the accuracy-capacity frontier, drawn from :func:`analysis.confound.tables.frontier`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd


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


