"""Accuracy against simulated device time (issue 28; docs/guides/device-time.md).

Every figure here is read from the runs' own rows: ``rounds.sim_elapsed_s`` (simulated device seconds
of rounds 1..t, fedsap_ray.data.devices) against the best-so-far accuracy up to round t of the run's primary
eval mode (``full_width``: the server's models, as the papers report) or of its ``deployed`` mode (each
client's own model). Methods are the Table 1 row names (:func:`analysis.comparison.method_of`), and
HeteroFL's and FjORD's (:data:`ROWS`); seeds are averaged round by round (every seed of a method runs
the same rounds).

Asynchronous runs (``devices.mode=async``, fedsap_ray.engine.asyncmode) are read beside synchronous ones: a
``rounds`` row is a server step at its simulated time (``sim_elapsed_s`` is the step's instant), an update
discarded as staler than ``asynchronous.max_staleness`` is a straggler, and a method's async variants are
told apart by name (:func:`async_variant`: buffer, concurrency, staleness rule), so two variants of one method
in one folder are two methods, never pooled as seeds.
"""
from __future__ import annotations

import math
import sys
import textwrap
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import comparison, plots, runs
from analysis.confound.tables import ROWS as CONFOUND_ROWS
from analysis.display import markdown
from analysis.metrics import primary_rounds
from fedsap_ray import results
from fedsap_ray.cli import OneLineParser
from fedsap_ray.algorithms.staleness import DEFAULT_A

GLOBAL = results.GLOBAL_DOMAIN
MEASURES = ("full_width", "deployed")
# Row names: Table 1's, plus the sub-model methods the confound study names (HeteroFL, FjORD), which this
# study compares with them (issue 28)
ROWS = {**CONFOUND_ROWS, **comparison.TABLE1_ROWS}
PANEL_LINES = 8  # most lines one panel of plot_policies holds; more are split by sub-models / full model
PANEL_COLUMNS = 3  # panels a row of plot_policies' figure holds (six policies: two rows)
LEGEND_INSIDE = 30  # longest method name a legend inside a panel holds; longer (async variants) go below it


