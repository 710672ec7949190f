"""Loading a sweep folder for analysis: runs labelled by variant and resolved options, per-run
accuracies, and mean ± std over seeds.

A study script writes run ids ``<variant>-s<seed>`` (sweeps/trials.py); :func:`load_sweep` adds
that ``variant`` label and every algorithm option, *resolved* against the strategy's defaults
(``opt_<name>`` columns), to the ``runs`` table, so tables select runs by what they ran
(:func:`select_runs`), not by their names.

Accuracies follow papers/000 Table 1 (after DapperFL): "best" is the best-so-far accuracy of
the ``__global__`` row (the unweighted mean of the domain accuracies at one round), "final" the
last evaluated round, both read from the run's primary eval mode, the mode of its earliest
evaluated global row (``group`` for FedSAP, ``global`` otherwise; rounds that
``training.eval_every`` skipped carry no mode and are never the primary). Every number comes from the Parquet rows.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from fedsap_ray import results

GLOBAL = results.GLOBAL_DOMAIN
DEPLOYED = "deployed"  # the eval mode of each client's own model (docs/readings.md#deployed-evaluation)
TABLES = ("runs", "rounds", "clients", "layers", "allocations")
RUN_COLUMNS = ("variant", "seed", "algorithm", "study", "dataset")  # what join_runs adds by default
OPT = "opt_"  # prefix of the resolved-option columns of runs
_SEED_SUFFIX = re.compile(r"-s\d+$")


class MissingData(ValueError):
    """The folder lacks what a table or figure needs (e.g. no allocations rows); notebooks skip it."""


# ----------------------------------------------------------------------------- loading

def variant_label(run_id: str) -> str:
    """``full-s2`` -> ``full``: the study script's variant name (a display label only)."""
    return _SEED_SUFFIX.sub("", str(run_id))


@cache
def _resolved(name: str, options_json: str) -> tuple[tuple[str, Any], ...]:
    from fedsap_ray.algorithms.registry import parse_options
    from fedsap_ray.config import ConfigError

    options = json.loads(options_json)
    try:
        return tuple(dataclasses.asdict(parse_options(name, options)).items())
    except ConfigError:  # an option (or algorithm) this version does not accept: keep what was stored
        pass
    try:
        defaults = dataclasses.asdict(parse_options(name, {}))
    except ConfigError:
        defaults = {}
    return tuple({**defaults, **options}.items())


def resolved_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every option of algorithm ``name`` as the run used it: ``options`` over the strategy's defaults
    (the stored config holds only what the user and the preset set)."""
    return dict(_resolved(name, json.dumps(dict(options or {}), sort_keys=True)))


def annotate_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` plus ``variant`` (run id without ``-s<seed>``) and one ``opt_<name>`` column per
    resolved algorithm option (NaN where a run's algorithm has no such option)."""
    runs = runs.copy()
    runs["variant"] = [variant_label(r) for r in runs["run_id"]]
    opts = []
    for cfg in runs.get("config_json", pd.Series([None] * len(runs), index=runs.index)):
        algo = json.loads(cfg).get("algorithm", {}) if isinstance(cfg, str) and cfg else {}
        opts.append(resolved_options(algo["name"], algo.get("options")) if "name" in algo else {})
    resolved = pd.DataFrame(opts, index=runs.index, dtype=object)
    for name in resolved.columns:
        runs[OPT + name] = resolved[name]
    return runs


def config_label(run: Mapping[str, Any]) -> str:
    """A label from a run's config alone: the algorithm and the options it set away from the strategy's
    defaults, e.g. ``fedavg (width=capacity)``; ``run`` is a row of :func:`annotate_runs`'s table."""
    name = run.get("algorithm")
    changed = [f"{k}={run[OPT + k]}" for k, v in resolved_options(name).items()
               if OPT + k in run and not same_value(run[OPT + k], v)]
    return f"{name} ({', '.join(changed)})" if changed else str(name)


