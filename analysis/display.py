"""Display copies of analysis tables and the one markdown renderer.

Tables stay numeric (fractions, ``<m>_mean`` / ``<m>_std`` pairs) until shown: :func:`pm_table` turns
them into "mean ± std" text in percent, :func:`markdown` prints any frame with
:meth:`pandas.DataFrame.to_markdown` (tabulate), compacted to the one-space cells the README and
docs/studies quote.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from analysis.metrics import DEVICE_COLUMNS
from analysis.runs import MissingData

MISSING = "–"  # how a missing value prints


NOT_PERCENT = ("n_groups", "ari_domain", "ari_capacity", "avg_p", "value", "seeds", "train_gmacs")


def pm_table(df: pd.DataFrame, digits: int = 1, not_percent: Sequence[str] = NOT_PERCENT) -> pd.DataFrame:
    """A display copy of a table: each ``<m>_mean``/``<m>_std`` column pair becomes one "mean ± std"
    string column ``<m>``, accuracies in percent (names in ``not_percent`` as they are, two decimals)."""
    out = pd.DataFrame(index=df.index)
    for c in df.columns:
        if c.endswith("_std") and c[:-4] + "_mean" in df.columns:
            continue
        if not (c.endswith("_mean") and c[:-5] + "_std" in df.columns):
            out[c] = df[c]
            continue
        stem = c[:-5]
        scale, d = (1.0, 2) if stem in not_percent else (100.0, digits)
        out[stem] = [("–" if pd.isna(m) else f"{scale * m:.{d}f}" + ("" if pd.isna(s) else f" ± {scale * s:.{d}f}"))
                     for m, s in zip(df[c], df[stem + "_std"])]
    return out


def per_seed(per_run: pd.DataFrame, values: Sequence[str]) -> pd.DataFrame:
    """One row per variant (in first-appearance order) and a column ``<value> s<seed>`` per value and seed, in
    percent to one decimal: a study's per-seed table."""
    seeds = per_run.pivot_table(index="variant", columns="seed", values=list(values), sort=False)
    seeds.columns = [f"{m} s{s}" for m, s in seeds.columns]
    return (100 * seeds).round(1).reset_index()


def drop_unrecorded(df: pd.DataFrame, cols: Sequence[str] = DEVICE_COLUMNS) -> pd.DataFrame:
    """``df`` without those of ``cols`` that no row has a value in (runs written before the deployed
    evaluation and ``train_macs`` existed), so a report does not print columns of dashes."""
    empty = [c for c in cols if c in df.columns and df[c].replace("–", np.nan).isna().all()]
    return df.drop(columns=empty)


def markdown(df: pd.DataFrame, index: bool = False) -> str:
    """``df`` as a GitHub markdown table: :meth:`pandas.DataFrame.to_markdown` with text cells as they are
    (missing values "–") and no alignment padding (``stralign=None``), so cells are padded by one space
    and the tables diff well and read as the README and docs/studies quote them."""
    d = df.reset_index() if index else df
    d = d.map(lambda v: v if isinstance(v, str) else MISSING if _missing(v) else str(v)).rename(columns=str)
    lines = d.to_markdown(index=False, tablefmt="github", disable_numparse=True, stralign=None,
                          missingval=MISSING).splitlines()
    lines[1] = "| " + " | ".join("---" for _ in d.columns) + " |"  # tabulate's rule spans the widest cell
    return "\n".join(lines)


def _missing(v: Any) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):  # a list or array cell
        return False


def show(title: str, make: Callable[[], Any]) -> None:
    """Notebook helper: display ``make()`` (a table or a Figure) under a heading, or print why it was
    skipped when the folder lacks its runs (an empty table or :class:`MissingData`)."""
    from IPython.display import Markdown, display

    try:
        out = make()
    except MissingData as e:
        print(f"{title}: skipped ({e})")
        return None
    if isinstance(out, pd.DataFrame) and (out.empty or out.isna().all().all()):
        print(f"{title}: skipped (no runs of this table in the folder)")
        return None
    display(Markdown(f"### {title}"))
    display(out)
    return None