def _config(run: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A run's resolved config value ``key`` (``section.field``) from its ``config.*`` column; ``default`` when
    null or absent (a run from before the field)."""
    v = run.get(results.CONFIG_PREFIX + key)
    return default if v is None or (isinstance(v, float) and math.isnan(v)) else v


def is_async(run: Mapping[str, Any]) -> bool:
    """Whether a run (a runs or :func:`analysis.runs.per_run` row) trained asynchronously (``devices.mode=async``)."""
    return _config(run, "devices.mode") == "async"


def async_variant(run: Mapping[str, Any]) -> str:
    """What an asynchronous run's training was, as its row name says it ("" for a synchronous run): the resolved
    buffer size and concurrency (nulls resolved as fedsap_ray.engine.asyncmode resolves them), the staleness rule with its
    parameters (FedAsync's defaults filled in, fedsap_ray.algorithms.staleness), and ``max_staleness`` and ``server_lr``
    where set away from their defaults. Every field that changes the training but the seed, so runs of one name
    are seeds of one variant."""
    if not is_async(run):
        return ""
    parts = [f"buffer {updates_per_step(run)}", f"concurrency {_concurrency(run)}"]
    rule = str(_config(run, "asynchronous.staleness", "constant"))
    a = _config(run, "asynchronous.staleness_a", DEFAULT_A.get(rule))
    if rule == "polynomial":
        rule += f" a={a:g}"
    elif rule == "hinge":
        rule += f" a={a:g} b={_config(run, 'asynchronous.staleness_b', 4.0):g}"
    parts.append(rule)
    if _config(run, "asynchronous.max_staleness") is not None:
        parts.append(f"max staleness {int(_config(run, 'asynchronous.max_staleness'))}")
    if float(_config(run, "asynchronous.server_lr", 1.0)) != 1.0:
        parts.append(f"server lr {float(_config(run, 'asynchronous.server_lr')):g}")
    return "async: " + ", ".join(parts)


def _round_size(run: Mapping[str, Any]) -> int:
    """A synchronous round's k: round(participation x N), at least 1 (fedsap_ray.data.devices.round_size)."""
    return max(1, int(round(float(_config(run, "training.participation", 1.0)) * int(_config(run, "data.num_clients")))))


def _concurrency(run: Mapping[str, Any]) -> int:
    """An asynchronous run's clients in flight, null resolved to k as fedsap_ray.engine.asyncmode resolves it."""
    return int(_config(run, "asynchronous.concurrency", _round_size(run)))


def updates_per_step(run: Mapping[str, Any]) -> int:
    """The client updates one step of a run applies by design: a synchronous round's k (under ``over_select`` the
    k aggregated of the sample), an asynchronous step's ``buffer_size`` (null resolved to the concurrency)."""
    if not is_async(run):
        return _round_size(run)
    return int(_config(run, "asynchronous.buffer_size", _concurrency(run)))


def to_horizon(res: Any, updates: int) -> Any:
    """``res`` read to each run's first ``updates`` client updates by design: a synchronous run to round
    floor(updates / k), an asynchronous one to step floor(updates / buffer_size) (:func:`updates_per_step`), in
    every per-round table, so that runs of different lengths, and rounds beside server steps, compare at one
    training budget. Exact for a synchronous run: nothing in rounds 1..r depends on how many follow (the
    learning rate decays per round, never by the run's length). A deadline round counts its k though its
    stragglers' updates never reach the model: the budget is the design's, the stragglers are reported apart."""
    res = load_policy(res)
    cap = {}
    for _, run in runs.per_run(res).iterrows():
        per = updates_per_step(run)
        if updates < per:
            raise ValueError(f"invalid --updates={updates}: run {run['run_id']} applies {per} updates a "
                             f"{'step' if is_async(run) else 'round'}; give at least {per}")
        cap[run["run_id"]] = updates // per
    kept = {}
    for name in runs.TABLES:
        df = runs.table(res, name)
        if "round" in df.columns:
            df = df[df["round"].to_numpy() <= np.array([cap.get(r, np.inf) for r in df["run_id"]], dtype=float)]
        kept[name] = df
    return runs.replace_tables(res, **kept)


def row_names(per_run: pd.DataFrame) -> dict[str, str]:
    """Run id -> row name, from :func:`analysis.runs.per_run`: the method's, and for an asynchronous run its
    variant in brackets (:func:`async_variant`), e.g. ``HeteroFL [async: buffer 2, concurrency 4, constant]``."""
    out = {}
    for _, run in per_run.iterrows():
        name, variant = ROWS.get(run["label"], run["label"]), async_variant(run)
        out[run["run_id"]] = f"{name} [{variant}]" if variant else name
    return out


def elapsed(res: Any) -> pd.DataFrame:
    """One row per (run, round): method, seed, ``hours`` (simulated elapsed; an asynchronous run's round is a
    server step, at its instant), and the best-so-far ``full_width`` and ``deployed`` accuracy up to that round
    (NaN before its first evaluation; a round not evaluated, ``training.eval_every``, ``deployed_every`` or
    ``asynchronous.eval_every_s``, holds the best of the evaluations before it)."""
    res = load_policy(res)
    rounds = runs.table(res, "rounds")
    if "sim_elapsed_s" not in rounds.columns:
        raise runs.MissingData("these runs record no simulated device time (rounds.sim_elapsed_s, results schema >= 6)")
    if rounds.empty:
        raise runs.MissingData("these runs finished no round (no rounds rows): nothing to time")
    clock = rounds.drop_duplicates(["run_id", "round"])[["run_id", "round", "sim_elapsed_s"]]
    out = clock.assign(hours=clock["sim_elapsed_s"] / 3600.0).drop(columns="sim_elapsed_s")
    full = primary_rounds(rounds)
    full = full[full["domain"] == GLOBAL][["run_id", "round", "acc"]].rename(columns={"acc": "full_width"})
    dep = rounds[(rounds["eval_mode"] == "deployed") & (rounds["domain"] == GLOBAL) & rounds["accuracy"].notna()]
    dep = dep[["run_id", "round", "accuracy"]].rename(columns={"accuracy": "deployed"})
    out = out.merge(full, on=["run_id", "round"], how="left").merge(dep, on=["run_id", "round"], how="left")
    out = out.sort_values(["run_id", "round"], kind="stable")
    for m in MEASURES:  # best so far: what a reader of the run at that hour could have deployed
        out[m] = out.groupby("run_id", sort=False)[m].cummax()
        out[m] = out.groupby("run_id", sort=False)[m].ffill()  # cummax leaves the rounds not evaluated NaN
    pr = runs.per_run(res)
    out["method"] = out["run_id"].map(row_names(pr))
    pr = pr.set_index("run_id")
    out["seed"] = out["run_id"].map(pr["seed"])
    return out.reset_index(drop=True)


def time_to_accuracy(res: Any, *, full_width: float | None = None, deployed: float | None = None) -> pd.DataFrame:
    """Per method: simulated hours until the best-so-far accuracy first reaches each target (mean and
    std over the seeds that reached it) and how many seeds did (``reached``: "2/3")."""
    e = elapsed(res)
    rows = []
    for method, g in e.groupby("method", sort=False):
        row: dict[str, Any] = {"method": method}
        n = g["run_id"].nunique()
        for measure, target in (("full_width", full_width), ("deployed", deployed)):
            if target is None:
                continue
            hit = g[g[measure] >= target].groupby("run_id")["hours"].min()
            row[f"{measure}_hours"] = hit.mean() if len(hit) else np.nan
            row[f"{measure}_hours_std"] = hit.std(ddof=0) if len(hit) > 1 else np.nan
            row[f"{measure}_reached"] = f"{len(hit)}/{n}"
        row["total_hours"] = g.groupby("run_id")["hours"].max().mean()
        rows.append(row)
    return pd.DataFrame(rows)


def curves(res: Any, measure: str = "deployed") -> pd.DataFrame:
    """Per method and round: mean simulated hours and mean best-so-far ``measure`` accuracy over seeds."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    e = elapsed(res)
    return e.groupby(["method", "round"], sort=False).agg(hours=("hours", "mean"), accuracy=(measure, "mean"),
                                                         seeds=("run_id", "nunique")).reset_index()


def plot_curves(res: Any, measure: str = "deployed", path: str | Path | None = None) -> Any:
    """Best-so-far accuracy against simulated hours, one line per method (the figure to read rather than a table)."""
    c = curves(res, measure)
    fig, (ax,) = plots.new_figure(1, ncols=1, panel=(6.0, 4.0))
    methods = list(dict.fromkeys(c["method"]))
    for i, m in enumerate(methods):
        g = c[c["method"] == m]
        ax.plot(g["hours"], 100 * g["accuracy"], label=m, color=plots.color(i, len(methods)), drawstyle="steps-post")
    ax.set_xlabel("simulated device time (hours)")
    ax.set_ylabel(f"best-so-far {'deployed' if measure == 'deployed' else 'full-width'} accuracy (%)")
    ax.legend(fontsize=8)
    return plots.finish(fig, path)


def missed(res: Any) -> pd.DataFrame:
    """Per method (rows) and capacity (columns ``keep 0.2`` ..., ascending): the share of a device's
    client-rounds that missed the deadline (``clients.straggler``), over every client of that capacity, round
    and seed; under ``over_select`` the share left out as slower than the round's k fastest; for an
    asynchronous run, the share of its arrived updates discarded as staler than ``asynchronous.max_staleness``
    (its stragglers)."""
    res = load_policy(res)
    c = runs.table(res, "clients")
    if "straggler" not in c.columns:
        raise ValueError("these runs record no stragglers (clients.straggler, results schema >= 6)")
    c = c.assign(method=c["run_id"].map(row_names(runs.per_run(res))),
                 late=c["straggler"].astype(float))
    out = c.pivot_table(index="method", columns="capacity_max", values="late", aggfunc="mean", sort=False)
    out = out[sorted(out.columns)]
    out.columns = [f"keep {k:g}" for k in out.columns]
    return out.reset_index()


def updates(res: Any) -> pd.DataFrame:
    """Per run (indexed by run id): ``method``, ``steps`` (rounds done: an asynchronous run's server steps),
    ``updates_applied`` (client updates that reached the model: ``clients`` rows that are no straggler),
    ``trainings`` (every ``clients`` row: each a client's local training, applied or not) and ``not_applied``
    (trained and never in the model: deadline stragglers, over-selected clients beyond the k fastest, updates
    discarded as too stale), and ``staleness_mean`` (mean ``clients.staleness`` of the applied ones; NaN for a
    synchronous run, which has none). An asynchronous run's updates still in flight when it stops (at most
    ``concurrency``) have no row: trained, never applied, and not counted here."""
    res = load_policy(res)
    c = runs.table(res, "clients")
    applied = c[~c["straggler"].fillna(False).astype(bool)] if "straggler" in c.columns else c
    stale = pd.to_numeric(applied["staleness"], errors="coerce") if "staleness" in applied.columns else np.nan
    out = pd.DataFrame({"method": pd.Series(row_names(res.runs)),
                        "steps": runs.table(res, "rounds").groupby("run_id")["round"].max(),
                        "updates_applied": applied.groupby("run_id").size(),
                        "trainings": c.groupby("run_id").size()})
    out["not_applied"] = out["trainings"] - out["updates_applied"].fillna(0)
    out["staleness_mean"] = pd.Series(stale, index=applied.index).groupby(applied["run_id"]).mean().reindex(out.index)
    return out


def concat(parts: list[Any]) -> Any:
    """Loaded results folders as one (their runs side by side; run ids must differ)."""
    if len(parts) == 1:
        return parts[0]
    shared = [rid for rid, n in Counter(rid for p in parts for rid in p.runs["run_id"]).items() if n > 1]
    if shared:
        raise ValueError(f"the folders share run ids ({sorted(shared)[:3]}); give one folder per sweep")
    return runs.replace_tables(parts[0], **{t: pd.concat([runs.table(p, t) for p in parts], ignore_index=True)
                                            for t in runs.TABLES})


def load_policy(folders: Any) -> Any:
    """One policy's runs: a results folder, a loaded one, or several folders separated by commas (one sweep
    each, e.g. ``runs/dt_wait,runs/dt_wait_rest``)."""
    if isinstance(folders, str) and "," in folders:
        return concat([runs.load_sweep(f) for f in folders.split(",") if f])
    return runs.load_sweep(folders)


def in_time_as_wait_all(policies: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``policies`` with ``wait_all`` also holding the other policies' runs of the methods it lacks in which no
    client ever missed the deadline (``rounds.n_stragglers`` 0 in every round), and those methods' names.

    Such a run trained exactly as under ``wait_all``: the deadline only removes stragglers, and a round
    without one lasts as long as its slowest client under either policy (docs/guides/device-time.md). So
    the study needs no second run of a method every device of which meets the deadline."""
    out = {p: load_policy(res) for p, res in policies.items()}
    if "wait_all" not in out:
        return out, []
    have = set(row_names(runs.per_run(out["wait_all"])).values())
    borrowed: list[Any] = []
    names: set[str] = set()
    for policy, res in out.items():
        rounds = runs.table(res, "rounds")
        if policy == "wait_all" or "n_stragglers" not in rounds.columns:
            continue
        late = rounds.groupby("run_id")["n_stragglers"].max()
        synchronous = {r["run_id"] for _, r in res.runs.iterrows() if not is_async(r)}  # an async run never waited
        in_time = {rid: m for rid, m in row_names(runs.per_run(res)).items()
                   if m not in have and late.get(rid, 1) == 0 and rid in synchronous}
        if in_time:
            borrowed.append(runs.only_runs(res, in_time))
            names |= set(in_time.values())
            have |= names  # a method is borrowed from one policy only
    out["wait_all"] = concat([out["wait_all"], *borrowed])
    return out, sorted(names)


def compare(policies: Mapping[str, Any], *, deployed: float, full_width: float | None = None) -> pd.DataFrame:
    """:func:`time_to_accuracy` of each policy's runs (``{"wait_all": folder, "deadline": folder}``), one row per
    (method, policy), with the final best-so-far deployed accuracy and :func:`updates`' ``steps``,
    ``updates_applied`` and ``staleness_mean`` (means over seeds) beside it."""
    frames = []
    for policy, res in policies.items():
        t = time_to_accuracy(res, deployed=deployed, full_width=full_width)
        last = elapsed(res).sort_values("round").groupby("run_id").tail(1)
        t["deployed_final"] = t["method"].map(last.groupby("method")["deployed"].mean())
        per_method = updates(res).groupby("method")[["steps", "updates_applied", "trainings", "not_applied",
                                                      "staleness_mean"]].mean()
        t = t.join(per_method, on="method")
        frames.append(t.assign(policy=policy))
    out = pd.concat(frames, ignore_index=True)
    # each method's rows together (its async variants too), in Table 1's order, policies in the order given
    bases = comparison.in_table1_order(dict.fromkeys(_split_variant(m)[0] for m in out["method"]))
    rank = {"method": {m: bases.index(_split_variant(m)[0]) for m in out["method"]},
            "policy": {p: i for i, p in enumerate(policies)}}
    return out.sort_values(["method", "policy"], key=lambda s: s.map(rank[str(s.name)]),
                           kind="stable").reset_index(drop=True)


def _count(v: Any) -> str:
    """A count averaged over seeds: whole when it is, else one decimal (67.3, not 67.3333)."""
    return "–" if pd.isna(v) else f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def _minutes(hours: Any, std: Any = np.nan) -> str:
    """Minutes with one decimal from a minute up, three significant digits below (a smoke run's 0.0123)."""
    if pd.isna(hours):
        return "–"
    fmt = ".1f" if 60 * hours >= 1 else ".3g"
    return f"{60 * hours:{fmt}}" + ("" if pd.isna(std) else f" ± {60 * std:{fmt}}")


def report(policies: Mapping[str, Any], *, deployed: float = 0.8, full_width: float | None = None) -> str:
    """The device-time study as markdown (simulated minutes): time to ``deployed`` accuracy (and to
    ``full_width`` accuracy of the server's model, when given) per method and policy, the run's total
    simulated time and final deployed accuracy, and the deadline's missed rounds. With asynchronous runs, also
    each method's steps, updates applied and mean staleness, and the share of updates discarded as too stale."""
    policies = {p: load_policy(res) for p, res in policies.items()}
    t = compare(policies, deployed=deployed, full_width=full_width)
    asynchronous = any(is_async(r) for res in policies.values() for _, r in res.runs.iterrows())
    cols: dict[str, Any] = {"method": t["method"], "policy": t["policy"]}
    for measure, target, name in (("deployed", deployed, "deployed"), ("full_width", full_width, "full-width")):
        if target is None:
            continue
        cols[f"to {100 * target:g}% {name} (min)"] = [
            _minutes(h, s) for h, s in zip(t[f"{measure}_hours"], t[f"{measure}_hours_std"])]
        cols["seeds reached" if measure == "deployed" else "seeds reached (full-width)"] = t[f"{measure}_reached"]
    table = pd.DataFrame({
        **cols, "run total (min)": [_minutes(h) for h in t["total_hours"]],
        "deployed best (final round)": ["–" if pd.isna(v) else f"{100 * v:.1f}" for v in t["deployed_final"]],
        "trainings (not applied)": [f"{_count(a)} ({_count(b)})" for a, b in zip(t["trainings"], t["not_applied"])]})
    head = ("Simulated minutes, mean ± std over the seeds that reached the target; trainings: clients' local "
            "trainings a run spent (mean over seeds), in brackets those whose update never reached the model.")
    if asynchronous:  # what an asynchronous run's rows are, and the columns that compare it with rounds
        table["rounds / steps"] = [_count(v) for v in t["steps"]]
        table["updates applied"] = [_count(v) for v in t["updates_applied"]]
        table["mean staleness"] = ["–" if pd.isna(v) else f"{v:.2f}" for v in t["staleness_mean"]]
        head += (" An async method's time is that of its server steps (a step every buffer's worth of arrivals);"
                 " updates applied: client updates that reached the model, mean over seeds.")
    parts = [head, "", markdown(table)]
    for policy, res in policies.items():
        by_rule: dict[str, list[str]] = {}  # a synchronous run's devices.policy / an async run's staleness bound
        for _, r in res.runs.iterrows():
            if is_async(r):
                rule = "bounded" if _config(r, "asynchronous.max_staleness") is not None else ""
            else:
                rule = "" if policy == "wait_all" else str(_config(r, "devices.policy", "deadline"))
            by_rule.setdefault(rule, []).append(r["run_id"])
        for title, ids in ((f"Share of client-rounds that missed the deadline ({policy}, %), per keep ratio:",
                            by_rule.get("deadline", [])),
                           (f"Share of client-rounds over-selected and left out, slower than the round's k fastest "
                            f"({policy}, %), per keep ratio:", by_rule.get("over_select", [])),
                           (f"Share of updates discarded as staler than asynchronous.max_staleness ({policy}, %), "
                            "per keep ratio:", by_rule.get("bounded", []))):
            if not ids:
                continue
            late = missed(runs.only_runs(res, ids))
            late[late.columns[1:]] = (100 * late[late.columns[1:]]).round(1)
            parts += ["", title, "", markdown(late)]
    return "\n".join(parts)


def sub_model_methods(res: Any) -> set[str]:
    """Methods marked as training sub-models, as Table 1's "sys. het." column marks them
    (:func:`analysis.comparison.sys_het`: the paper's mark for its rows, else some client of a run trained
    less than the full model, ``clients.capacity_used`` < 1)."""
    res = load_policy(res)
    narrow = comparison.trains_sub_models(runs.table(res, "clients"))
    names = row_names(runs.per_run(res))
    narrow = narrow[narrow.index.isin(list(names))]
    by_method = narrow.groupby(narrow.index.map(names)).any()
    return {m for m, n in by_method.items() if comparison.sys_het(str(m), bool(n))}


def _split_variant(name: str) -> tuple[str, str]:
    """A row name's method and async variant: ``"HeteroFL [async: buffer 2, ...]"`` -> ("HeteroFL", "async: ...")."""
    base, _, rest = name.partition(" [")
    return (base, rest[:-1]) if rest.endswith("]") else (name, "")


def plot_policies(policies: Mapping[str, Any], measure: str = "deployed", path: str | Path | None = None) -> Any:
    """Best-so-far accuracy against simulated minutes, one panel per policy, one line per method: solid for a
    method that trains sub-models (:func:`sub_model_methods`), dashed for the others, each group coloured
    from the ten-colour cycle, so a method has one look in every panel (its async variants too). A panel whose
    lines are all one async variant names it once, under its title, and its lines by method. A policy with more than
    :data:`PANEL_LINES` methods gets two panels, sub-models and full model (fourteen lines in one panel could
    not be told apart)."""
    cs = {p: curves(res, measure) for p, res in policies.items()}
    narrow = set().union(*(sub_model_methods(res) for res in policies.values()))
    methods = comparison.in_table1_order({m for c in cs.values() for m in c["method"]})
    # one look per method, its async variants included (the variant is in the name after " [")
    bases = list(dict.fromkeys(_split_variant(m)[0] for m in methods))
    narrow_bases = {_split_variant(m)[0] for m in narrow}
    groups = {True: [b for b in bases if b in narrow_bases], False: [b for b in bases if b not in narrow_bases]}
    look = {b: (plots.color(i, len(g)), "-" if sub else "--") for sub, g in groups.items() for i, b in enumerate(g)}
    panels = []
    for policy, c in cs.items():
        have = [m for m in methods if m in set(c["method"])]
        if len(have) <= PANEL_LINES:
            panels.append((policy, c, have))
        else:
            panels += [(f"{policy}: {name}", c, [m for m in have if (m in narrow) == sub])
                       for sub, name in ((True, "sub-models"), (False, "full model"))]
    fig, axes = plots.new_figure(len(panels), ncols=min(len(panels), PANEL_COLUMNS), panel=(5.0, 3.8))
    for ax, (title, c, have) in zip(axes, panels):
        variants = {_split_variant(m)[1] for m in have}
        shared = variants.pop() if len(variants) == 1 else ""  # one async variant: named once, in the title
        for m in have:
            g = c[c["method"] == m]
            color, line = look[_split_variant(m)[0]]
            # best so far holds from one evaluation to the next: steps, not a slope between them
            ax.plot(60 * g["hours"], 100 * g["accuracy"], label=_split_variant(m)[0] if shared else m, color=color,
                    linestyle=line, drawstyle="steps-post")
        ax.set_title(title + (f"\n{textwrap.fill(shared, 50)}" if shared else ""), fontsize=10)
        ax.set_xlabel("simulated device time (minutes)")
        ax.set_ylabel(f"best-so-far {'deployed' if measure == 'deployed' else 'full-width'} accuracy (%)")
        ax.grid(True, alpha=0.3)
        labels = [ln.get_label() for ln in ax.get_lines()]
        if max(map(len, labels), default=0) <= LEGEND_INSIDE:
            ax.legend(fontsize=8)
        else:  # several async variants' names: below the panel, wrapped, so they cover neither lines nor axis
            handles = ax.get_lines()
            ax.legend(handles, [textwrap.fill(h.get_label(), 60) for h in handles], fontsize=8, loc="upper left",
                      bbox_to_anchor=(0.0, -0.2))
    lows, highs = zip(*(ax.get_ylim() for ax in axes))
    right = max(ax.get_xlim()[1] for ax in axes)
    for ax in axes:  # one accuracy scale and one time axis from 0, so panels (a policy, the async mode) compare at a glance
        ax.set_ylim(min(lows), max(highs))
        ax.set_xlim(0, right)
    return plots.finish(fig, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m analysis.device_time POLICY=FOLDER ... [--deployed 0.8] [--full-width F] [--updates N] [--png PATH]``:
    the study's tables."""
    p = OneLineParser(prog="python -m analysis.device_time", description=main.__doc__)
    p.add_argument("folders", nargs="+", metavar="POLICY=FOLDER", help="a results folder per policy, e.g. "
                   "wait_all=runs/dt_wait deadline=runs/dt_deadline (asynchronous runs under a name of their own: "
                   "async=runs/async); several sweeps' folders of one policy separated by commas")
    p.add_argument("--deployed", type=float, default=0.8, help="deployed accuracy target, 0-1 (default 0.8)")
    p.add_argument("--full-width", type=float, default=None,
                   help="also the time to this full-width accuracy (the server's model), 0-1")
    p.add_argument("--png", default=None, help="also write the curves figure here")
    p.add_argument("--updates", type=int, default=None, help="read every run to its first N client updates by design "
                   "(a synchronous round applies k, an asynchronous step buffer_size): one training budget for all")
    args = p.parse_args(argv)
    bad = [f for f in args.folders if "=" not in f]
    if bad:
        p.error(f"invalid folder {bad[0]!r}: write POLICY=FOLDER, e.g. deadline=runs/dt_deadline")
    if not 0 < args.deployed <= 1:
        p.error(f"invalid --deployed={args.deployed}: a share of 1, above 0 and at most 1")
    if args.full_width is not None and not 0 < args.full_width <= 1:
        p.error(f"invalid --full-width={args.full_width}: a share of 1, above 0 and at most 1")
    prog = "analysis.device_time"
    # every folder opened once (one line and exit 2 for a missing, empty, foreign or damaged one); a policy's
    # several folders (commas) side by side
    given = dict(f.split("=", 1) for f in args.folders)
    if args.updates is not None and args.updates < 1:
        p.error(f"invalid --updates={args.updates}: a number of client updates, at least 1")
    try:
        loaded = {policy: concat([runs.open_or_exit(f, prog) for f in v.split(",")]) for policy, v in given.items()}
        if args.updates is not None:
            loaded = {policy: to_horizon(res, args.updates) for policy, res in loaded.items()}
    except ValueError as e:  # the folders of one policy share run ids; --updates shorter than a step
        p.error(str(e))
    try:
        policies, borrowed = in_time_as_wait_all(loaded)
        text = report(policies, deployed=args.deployed, full_width=args.full_width)
    except runs.MissingData as e:  # a results folder without what the study needs
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(text)
    if borrowed:
        print(f"\nwait_all also holds the runs of {', '.join(borrowed)} from the other policies: none of their clients "
              "ever missed the deadline, so they trained exactly as under wait_all.")
    if args.png:
        plot_policies(policies, "deployed", args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
