"""What client-level DP costs each capacity tier (issue 57, item 4; sweeps/privacy.py, docs/studies/privacy.md).

Per run (:func:`run_table`, from the tables): the final global (server) accuracy overall and per test domain (the
run's primary eval mode: ``global``, FedSAP's ``group``) and
the final deployed accuracy (the ``rounds`` rows of the last round); the mean over rounds of ``rounds.dp_snr_shared``
and ``dp_snr_partial``; the noise multiplier the run's epsilon calibrated, ``dp_noise_std / dp_clip_norm`` (the sum's
std is sigma x C; the study sets no ``noise_cohort_size``); the share of its clients' updates that were clipped
(``clients.dp_clipped``); its wall time (``runs.wall_s``).

Per capacity tier (:func:`deployed_figures`, from the kept final models): the rounds table has deployed rows per
domain only, so each client of the run's deployed sample (``training.eval_clients``) has its deployed model
rebuilt from ``OUT/models/<run>/final.*`` (:func:`fedsap_ray.results.kept.deployed_parts`, the function
``fedsap-ray evaluate --client`` uses: its sub-model, sliced as the run ran it, BN per ``training.deployed_bn``)
and evaluated on every test domain with the run's functions (on its home domain that is the figure the run's
deployed evaluation averaged into its per-domain rows: a check of the rebuild). A tier's figure on a test domain is
the mean over the run's sampled clients of that capacity; its overall figure the unweighted mean over the test
domains (the global accuracy's rule), so it does not depend on which home domains the tier's sampled clients hold.
Every table is then mean ± std over the seeds.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import sweep
from analysis.runs import open_or_exit
from analysis.plots import color, finish, new_figure

METHODS = {"fedavg": "FedAvg", "heterofl": "HeteroFL", "fjord": "FjORD", "fedsap": "FedSAP"}
GLOBAL = "__global__"
EPS_ORDER = (math.inf, 8.0, 2.0)  # the figure's x axis: no privacy, then ever less budget
RUN_FIGURES = ("global", "deployed", "snr_shared", "snr_partial", "sigma", "clipped", "wall_s")
_SEED = re.compile(r"-s\d+$")  # sweeps/trials.py names a run <variant>-s<seed>
NOT_PERCENT = ("snr_shared", "snr_partial", "sigma", "wall_s", "seeds", "clients")


# ----------------------------------------------------------------------------------------------- per run
def settings(runs: pd.DataFrame) -> pd.DataFrame:
    """run_id, variant, seed, method, epsilon (inf: privacy off), denominator ('' when off), from each run's
    stored config (``config_json``), not from its name."""
    rows = []
    for _, r in runs.iterrows():
        cfg = json.loads(r["config_json"])
        p = cfg.get("privacy") or {}
        private = p.get("mode", "off") != "off"
        eps = float(p["target_epsilon"]) if private and p.get("target_epsilon") is not None else math.inf
        rows.append({"run_id": r["run_id"], "variant": _SEED.sub("", str(r["run_id"])), "seed": int(r["seed"]),
                     "method": cfg["algorithm"]["name"], "epsilon": eps,
                     "denominator": p.get("denominator", "cohort") if private else ""})
    return pd.DataFrame(rows, columns=["run_id", "variant", "seed", "method", "epsilon", "denominator"])


def run_table(res: Any) -> pd.DataFrame:
    """One row per run: :func:`settings` and the per-run figures of the module docstring (fractions; the global
    accuracy per domain as ``global_<domain>``)."""
    runs, rounds, clients = sweep.table(res, "runs"), sweep.table(res, "rounds"), sweep.table(res, "clients")
    out = settings(runs)
    if out.empty:
        return out
    last = rounds.groupby("run_id")["round"].transform("max") == rounds["round"]
    final = rounds[last]
    prim = sweep.primary_rounds(rounds)  # the server model's eval mode: global, FedSAP's group
    prim = prim[prim.groupby("run_id")["round"].transform("max") == prim["round"]]
    g = prim.pivot_table(index="run_id", columns="domain", values="acc")
    d = final[final["eval_mode"] == "deployed"].pivot_table(index="run_id", columns="domain", values="accuracy")
    per_round = rounds.drop_duplicates(["run_id", "round"]).groupby("run_id")
    snr = per_round[["dp_snr_shared", "dp_snr_partial"]].mean()
    sigma = per_round.apply(lambda t: (t["dp_noise_std"] / t["dp_clip_norm"]).mean(), include_groups=False)
    clipped = clients.groupby("run_id")["dp_clipped"].apply(lambda s: s.astype(float).mean() if s.notna().any()
                                                            else np.nan)
    out = out.set_index("run_id")
    out["global"] = g.get(GLOBAL)
    for dom in [c for c in g.columns if c != GLOBAL]:
        out[f"global_{dom}"] = g[dom]
    out["deployed"] = d.get(GLOBAL)
    for dom in [c for c in d.columns if c != GLOBAL]:
        out[f"deployed_{dom}"] = d[dom]
    out["snr_shared"], out["snr_partial"] = snr["dp_snr_shared"], snr["dp_snr_partial"]
    out["sigma"], out["clipped"] = sigma, clipped
    out["wall_s"] = runs.set_index("run_id")["wall_s"]
    return out.reset_index()


def variant_table(per_run: pd.DataFrame, figures: Sequence[str] | None = None) -> pd.DataFrame:
    """Mean and std over seeds per variant of ``figures`` (default: every per-run figure but the settings)."""
    keys = ["method", "epsilon", "denominator", "variant"]
    cols = list(figures) if figures is not None else [c for c in per_run.columns
                                                      if c not in (*keys, "run_id", "seed")]
    return sweep.mean_std(per_run, keys, cols)


# ---------------------------------------------------------------------------------------- per capacity tier
def deployed_figures(out: str | Path, run_ids: Sequence[str]) -> pd.DataFrame:
    """One row per (run, client of its deployed sample, test domain): run_id, client, tier (the client's capacity),
    home (its own domain), domain (the test domain), accuracy of its deployed model on that domain's test set
    (module docstring; on its home domain, the figure the run's deployed evaluation recorded). Needs each run's
    kept final model (``training.keep_model=final``); builds each run's federation once."""
    import torch

    from fedsap_ray.data import build_federation
    from fedsap_ray.engine.evaluate import client_figures, evaluate_by_class
    from fedsap_ray.results import kept

    rows = []
    for run_id in run_ids:
        k = kept.read_kept(out, run_id, "final", deployed=True)
        assert k.deployed is not None
        cfg = kept.stored_config(k, f"{kept.FOLDER}/{run_id}/final.json")
        fed = build_federation(cfg)
        spec = {c.client_id: c for c in fed.clients}
        weighted = bool(k.deployed.get("label_weighted"))
        with kept.torch_threads(cfg.resources.torch_threads):
            for entry in k.deployed["clients"]:
                cid = int(entry["client"])
                parts = kept.deployed_parts(k, cid, sliced=cfg.training.submodel == "sliced", federation=fed)
                home = str(entry["domain"])
                for dom, data in fed.test.items():
                    table = evaluate_by_class(parts.net, parts.layout, parts.vec, data, torch.device("cpu"),
                                              fed.num_classes)
                    acc, _ = client_figures(table, spec[cid].label_counts if weighted and dom == home else None)
                    rows.append({"run_id": run_id, "client": cid, "tier": float(spec[cid].capacity), "home": home,
                                 "domain": dom, "accuracy": acc})
    return pd.DataFrame(rows, columns=["run_id", "client", "tier", "home", "domain", "accuracy"])


def tier_table(per_client: pd.DataFrame, per_run: pd.DataFrame, by_domain: bool = False) -> pd.DataFrame:
    """Deployed accuracy per variant and tier: per run, the tier's sampled clients' models on each test domain
    (mean over those clients), then the unweighted mean over the test domains (as the global accuracy is), so a
    tier's figure does not depend on which home domains its sampled clients happen to hold; with ``by_domain``,
    per test domain instead. Then mean ± std over seeds; ``clients``: the tier's sampled clients, summed over
    seeds."""
    runs = per_run[["run_id", "variant", "seed", "method", "epsilon", "denominator"]]
    dom = per_client.groupby(["run_id", "tier", "domain"]).agg(accuracy=("accuracy", "mean"),
                                                               clients=("client", "nunique")).reset_index()
    keys = ["tier", "domain"] if by_domain else ["tier"]
    one = dom if by_domain else dom.groupby(["run_id", "tier"]).agg(accuracy=("accuracy", "mean"),
                                                                     clients=("clients", "first")).reset_index()
    one = one.merge(runs, on="run_id")
    t = sweep.mean_std(one, ["method", "epsilon", "denominator", "variant", *keys], ["accuracy"])
    n = one.groupby(["variant", *keys])["clients"].sum().rename("clients").reset_index()
    return t.merge(n, on=["variant", *keys]).sort_values(["method", "denominator", "epsilon", *keys],
                                                          ascending=[True, True, False, *[True] * len(keys)],
                                                          kind="stable").reset_index(drop=True)


def tier_gaps(tiers: pd.DataFrame) -> pd.DataFrame:
    """Per private variant and tier: its deployed accuracy's drop from the same method's epsilon = infinity at that
    tier (points, mean over seeds), and the drop's std (the two variants' seed stds combined)."""
    base = tiers[np.isinf(tiers["epsilon"])].set_index(["method", "tier"])
    rows = []
    for _, r in tiers[~np.isinf(tiers["epsilon"])].iterrows():
        b = base.loc[(r["method"], r["tier"])]
        rows.append({"method": r["method"], "epsilon": r["epsilon"], "denominator": r["denominator"], "tier": r["tier"],
                     "drop_mean": b["accuracy_mean"] - r["accuracy_mean"],
                     "drop_std": math.sqrt(np.nan_to_num(b["accuracy_std"]) ** 2 + np.nan_to_num(r["accuracy_std"]) ** 2)})
    return pd.DataFrame(rows, columns=["method", "epsilon", "denominator", "tier", "drop_mean", "drop_std"])


# ------------------------------------------------------------------------------------------------ figure
def eps_label(eps: float) -> str:
    return "∞" if math.isinf(eps) else f"{eps:g}"


def plot_tiers(tiers: pd.DataFrame, path: str | Path | None = None) -> Any:
    """Deployed accuracy (%) against epsilon (infinity, 8, 2: evenly spaced), one panel per method that ran under
    privacy, one line per capacity tier (solid: denominator cohort, dashed: coverage; both start from the
    method's non-private point), ± std over seeds."""
    methods = [m for m in METHODS if m in set(tiers.loc[~np.isinf(tiers["epsilon"]), "method"])]
    if not methods:
        raise sweep.MissingData("no private runs")
    fig, axes = new_figure(len(methods))
    levels = sorted(tiers["tier"].unique(), reverse=True)
    xs = {e: i for i, e in enumerate(EPS_ORDER)}
    for ax, m in zip(axes, methods):
        part = tiers[tiers["method"] == m]
        for i, tier in enumerate(levels):
            t = part[part["tier"] == tier]
            for den, style in (("cohort", "-"), ("coverage", "--")):
                rows = t[np.isinf(t["epsilon"]) | (t["denominator"] == den)]
                rows = rows[rows["epsilon"].isin(xs)].assign(x=lambda f: f["epsilon"].map(xs)).sort_values("x")
                if rows.empty:
                    continue
                ax.errorbar(rows["x"] + (0.04 if den == "coverage" else -0.04), 100 * rows["accuracy_mean"],
                            yerr=100 * rows["accuracy_std"].fillna(0.0), fmt="o" + style, ms=3, capsize=2, lw=1.2,
                            color=color(i, len(levels)), label=f"keep {tier:g}" if den == "cohort" else None)
        ax.set_xticks(list(xs.values()), [f"ε={eps_label(e)}" for e in EPS_ORDER])
        ax.set(ylabel="deployed accuracy (%)", title=f"{METHODS[m]} (solid: cohort, dashed: coverage)")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best", title="capacity tier", title_fontsize=7)
    return finish(fig, path)


# ------------------------------------------------------------------------------------------------ report
def display(table: pd.DataFrame) -> pd.DataFrame:
    """A display copy: epsilon as text, accuracies and the clipped share in percent, the rest with two decimals."""
    shown = sweep.pm_table(table, not_percent=NOT_PERCENT)
    if "epsilon" in shown.columns:
        shown["epsilon"] = [eps_label(e) for e in table["epsilon"]]
    if "denominator" in shown.columns:
        shown["denominator"] = [d or sweep.MISSING for d in table["denominator"]]
    if "tier" in shown.columns:
        shown["tier"] = [f"{t:g}" for t in table["tier"]]
    return shown.drop(columns=[c for c in ("variant",) if c in shown.columns])


def _pm(mean: float, std: float) -> str:
    return f"{100 * mean:.1f}" + ("" if pd.isna(std) else f" ± {100 * std:.1f}")


def tables(out: str | Path) -> dict[str, pd.DataFrame]:
    """Every table of the study from a results folder (evaluates the kept deployed models: a second or two a run)."""
    res = sweep.load_sweep(out)
    per_run = run_table(res)
    per_client = deployed_figures(out, list(per_run["run_id"]))
    return {"runs": per_run, "variants": variant_table(per_run), "clients": per_client,
            "tiers": tier_table(per_client, per_run), "tier_domains": tier_table(per_client, per_run, by_domain=True)}


def _wide(table: pd.DataFrame, column: str, value: str, label: Any = str) -> pd.DataFrame:
    """``table``'s ``value`` (mean ± std, %) with one column per value of ``column``, rows the rest of its keys."""
    keys = [k for k in ("method", "epsilon", "denominator", "tier") if k in table.columns and k != column]
    if table.empty:
        return pd.DataFrame({"(none)": []})
    rows = []
    for key, part in table.groupby(keys, sort=False):
        cells = {label(r[column]): _pm(r[f"{value}_mean"], r[f"{value}_std"]) for _, r in part.iterrows()}
        row = dict(zip(keys, key))
        row["epsilon"] = eps_label(float(row["epsilon"]))
        row["denominator"] = row["denominator"] or sweep.MISSING
        if "tier" in row:
            row["tier"] = f"{row['tier']:g}"
        rows.append({**row, **cells})
    return pd.DataFrame(rows)


def report(out: str | Path, t: dict[str, pd.DataFrame] | None = None) -> str:
    """The study's tables as markdown, mean ± std over seeds: per variant (global and deployed accuracy, SNR,
    sigma, clipped share, wall time), global and deployed accuracy per test domain, deployed accuracy per tier,
    each tier's drop from epsilon infinity, and deployed accuracy per tier and home domain."""
    t = t if t is not None else tables(out)
    if t["runs"].empty:
        return f"No privacy-study runs in {out}."
    v = t["variants"]
    main = ["method", "epsilon", "denominator", "seeds", "global_mean", "global_std", "deployed_mean", "deployed_std",
            "snr_shared_mean", "snr_shared_std", "snr_partial_mean", "snr_partial_std", "sigma_mean", "sigma_std",
            "clipped_mean", "clipped_std", "wall_s_mean", "wall_s_std"]
    doms = [c[:-5] for c in v.columns if c.endswith("_mean") and c.startswith(("global_", "deployed_"))]
    per_dom = display(v[["method", "epsilon", "denominator", *[c for d in doms for c in (d + "_mean", d + "_std")]]])
    tiers = t["tiers"].sort_values("tier", ascending=False, kind="stable")
    gaps = tier_gaps(t["tiers"]).rename(columns={"drop_mean": "accuracy_mean", "drop_std": "accuracy_std"})
    by_dom = t["tier_domains"].sort_values("tier", ascending=False, kind="stable")
    keep = lambda tier: f"keep {tier:g}"  # noqa: E731
    return "\n\n".join([
        "Per variant (final round; accuracies and clipped share %, SNR (mean over rounds) and sigma as numbers)\n"
        + sweep.markdown(display(v[main])),
        "Final accuracy per test domain (%): global (server) model and deployed models\n" + sweep.markdown(per_dom),
        "Deployed model per capacity tier: mean over the four test domains (%)\n" + sweep.markdown(_wide(tiers, "tier", "accuracy", keep)),
        "Drop from epsilon = infinity per tier (points; ± the two variants' seed stds combined)\n"
        + sweep.markdown(_wide(gaps.sort_values("tier", ascending=False, kind="stable"), "tier", "accuracy", keep)),
        "Deployed model per tier and test domain (%)\n" + sweep.markdown(_wide(by_dom, "domain", "accuracy")),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.privacy", description=__doc__.splitlines()[0])
    p.add_argument("out", help="the study's results folder (sweeps/privacy.py --out)")
    p.add_argument("--png", default=None, help="write the figure (deployed accuracy against epsilon per tier) here")
    p.add_argument("--csv", default=None, help="write the per-run and per-client tables as CSV files with this prefix")
    args = p.parse_args(argv)
    open_or_exit(args.out, p.prog)  # a folder it cannot read: one line, exit 2 (as every analysis command line)
    t = tables(args.out)
    print(report(args.out, t))
    if args.png:
        plot_tiers(t["tiers"], args.png)
    if args.csv:
        for name in ("runs", "clients"):
            t[name].to_csv(f"{args.csv}{name}.csv", index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