# Config keys that never change what a run computes (where it ran, its labels, the file paths), and the
# seed, which a table averages over: runs that differ in anything else must not share a table row.
NOT_PROTOCOL = ("seed", "study", "preset", "resources", "data.root", "data.download")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and k != "options":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def protocol(config_json: Any, algorithm: bool = True) -> dict[str, Any]:
    """A run's resolved configuration as flat ``section.field`` keys, without :data:`NOT_PROTOCOL`; the
    algorithm's options are resolved against the strategy's defaults (``algorithm.options.<name>``).
    ``algorithm=False`` leaves the whole algorithm section out (to pair runs of different strategies)."""
    cfg = json.loads(config_json) if isinstance(config_json, str) and config_json else {}
    cfg = dict(cfg) if isinstance(cfg, Mapping) else {}
    algo = cfg.pop("algorithm", None) or {}
    flat = {k: v for k, v in _flatten(cfg).items()
            if not any(k == n or k.startswith(n + ".") for n in NOT_PROTOCOL)}
    if algorithm and "name" in algo:
        flat["algorithm.name"] = algo["name"]
        for k, v in resolved_options(algo["name"], algo.get("options")).items():
            flat[f"algorithm.options.{k}"] = v
    return flat


def differing_keys(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The keys on which some of ``configs`` (e.g. :func:`protocol` dicts) disagree, sorted."""
    keys = sorted(set().union(*configs)) if configs else []
    return [k for k in keys if any(not _same_json(c.get(k), configs[0].get(k)) for c in configs[1:])]


def _same_json(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return same_value(a, b)


def split_configs(df: pd.DataFrame, by: Sequence[str], column: str = "config_json",
                  algorithm: bool = True) -> tuple[pd.Series, dict[tuple, list[str]]]:
    """A ``config`` label per row of ``df`` for grouping tables, so no group pools runs whose resolved
    configurations differ beyond the seed (issue 14): within each ``by`` group whose runs differ, the
    label lists the differing keys' values (e.g. ``model.width_mult=0.5, training.rounds=30``); "" where
    the group is uniform. Also returns {group: differing keys} for the warnings."""
    labels = pd.Series("", index=df.index, dtype=object)
    mixed: dict[tuple, list[str]] = {}
    if column not in df.columns or df.empty:
        return labels, mixed
    protos = {i: protocol(c, algorithm) for i, c in df[column].items()}
    for key, part in df.groupby(list(by), sort=False, dropna=False):
        diff = differing_keys([protos[i] for i in part.index])
        if diff:
            key = key if isinstance(key, tuple) else (key,)
            mixed[key] = diff
            for i in part.index:
                labels[i] = ", ".join(f"{k}={json.dumps(protos[i].get(k), default=str)}" for k in diff)
    return labels, mixed


def mixed_warning(mixed: Mapping[tuple, Sequence[str]], what: str = "runs") -> str:
    """One line naming the groups whose runs differ beyond the seed and the keys they differ in."""
    parts = [f"{' / '.join(str(k) for k in key)}: {', '.join(keys)}" for key, keys in mixed.items()]
    return (f"{what} of one group differ beyond the seed (split into one row per configuration, column "
            f"'config'): " + "; ".join(parts))


def _replace_tables(res: Any, **tables: pd.DataFrame) -> Any:
    if dataclasses.is_dataclass(res):
        return dataclasses.replace(res, **tables)
    return SimpleNamespace(**{**vars(res), **tables})


def locate(path: str | os.PathLike) -> str | os.PathLike:
    """``path`` as given if it exists (or is a URI); a relative path that does not exist here but does
    under the repository root (where the study scripts write ``runs/<study>``) is taken from there,
    so a notebook opened in analysis/notebooks/ finds ``runs/<study>``."""
    text = os.fspath(path)
    if "://" in text or os.path.isabs(text) or os.path.exists(text):
        return path
    root = Path(__file__).resolve().parents[1] / text
    return str(root) if root.exists() else path


def table(res: Any, name: str) -> pd.DataFrame:
    """Table ``name`` of a Results-like object; a missing one is an empty frame with the schema's columns."""
    if name not in TABLES:
        raise ValueError(f"table={name!r}: allowed values are {', '.join(TABLES)}")
    df = getattr(res, name, None)
    if df is None or (df.empty and len(df.columns) == 0):
        return results.schema(name).empty_table().to_pandas()
    return df


def load_sweep(path: str | os.PathLike | Any, study: str | None = None) -> Any:
    """A results folder (``fedsap_ray.results.load``) with annotated runs (:func:`annotate_runs`).

    ``path`` may also be an already loaded Results-like object. ``study`` keeps only the runs whose
    ``runs.study`` is that name (for folders holding several studies)."""
    res = path if hasattr(path, "runs") else results.load(path)
    if "variant" in res.runs.columns:
        return _study(res, study)
    return _study(_replace_tables(res, runs=annotate_runs(table(res, "runs"))), study)


def _study(res: Any, study: str | None) -> Any:
    if study is None:
        return res
    runs = res.runs[res.runs["study"] == study]
    keep = set(runs["run_id"])
    others = {t: table(res, t) for t in TABLES[1:]}
    return _replace_tables(res, runs=runs, **{t: df[df["run_id"].isin(keep)] for t, df in others.items()})


def join_runs(df: pd.DataFrame, runs: pd.DataFrame, cols: Sequence[str] = RUN_COLUMNS) -> pd.DataFrame:
    """``df`` (rounds, clients, layers or allocations rows) with the runs' ``cols`` joined on run_id."""
    cols = [c for c in cols if c in runs.columns and c not in df.columns]
    return df.merge(runs[["run_id", *cols]], on="run_id", how="left")


def joined(res: Any, name: str, cols: Sequence[str] = RUN_COLUMNS) -> pd.DataFrame:
    """Table ``name`` of a sweep with the runs' ``cols`` (variant, seed, ...) joined on."""
    res = load_sweep(res)
    return join_runs(table(res, name), res.runs, cols)


# ----------------------------------------------------------------------------- accuracy

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


def per_run_accuracy(res: Any) -> pd.DataFrame:
    """One row per run: run id, variant, seed, status, ... and best / final global accuracy (NaN for a
    run with no evaluated round yet)."""
    res = load_sweep(res)
    runs = res.runs
    keep = [c for c in ("run_id", "variant", "seed", "study", "algorithm", "dataset", "status", "rounds_done")
            if c in runs.columns]
    return runs[keep].set_index("run_id").join(global_accuracy(table(res, "rounds"))).reset_index()


def mean_std(df: pd.DataFrame, by: str | Sequence[str], cols: Sequence[str] | Mapping[str, str],
             seed: str = "seed") -> pd.DataFrame:
    """Mean and sample std (NaN for one seed) over the rows of each ``by`` group: columns ``by``,
    ``seeds`` (distinct values of ``seed``, or rows when there is no such column), ``<name>_mean``,
    ``<name>_std``. ``cols`` is a list of columns or a mapping output name -> column. Groups keep
    their first-appearance order."""
    by = [by] if isinstance(by, str) else list(by)
    cols = dict(cols) if isinstance(cols, Mapping) else {c: c for c in cols}
    named: dict[str, tuple[str, Any]] = {"seeds": (seed, "nunique") if seed in df.columns else (by[0], "size")}
    for name, c in cols.items():
        named[f"{name}_mean"] = (c, "mean")
        named[f"{name}_std"] = (c, "std")
    if df.empty:
        return pd.DataFrame(columns=[*by, *named])
    num = df.assign(**{c: pd.to_numeric(df[c], errors="coerce") for c in set(cols.values())})
    return num.groupby(by, sort=False, dropna=False).agg(**named).reset_index()


# ----------------------------------------------------------------------------- selecting runs by config

def _null(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def same_value(a: Any, b: Any) -> bool:
    """Option equality: numbers (bools included) up to rounding, everything else by ==, null == null."""
    if _null(a) or _null(b):
        return _null(a) and _null(b)
    if isinstance(a, (int, float, np.number)) and isinstance(b, (int, float, np.number)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return bool(a == b)


def select_runs(runs: pd.DataFrame, algorithm: str, vary: Iterable[str] = ()) -> pd.DataFrame:
    """The runs of ``algorithm`` that change at most the options ``vary`` from the strategy's defaults.

    Options on which every run of ``algorithm`` in the folder agrees are the study's protocol
    (e.g. a preset's warm-up) and are not compared; any other option must be at its default, so a
    run that changes something else (e.g. ``dga_layer`` in a Table 2 run) belongs to another table.
    """
    runs = runs if "variant" in runs.columns else annotate_runs(runs)
    cand = runs[runs["algorithm"] == algorithm]
    if cand.empty:
        return cand
    defaults = resolved_options(algorithm)
    unknown = sorted(set(vary) - set(defaults))
    if unknown:
        raise ValueError(f"vary={unknown}: not options of algorithm {algorithm!r}; allowed: {', '.join(defaults)}")
    ok = pd.Series(True, index=cand.index)
    for name, default in defaults.items():
        col = OPT + name
        if name in vary or col not in cand.columns:
            continue
        values = cand[col].tolist()
        if all(same_value(v, values[0]) for v in values):
            continue  # the protocol: shared by every run of this algorithm
        ok &= cand[col].map(lambda v, d=default: same_value(v, d))
    return cand[ok]


def option_table(res: Any, algorithm: str, rows: Sequence[tuple[str, Mapping[str, Any]]], *,
                 domains: bool = False, grouping: bool = False, finished_only: bool = True) -> pd.DataFrame:
    """Mean ± std over seeds of best / final global accuracy for each ``(label, options)`` row: the
    runs of ``algorithm`` (see :func:`select_runs`) whose resolved options equal ``options``. A run can
    fall in several rows (a one-factor study's reference run). Rows without runs are left out.

    Columns: ``row``, ``variants`` (the run ids' variant names), ``seeds``, ``best_mean``/``_std``,
    ``final_mean``/``_std``; ``domains`` adds ``<domain>_mean``/``_std`` (best-so-far per domain),
    ``grouping`` adds the DGA means/stds of ``n_groups``, ``ari_domain``, ``ari_capacity``. Every table
    also has :data:`DEVICE_COLUMNS` (NaN where the runs did not record them): the deployed models' best
    and final accuracy, the worst client, and the training GMACs per client-round.
    Runs of one row whose protocols (:func:`protocol` without the algorithm) differ beyond the seed
    are split into rows ``<label> [<differing keys>]`` with a :class:`UserWarning`.
    """
    res = load_sweep(res)
    vary = sorted({k for _, opts in rows for k in opts})
    runs = select_runs(res.runs, algorithm, vary)
    if finished_only and "status" in runs.columns:
        runs = runs[runs["status"] == "finished"]
    rounds = table(res, "rounds")
    pr = runs[["run_id", "variant", "seed"]].set_index("run_id").join(global_accuracy(rounds))
    cols: dict[str, str] = {"best": "best_global_accuracy", "final": "final_global_accuracy"}
    if domains:
        best = domain_best(rounds).drop(columns="global", errors="ignore")
        pr = pr.join(best)
        cols.update({d: d for d in best.columns})
    if grouping:
        pr = pr.join(grouping_stats(rounds))
        cols.update({c: c for c in ("n_groups", "ari_domain", "ari_capacity")})
    # what each client really ran and spent (issue 13): the deployed models' accuracy and the training compute
    pr = pr.join(deployed_accuracy(rounds)).join(train_compute(table(res, "clients")))
    cols.update({c: c for c in DEVICE_COLUMNS})
    for c in cols.values():
        if c not in pr.columns:
            pr[c] = np.nan
    parts = []
    for label, opts in rows:
        match = pd.Series(True, index=runs.index)
        for k, v in opts.items():
            match &= runs[OPT + k].map(lambda x, v=v: same_value(x, v)) if OPT + k in runs.columns else False
        ids = runs.loc[match, "run_id"]
        if len(ids):
            parts.append(pr.loc[ids].assign(row=label).reset_index())
    if not parts:
        return pd.DataFrame(columns=["row", "variants", *mean_std(pd.DataFrame(), ["row"], cols).columns[1:]])
    long = pd.concat(parts, ignore_index=True)
    if "config_json" in runs.columns:  # never pool runs whose protocols differ beyond the seed (issue 14)
        long = long.merge(runs[["run_id", "config_json"]], on="run_id", how="left")
        labels, mixed = split_configs(long, ["row"], algorithm=False)
        if mixed:
            warnings.warn(mixed_warning(mixed), UserWarning, stacklevel=2)
            long["row"] = [f"{r} [{c}]" if c else r for r, c in zip(long["row"], labels)]
    out = mean_std(long, "row", cols)
    names = long.groupby("row", sort=False)["variant"].agg(lambda s: ", ".join(dict.fromkeys(s)))
    out.insert(1, "variants", out["row"].map(names))
    return out


# ----------------------------------------------------------------------------- display

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


def drop_unrecorded(df: pd.DataFrame, cols: Sequence[str] = DEVICE_COLUMNS) -> pd.DataFrame:
    """``df`` without those of ``cols`` that no row has a value in (runs written before the deployed
    evaluation and ``train_macs`` existed), so a report does not print columns of dashes."""
    empty = [c for c in cols if c in df.columns and df[c].replace("–", np.nan).isna().all()]
    return df.drop(columns=empty)


def to_markdown(df: pd.DataFrame, index: bool = False) -> str:
    """A README-ready markdown table of a display frame (e.g. :func:`pm_table`'s), without tabulate;
    missing values print as "–"."""
    d = df.reset_index() if index else df

    def cell(v: Any) -> str:
        return "–" if not isinstance(v, str) and pd.isna(v) else str(v)
    lines = ["| " + " | ".join(str(c) for c in d.columns) + " |", "|" + " --- |" * len(d.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in d.itertuples(index=False)]
    return "\n".join(lines)


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
