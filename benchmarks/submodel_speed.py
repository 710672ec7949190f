#!/usr/bin/env python
"""What sub-model training and result writes cost per round (issue 17), as ratios measured in one invocation.

Two parts, each against a reference measured in the same process:

1. **masked against sliced** (``--cases laptop,confound,resnet10``). Each case is run twice
   with ``run_experiment`` on the local backend, identical except ``training.submodel``:
   ``masked`` (the full network, inactive coordinates zeroed: the reference) and ``sliced``
   (the active channels gathered into a dense smaller network). Cases:

   - ``laptop``: preset ``laptop``, algorithm ``fedsap`` (the README's laptop run);
   - ``confound``: preset ``confound_laptop``, algorithm ``hasfl`` (needs MNIST under ../shared/data);
   - ``resnet10``: a paper-width ResNet10 (``model.width_mult=1``) on the embedded digits,
     5 clients all training every round at capacities 1/.8/.6/.4/.2 (``fedavg`` with
     ``algorithm.width=capacity``, capacity scheme ``explicit``).

   Per (case, mode) one JSON line: ``per_round_s`` (mean ``round_wall_s`` of rounds 2..R:
   round 1 is warm-up; with ``--rounds 1`` round 1 itself, flagged ``warmup_included``;
   evaluation included), ``train_s_per_round`` (the clients' local training wall time summed
   over a round's clients, same rounds),
   ``train_macs_per_round`` (the ``clients`` table's ``train_macs``: what the devices spend, the
   same in both modes), ``executed_macs_per_round`` (forward MACs the simulator really ran: masked
   clients run the full network on every sample), ``final_global_accuracy``; then one ``summary``
   line per case with ``speedup_sliced`` = masked per_round_s / sliced per_round_s
   (``speedup_sliced_training`` the same for ``train_s_per_round``), ``executed_macs_ratio`` =
   masked / sliced executed MACs, and both final accuracies after the same rounds.
   ``--rounds``, ``--max-steps`` (``training.max_steps_per_epoch``) and ``--local-epochs`` make
   it small; without them each preset's own protocol runs (minutes to hours).

2. **result writes** (``--cases writes``): one synthetic run's rows of realistic size
   (``--write-clients`` clients, ``--write-layers`` channel layers, ``--write-domains``
   test domains per round) go through :class:`fedsap_ray.results.RunWriter` for
   ``--write-rounds`` rounds; each round's ``flush`` is timed. Reference in the same run:
   ``rewrite``, the same rows rewritten whole every round (what RunWriter did before
   issue 17). Reported: the fastest flush (``*_s_round2``, ``*_s_last``; load spikes from
   other jobs excluded) and the median over the ``--write-window`` rounds ending at round 2
   (rounds 1-2) and at the last round, and ``growth`` = last / round 2 of the fastest, for
   both (append-only: ~1; rewrite: grows with the round number).

Output: JSON lines on stdout (and in ``--out``), progress on stderr. Never asserted on
in tests (wall-clock); see benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fedsap_ray
from fedsap_ray import results
from fedsap_ray.config import ConfigError, build_config
from fedsap_ray.experiment import run_experiment
from fedsap_ray.config.schema import ExperimentConfig

MODES = ("masked", "sliced")
CASES: dict[str, tuple[str, list[str]]] = {
    "laptop": ("laptop", ["algorithm.name=fedsap"]),
    "confound": ("confound_laptop", ["algorithm.name=hasfl"]),
    "resnet10": ("laptop", ["algorithm.name=fedavg", "algorithm.width=capacity", "model.name=resnet10",
                            "model.width_mult=1.0", "data.num_clients=5", "training.participation=1.0",
                            "data.client_fraction=0.05", "data.max_test_per_domain=200",
                            "capacity.scheme=explicit", "capacity.keep_ratios=[1.0,0.8,0.6,0.4,0.2]"]),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def emit(rec: dict, sink) -> None:
    line = json.dumps(rec, sort_keys=True)
    print(line, flush=True)
    if sink is not None:
        sink.write(line + "\n")
        sink.flush()


def case_config(case: str, mode: str, args) -> ExperimentConfig:
    preset, extra = CASES[case]
    over = [*extra, f"training.submodel={mode}", "resources.backend=local", f"seed={args.seed}"]
    if args.rounds is not None:
        over.append(f"training.rounds={args.rounds}")
    if args.max_steps is not None:
        over.append(f"training.max_steps_per_epoch={args.max_steps}")
    if args.local_epochs is not None:
        over.append(f"training.local_epochs={args.local_epochs}")
    over += args.set
    try:
        return build_config(preset=preset, overrides=over)
    except ConfigError as e:
        if "training.submodel" in str(e):
            raise SystemExit(f"submodel_speed: this fedsap_ray ({fedsap_ray.__version__}) has no training.submodel "
                             f"option (sliced sub-model training, issue 17, is not in it): {e}") from e
        raise


def run_case(case: str, args, sink) -> None:
    recs = {}
    for mode in MODES:
        cfg = case_config(case, mode, args)
        with tempfile.TemporaryDirectory(prefix=f"submodel-{case}-{mode}-") as tmp:
            log(f"{case} {mode}: {cfg.training.rounds} rounds ...")
            t0 = time.perf_counter()
            outcome = run_experiment(cfg, Path(tmp), run_id=f"{case}-{mode}")
            total = time.perf_counter() - t0
            res = results.load(tmp)
        glob_rows = res.rounds[res.rounds["domain"] == results.GLOBAL_DOMAIN].drop_duplicates("round")
        walls = glob_rows.sort_values("round")["round_wall_s"].tolist()
        timed = walls[1:] if len(walls) > 1 else walls
        macs = res.clients.groupby("round")["train_macs"].sum()
        # what the simulator executed: a masked client runs the full network on every sample it trains
        # (train_macs / macs_per_sample samples), a sliced one the sub-model train_macs counts
        samples = res.clients["train_macs"] / res.clients["macs_per_sample"]
        executed = (samples * full_model_macs(cfg) if mode == "masked" else res.clients["train_macs"])
        executed = executed.groupby(res.clients["round"]).sum()
        train = res.clients.groupby("round")["wall_s"].sum().sort_index().tolist()  # clients' local training only
        train_timed = train[1:] if len(train) > 1 else train
        rec = {"case": case, "mode": mode, "preset": CASES[case][0], "algorithm": cfg.algorithm.name,
               "model": cfg.model.name, "width_mult": cfg.model.width_mult, "rounds": cfg.training.rounds,
               "max_steps_per_epoch": cfg.training.max_steps_per_epoch, "local_epochs": cfg.training.local_epochs,
               "per_round_s": round(statistics.fmean(timed), 4), "warmup_included": len(walls) < 2,
               "train_s_per_round": round(statistics.fmean(train_timed), 4),
               "run_s": round(total, 2),
               "train_macs_per_round": int(macs.mean()) if macs.notna().all() and len(macs) else None,
               "executed_macs_per_round": int(executed.mean()) if executed.notna().all() and len(executed) else None,
               "final_global_accuracy": outcome.final_global_accuracy, "status": outcome.status,
               "load1": load1(), "torch_threads": cfg.resources.torch_threads}
        recs[mode] = rec
        emit(rec, sink)
    m, s = recs["masked"], recs["sliced"]
    emit({"case": case, "summary": True,
          "speedup_sliced": round(m["per_round_s"] / s["per_round_s"], 3) if s["per_round_s"] else None,
          "speedup_sliced_training": (round(m["train_s_per_round"] / s["train_s_per_round"], 3)
                                      if s["train_s_per_round"] else None),
          "executed_macs_ratio": (round(m["executed_macs_per_round"] / s["executed_macs_per_round"], 3)
                                  if m["executed_macs_per_round"] and s["executed_macs_per_round"] else None),
          "accuracy_masked": m["final_global_accuracy"], "accuracy_sliced": s["final_global_accuracy"],
          "rounds": m["rounds"]}, sink)


def full_model_macs(cfg) -> int:
    """Per-sample forward MACs of the case's full network (what masked training runs for every sample)."""
    from fedsap_ray.data import build_federation
    from fedsap_ray.experiment import build_context
    from fedsap_ray.models import model_macs

    ctx = build_context(cfg, build_federation(cfg))
    return int(model_macs(ctx.model, ctx.federation.input_shape, None))


