"""Per-run figures read from the rounds and clients tables: accuracies, DGA agreement, the deployed
models, training compute and the sub-model widths.

Accuracies follow papers/000 Table 1 (after DapperFL): "best" is the best-so-far accuracy of
the ``__global__`` row (the unweighted mean of the domain accuracies at one round), "final" the
last evaluated round, both read from the run's primary eval mode, the mode of its earliest
evaluated global row (``group`` for FedSAP, ``global`` otherwise; rounds that
``training.eval_every`` skipped carry no mode and are never the primary). Every number comes from
the Parquet rows. Each function returns one row per run (index ``run_id``);
:func:`analysis.runs.per_run` joins them into the per-run table.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from fedsap_ray import results

GLOBAL = results.GLOBAL_DOMAIN
DEPLOYED = "deployed"  # the eval mode of each client's own model (docs/readings.md#deployed-evaluation)


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name] if name in df.columns else pd.Series(np.nan, index=df.index)


def primary_rounds(rounds: pd.DataFrame) -> pd.DataFrame:
    """The evaluated ``rounds`` rows (every domain and the ``__global__`` row) of each run's primary
    eval mode, the mode of its earliest evaluated global row (rows of rounds skipped by
    ``training.eval_every`` carry none), in (run_id, round) order; the
    column ``acc`` is the accuracy (``global_accuracy`` where the global row's accuracy is null)."""
    if rounds.empty or "domain" not in rounds.columns:
        return pd.DataFrame(columns=["run_id", "round", "domain", "acc"])
    r = rounds.assign(_mode=(_column(rounds, "eval_mode").astype(object).where(lambda s: s.notna(), "")))
    # the primary mode is read from EVALUATED global rows only: with training.eval_every > 1 the rows of
    # rounds that were not evaluated carry no mode, and taking the first global row's mode would then
    # select nothing (every best/final accuracy NaN; issue 14)
    ran = _column(r, "evaluated").astype("boolean").fillna(True).astype(bool)
    glob = r[(r["domain"] == GLOBAL) & (r["_mode"] != "") & ran]
    primary = glob.sort_values(["run_id", "round"], kind="stable").groupby("run_id", sort=False)["_mode"].first()
    r = r[r["_mode"] == r["run_id"].map(primary)]
    acc = pd.to_numeric(_column(r, "accuracy"), errors="coerce")
    acc = acc.fillna(pd.to_numeric(_column(r, "global_accuracy"), errors="coerce"))
    evaluated = _column(r, "evaluated").astype("boolean").fillna(acc.notna()).astype(bool)
    r = r.assign(acc=acc)[evaluated & acc.notna()]
    return r.sort_values(["run_id", "round"], kind="stable").drop(columns="_mode")


def global_accuracy(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per run (index run_id): ``best_global_accuracy`` (best so far) and ``final_global_accuracy``
    (last evaluated round) of the primary eval mode's ``__global__`` rows."""
    g = primary_rounds(rounds)
    g = g[g["domain"] == GLOBAL].groupby("run_id", sort=False)["acc"]
    return pd.DataFrame({"best_global_accuracy": g.max(), "final_global_accuracy": g.last()})


def domain_best(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per run (index run_id) the best-so-far accuracy of each test domain, columns in the order the
    runs wrote them, and ``global`` (papers/000 Table 1: per-domain bests may come from different rounds)."""
    r = primary_rounds(rounds)
    if r.empty:
        return pd.DataFrame(columns=["global"], dtype=float)
    best = r.pivot_table(index="run_id", columns="domain", values="acc", aggfunc="max")
    best = best[[d for d in dict.fromkeys(r["domain"]) if d in best.columns]]
    best.columns.name = None
    return best.rename(columns={GLOBAL: "global"})


def grouping_stats(rounds: pd.DataFrame) -> pd.DataFrame:
    """FedSAP DGA per run (index run_id): mean over the DGA rounds of ``n_groups``, ``ari_domain``
    (pseudo-groups vs. true domains) and ``ari_capacity`` (vs. capacity tiers); NaN for other strategies."""
    cols = ["n_groups", "ari_domain", "ari_capacity"]
    if rounds.empty or "n_groups" not in rounds.columns:
        return pd.DataFrame(columns=cols, dtype=float)
    dga = rounds.dropna(subset=["n_groups"]).drop_duplicates(["run_id", "round"])
    return dga.groupby("run_id")[cols].mean()


DEVICE_COLUMNS = ("deployed", "deployed_final", "worst_client", "train_gmacs")


def deployed_accuracy(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per run (index run_id): best and final global accuracy of the ``deployed`` eval mode and the worst
    client's figure at the final evaluated round (all NaN for runs without deployed rows)."""
    cols = ["deployed", "deployed_final", "worst_client"]
    if rounds.empty or "eval_mode" not in rounds.columns:
        return pd.DataFrame(columns=cols, dtype=float)
    g = rounds[(rounds["eval_mode"] == DEPLOYED) & (rounds["domain"] == GLOBAL)]
    g = g[g["accuracy"].notna()].sort_values(["run_id", "round"], kind="stable").groupby("run_id", sort=False)
    worst = g["worst_client_accuracy"].last() if "worst_client_accuracy" in rounds.columns else g["accuracy"].last() * np.nan
    return pd.DataFrame({"deployed": g["accuracy"].max(), "deployed_final": g["accuracy"].last(),
                         "worst_client": worst})


def train_compute(clients: pd.DataFrame) -> pd.DataFrame:
    """Per run (index run_id): mean and largest forward GMACs of one client's local training in one round."""
    if clients.empty or "train_macs" not in clients.columns:
        return pd.DataFrame(columns=["train_gmacs", "max_train_gmacs"], dtype=float)
    g = pd.to_numeric(clients["train_macs"], errors="coerce").div(1e9).groupby(clients["run_id"])
    return pd.DataFrame({"train_gmacs": g.mean(), "max_train_gmacs": g.max()})


LATE_ROUNDS = 10


def _widest_late(clients: pd.DataFrame) -> pd.Series:
    """Per run: mean over its last LATE_ROUNDS rounds of max(capacity_used) over that round's clients."""
    if clients is None or clients.empty or "capacity_used" not in clients.columns:
        return pd.Series(dtype=float)
    widest = clients.groupby(["run_id", "round"])["capacity_used"].max().reset_index()
    last = widest.groupby("run_id")["round"].transform("max")
    late = widest[widest["round"] > last - LATE_ROUNDS]
    return late.groupby("run_id")["capacity_used"].mean()


WIDTH_COLUMNS = ("rounds", "avg_p", "final_frozen_params", "widest_p_late")


def width_stats(rounds: pd.DataFrame, clients: pd.DataFrame) -> pd.DataFrame:
    """Per run (index run_id), papers/003's sub-model figures: ``rounds`` (last round written), ``avg_p``
    the mean over rounds of ``avg_capacity`` (Tables 3/6 "Avg. p", Figure 6 p̄), ``final_frozen_params``
    the ``frozen_params`` of the last round that reports it (Proposition 3's frozen coordinates) and
    ``widest_p_late`` the mean over the last :data:`LATE_ROUNDS` rounds of the widest width any
    participant trained (``clients``): below 1, the outer slice of every layer went untrained in those
    rounds even when it was covered earlier (HAS-FL without the guarantee after warm-up)."""
    if rounds.empty:
        return pd.DataFrame(columns=list(WIDTH_COLUMNS), dtype=float)
    # per-round quantities: the same on every row of a round, so take one per (run, round)
    all_rows = rounds.assign(avg_capacity=pd.to_numeric(_column(rounds, "avg_capacity"), errors="coerce"),
                             frozen=pd.to_numeric(_column(rounds, "frozen_params"), errors="coerce"))
    per_round = all_rows.sort_values(["run_id", "round"]).groupby(["run_id", "round"]).agg(
        avg_capacity=("avg_capacity", "first"), frozen=("frozen", "first")).reset_index()
    out = per_round.groupby("run_id").agg(
        rounds=("round", "max"),
        avg_p=("avg_capacity", "mean"),
        final_frozen_params=("frozen", lambda s: s.dropna().iloc[-1] if s.notna().any() else np.nan))
    return out.join(_widest_late(clients).rename("widest_p_late"), how="left")
