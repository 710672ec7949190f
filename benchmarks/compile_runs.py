#!/usr/bin/env python
"""Whole runs with ``resources.compile`` (issue 56): what compiling the clients' steps saves a real run, from a
cold and a warm Inductor cache, and how far its figures move from the eager run's.

    python benchmarks/compile_runs.py runs --preset laptop --set algorithm.name=fedavg      # 25 rounds, ~10 min
    python benchmarks/compile_runs.py trials --trials 13 --preset smoke --set algorithm.name=fedavg
    fedsap-ray run --out runs/default --run-id default && python benchmarks/compile_runs.py buckets --results runs/default

``runs``: the same config as separate processes (``fedsap-ray run``), one after the other: ``eager``
(``resources.compile=off``), ``cold`` (``train``, a fresh Inductor cache folder), ``warm`` (``train`` again
on that folder: what every later process of the node pays) and ``warm_eval`` (``train+eval`` on it; its
evaluation shapes are cold); ``--control`` adds ``eager_2_threads`` (eager with ``resources.torch_threads=2``:
the float reordering the project already accepts, against which the compiled runs' differences are read;
``--skip`` leaves out variants already in ``--dir``). Each line: the run's summed ``train_s`` / ``eval_s`` / ``round_wall_s``, the
process's wall seconds, the first round's ``train_s`` (where the compiles land) and the rest's, the
``clients.compile`` outcomes and ``rounds.eval_compiles``; then every variant's ratio to ``eager`` and its
largest per-round difference from ``eager`` in each figure (accuracy, loss, training loss), with the round it
occurred in. Every process starts fresh (Dynamo keeps nothing in memory between them), as a sweep's trials do.

``buckets``: reads a finished FedSAP run's ``layers`` table (``--results DIR``, ``--run-id``) and counts the
distinct trained shapes (each client's active channels per layer, Global + Private) as they are and with every
layer's count rounded up to a bucket of 1/8, 1/4 and 1/2 of its width (padding channels that would stay zero),
with the padded compute against the exact one (a proxy: the sum over consecutive layers of the products of
their channel counts, the convolution weights' sizes; spatial sizes are the same across clients). No training.

``trials``: ``--trials`` processes of one config with ``train`` on one fresh cache folder (the first cold,
the rest warm), as the trials of a sweep on one node, and one ``eager`` process: each trial's first-round
``train_s`` against the eager one's says what a trial pays for its compiles.

Run on a quiet machine (2 cores here: anything else running moves the ratios); one JSON line per process
on stdout, a summary line at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

FIGURES = ("accuracy", "loss", "global_accuracy", "train_loss")


def run_once(out: Path, run_id: str, preset: str, sets: list[str], mode: str, cache: Path) -> dict[str, Any]:
    """One ``fedsap-ray run`` in its own process on Inductor cache ``cache``; its timings and compile counts."""
    cmd = [sys.executable, "-m", "fedsap_ray", "run", "--preset", preset, "--out", str(out), "--run-id", run_id,
           "--quiet", "--set", f"resources.compile={mode}", *(x for s in sets for x in ("--set", s))]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    return read_run(out, run_id, time.perf_counter() - t0)


def read_run(out: Path, run_id: str, wall: float | None = None) -> dict[str, Any]:
    """A finished run's timings and compile counts from its tables (``wall``: the process's seconds, if timed)."""
    from fedsap_ray import results

    res = results.load(str(out))
    rounds = res.rounds[res.rounds["run_id"] == run_id]
    clients = res.clients[res.clients["run_id"] == run_id]
    per_round = rounds.drop_duplicates("round").sort_values("round")
    mode = json.loads(res.runs.set_index("run_id").loc[run_id, "config_json"])["resources"]["compile"]
    return {"run_id": run_id, "mode": mode, "wall_s": None if wall is None else round(wall, 2),
            "train_s": round(float(per_round["train_s"].sum()), 2), "eval_s": round(float(per_round["eval_s"].sum()), 2),
            "round_wall_s": round(float(per_round["round_wall_s"].sum()), 2),
            "first_round_train_s": round(float(per_round["train_s"].iloc[0]), 2),
            "later_rounds_train_s": round(float(per_round["train_s"].iloc[1:].sum()), 2),
            "compile_outcomes": {k: int(v) for k, v in clients["compile"].value_counts().items()},
            "eval_compiles": (None if per_round["eval_compiles"].isna().all()
                              else int(per_round["eval_compiles"].fillna(0).sum()))}


def agreement(out: Path, ref_id: str, run_id: str) -> dict[str, Any]:
    """The largest per-round |difference| from the reference run in each figure of ``rounds`` (every eval
    mode and domain row), and the round it occurred in."""
    from fedsap_ray import results

    r = results.load(str(out)).rounds
    key = ["round", "eval_mode", "domain"]
    a = r[r["run_id"] == ref_id].set_index(key).sort_index()
    b = r[r["run_id"] == run_id].set_index(key).sort_index()
    out_: dict[str, Any] = {}
    for col in FIGURES:
        d = (a[col].astype(float) - b[col].astype(float)).abs()
        d = d[d.notna()]
        if d.empty:
            continue
        worst = d.idxmax()
        last = d.xs(a.index.get_level_values("round").max(), level="round")
        out_[col] = {"max": float(d.max()), "round": int(worst[0]), "last_round_max": float(last.max())}
    return out_


def cmd_runs(a: argparse.Namespace, root: Path) -> None:
    cache = root / "inductor"
    lines: dict[str, dict[str, Any]] = {}
    variants = [("eager", "off", []), ("cold", "train", []), ("warm", "train", []), ("warm_eval", "train+eval", [])]
    if a.control:
        variants.append(("eager_2_threads", "off", ["resources.torch_threads=2"]))
    for name, mode, extra in variants:
        if name in a.skip:  # already in --dir's results (a control added to an earlier invocation)
            continue
        lines[name] = run_once(root / "out", name, a.preset, [*a.set, *extra], mode, cache)
        print(json.dumps({"variant": name, **lines[name]}), flush=True)
    ref = lines.get("eager") or read_run(root / "out", "eager")
    summary = {name: {"train_ratio": round(v["train_s"] / ref["train_s"], 3),
                      "wall_ratio": round(v["wall_s"] / ref["wall_s"], 3) if ref["wall_s"] else None,
                      "later_rounds_train_ratio": round(v["later_rounds_train_s"] / ref["later_rounds_train_s"], 3),
                      "agreement": agreement(root / "out", "eager", name),
                      # compiled runs against the cold one: deterministic across processes and a cold or warm cache
                      "max_diff_to_cold": (max(d["max"] for d in agreement(root / "out", "cold", name).values())
                                           if name in ("warm", "warm_eval") and "cold" in lines else None)}
               for name, v in lines.items() if name != "eager"}
    print(json.dumps({"summary": summary, "preset": a.preset, "set": a.set}), flush=True)


def cmd_trials(a: argparse.Namespace, root: Path) -> None:
    cache = root / "inductor"
    eager = run_once(root / "out", "eager", a.preset, a.set, "off", cache)
    print(json.dumps({"variant": "eager", **eager}), flush=True)
    firsts = []
    for i in range(a.trials):
        line = run_once(root / "out", f"trial{i}", a.preset, a.set, "train", cache)
        firsts.append(line["first_round_train_s"] - eager["first_round_train_s"])
        print(json.dumps({"variant": f"trial {i}", **line}), flush=True)
    print(json.dumps({"summary": {"trials": a.trials, "first_round_extra_s": [round(x, 2) for x in firsts],
                                  "cold_extra_s": round(firsts[0], 2),
                                  "warm_extra_s_median": round(float(np.median(firsts[1:])), 2) if a.trials > 1 else None,
                                  "preset": a.preset, "set": a.set}}), flush=True)


def cmd_buckets(a: argparse.Namespace) -> None:
    from fedsap_ray import results

    layers = results.load(a.results).layers
    layers = layers[layers["run_id"] == a.run_id] if a.run_id else layers
    layers = layers.assign(active=layers["n_global"] + layers["n_private"])
    active = layers.pivot_table(index=["round", "client_id"], columns="layer", values="active", aggfunc="first")
    full = layers.groupby("layer")["channels"].first()
    order = list(full.index)

    def cost(table: pd.DataFrame) -> float:
        v = table[order].to_numpy(float)
        return float((v[:, :-1] * v[:, 1:]).sum() + v[:, 0].sum())

    base = cost(active)
    for frac in (None, 1 / 8, 1 / 4, 1 / 2):
        shaped = active.copy()
        if frac is not None:
            for layer in order:
                step = max(1, round(full[layer] * frac))
                shaped[layer] = np.minimum(np.ceil(active[layer] / step) * step, full[layer])
        print(json.dumps({"bucket": "exact" if frac is None else frac, "clients": len(shaped),
                          "shapes": len(shaped.drop_duplicates()), "most_common": int(shaped.value_counts().iloc[0]),
                          "compute_ratio": round(cost(shaped) / base, 3)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("runs", "trials", "buckets"))
    p.add_argument("--preset", default="laptop")
    p.add_argument("--set", action="append", default=[], help="config override of every run (repeatable)")
    p.add_argument("--control", action="store_true", help="runs: also eager on 2 threads (the float-reordering control)")
    p.add_argument("--skip", nargs="*", default=[], help="runs: variants already in --dir (not run again)")
    p.add_argument("--trials", type=int, default=13, help="trial processes (trials)")
    p.add_argument("--dir", default=None, help="work folder (default: a fresh temporary one)")
    p.add_argument("--results", default=None, help="results folder of a finished FedSAP run (buckets)")
    p.add_argument("--run-id", default=None, help="its run id (buckets; default: every run in the folder)")
    a = p.parse_args(argv)
    if a.what == "buckets":
        if not a.results:
            p.error("buckets needs --results DIR")
        cmd_buckets(a)
        return
    root = Path(a.dir or tempfile.mkdtemp(prefix="compile-runs-"))
    root.mkdir(parents=True, exist_ok=True)
    pd.set_option("display.width", 200)
    (cmd_runs if a.what == "runs" else cmd_trials)(a, root)


if __name__ == "__main__":
    main()