# ----------------------------------------------------------------------------- result writes

def synthetic_round(t: int, n_clients: int, n_layers: int, n_domains: int) -> dict[str, list[dict]]:
    """One round's rows, shaped like a FedSAP run's (every client of the federation in allocations)."""
    doms = [f"d{i}" for i in range(n_domains)] + [results.GLOBAL_DOMAIN]
    rounds = [{"round": t, "domain": d, "eval_mode": "global", "evaluated": True, "accuracy": 0.5 + 1e-3 * t,
               "loss": 1.0 / t, "n_test": 500, "global_accuracy": 0.5, "best_global_accuracy": 0.5,
               "worst_domain_accuracy": 0.4, "avg_capacity": 0.6, "n_clients": n_clients, "bytes_up": 10 ** 6,
               "bytes_down": 10 ** 6, "train_loss": 0.7, "round_wall_s": 3.0, "frozen_params": 0,
               "domain_coverage": 1.0} for d in doms]
    clients = [{"round": t, "client_id": c, "true_domain": f"d{c % n_domains}", "pruning_ratio": 0.4,
                "capacity_max": 0.6, "capacity_used": 0.6, "pseudo_group": c % 3, "n_global": 100, "n_private": 50,
                "n_dropped": 30, "tv_distance": 0.2, "n_samples": 640, "train_loss": 0.7 + 1e-4 * c,
                "params_trained": 10 ** 6, "macs_per_sample": 10 ** 7, "train_macs": 10 ** 10, "bytes_up": 10 ** 5,
                "bytes_down": 10 ** 5, "wall_s": 1.5, "worker": "local"} for c in range(n_clients)]
    layers = [{"round": t, "client_id": c, "layer": f"layer{i}", "channels": 64, "keep_ratio": 0.6, "n_global": 30,
               "n_private": 8, "n_dropped": 26} for c in range(n_clients) for i in range(n_layers)]
    allocations = [{"round": t, "client_id": c, "capacity_max": 0.6, "p": 0.6, "tv_distance": 0.2, "adapted": False}
                   for c in range(n_clients)]
    return {"rounds": rounds, "clients": clients, "layers": layers, "allocations": allocations}


def bench_writes(args, sink) -> None:
    n = args.write_rounds
    w = args.write_window
    with tempfile.TemporaryDirectory(prefix="submodel-writes-") as tmp:
        out = Path(tmp)
        writer = results.RunWriter(out / "append", "r")
        writer.set_run({"status": "running"})
        kept: dict[str, list[dict]] = {t: [] for t in results.DATA_TABLES}
        append_s, rewrite_s = [], []
        for t in range(1, n + 1):
            rows = synthetic_round(t, args.write_clients, args.write_layers, args.write_domains)
            for table, rs in rows.items():
                writer.add(table, rs)
            t0 = time.perf_counter()
            writer.flush()
            append_s.append(time.perf_counter() - t0)
            for table, rs in rows.items():  # the reference: every table rewritten whole, as before issue 17
                kept[table].extend({"schema_version": results.SCHEMA_VERSION, "run_id": "r", **r} for r in rs)
            t0 = time.perf_counter()
            for table in results.DATA_TABLES:
                results.write_atomic(results.to_table(table, kept[table]), out / "rewrite" / table / "r.parquet")
            results.write_atomic(results.to_table("runs", [writer.run_row]), out / "rewrite" / "runs" / "r.parquet")
            rewrite_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        writer.consolidate()
        merge_s = time.perf_counter() - t0
    early_end = min(2, n)

    def window(xs: list[float], end: int, how=min) -> float:
        return how(xs[max(0, end - w):end])

    rec = {"case": "writes", "rounds": n, "window": w, "rows_per_round": sum(len(v) for v in rows.values()),
           "merge_at_end_s": round(merge_s, 4), "load1": load1()}
    for name, xs in (("append", append_s), ("rewrite", rewrite_s)):
        rec[f"{name}_s_round2"] = round(window(xs, early_end), 5)  # best of the window: load spikes excluded
        rec[f"{name}_s_last"] = round(window(xs, n), 5)
        rec[f"{name}_median_s_round2"] = round(window(xs, early_end, statistics.median), 5)
        rec[f"{name}_median_s_last"] = round(window(xs, n, statistics.median), 5)
        rec[f"{name}_growth"] = round(rec[f"{name}_s_last"] / rec[f"{name}_s_round2"], 3)
    emit(rec, sink)


def load1() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cases", default="laptop,confound,resnet10,writes",
                   help="comma-separated: " + ",".join([*CASES, "writes"]))
    p.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the preset's)")
    p.add_argument("--max-steps", type=int, default=None, help="training.max_steps_per_epoch (default: the preset's)")
    p.add_argument("--local-epochs", type=int, default=None, help="training.local_epochs (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every submodel run (repeatable)")
    p.add_argument("--write-rounds", type=int, default=200, help="rounds of the synthetic write benchmark")
    p.add_argument("--write-window", type=int, default=10, help="median over this many rounds at each end")
    p.add_argument("--write-clients", type=int, default=10)
    p.add_argument("--write-layers", type=int, default=12)
    p.add_argument("--write-domains", type=int, default=4)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON lines to this file")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in (*CASES, "writes")]
    if bad:
        p.error(f"invalid --cases: {bad}; allowed: {', '.join([*CASES, 'writes'])}")
    if args.write_rounds < 2:
        p.error("--write-rounds must be >= 2")
    sink = open(args.out, "a") if args.out else None
    try:
        for c in cases:
            if c == "writes":
                bench_writes(args, sink)
            else:
                run_case(c, args, sink)
    finally:
        if sink is not None:
            sink.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
