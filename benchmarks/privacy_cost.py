#!/usr/bin/env python
"""What ``privacy.*`` adds to a round (issue 57): the same federation and model with privacy off, central (fixed
clipping, target epsilon) and central with adaptive clipping, interleaved in one process, as ratios of the round's
wall time and of the server's own time (``rounds.server_s``: plans and aggregation, where clipping, the noise and
the accountant run) to the non-private run's.

    python benchmarks/privacy_cost.py --model resnet10 --width 1.0     # the papers' model: 4.9M coordinates a client
    python benchmarks/privacy_cost.py --model resnet10 --width 0.25    # the laptop preset's

Each variant runs ``--repeats`` times in turn (off, central, adaptive, off, ...); round 1 (the accountant's first
curve, dp-accounting's import, warm-up) is reported apart and left out of the ratios. Run on a quiet machine: one
JSON line per variant and repeat, then the ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsap_ray import results  # noqa: E402
from fedsap_ray.config import build_config  # noqa: E402
from fedsap_ray.data import build_federation  # noqa: E402
from fedsap_ray.experiment import run_experiment  # noqa: E402

VARIANTS = {
    "off": [],
    "central": ["privacy.mode=central", "privacy.target_epsilon=8", "privacy.clip_norm=1"],
    "adaptive": ["privacy.mode=central", "privacy.target_epsilon=8", "privacy.clip_norm=1", "privacy.clipping=adaptive",
                 "privacy.count_noise=1"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet10", choices=["cnn_small", "resnet10"])
    p.add_argument("--width", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=20, help="federation size; half train each round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--algorithm", default="heterofl")
    p.add_argument("--client-fraction", type=float, default=0.02, help="data.client_fraction: 80 images a client")
    args = p.parse_args(argv)
    base = [f"algorithm.name={args.algorithm}", f"model.name={args.model}", f"model.width_mult={args.width}",
            f"data.num_clients={args.clients}", f"data.client_fraction={args.client_fraction}", "training.participation=0.5",
            f"training.rounds={args.rounds}", "training.local_epochs=1", "training.eval_every=1000",
            "training.eval_deployed=false", "data.max_test_per_domain=40", "resources.num_workers=2"]
    fed = build_federation(build_config(preset="smoke", overrides=base))
    per: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for name, extra in VARIANTS.items():
            cfg = build_config(preset="smoke", overrides=[*base, *extra])
            with tempfile.TemporaryDirectory() as d:
                run_experiment(cfg, Path(d), run_id="r", federation=fed)
                r = results.load(d).rounds.drop_duplicates("round").sort_values("round")
            later = r[r["round"] > 1]
            wall, server = float(later["round_wall_s"].sum()), float(later["server_s"].sum())
            per[name].append((wall, server))
            print(json.dumps({"variant": name, "repeat": rep, "round1_s": float(r["round_wall_s"].iloc[0]),
                              "later_rounds_s": wall, "later_server_s": server,
                              "epsilon": None if "dp_epsilon" not in r or r["dp_epsilon"].isna().all()
                              else float(r["dp_epsilon"].iloc[-1])}), flush=True)
    off_wall = statistics.median(w for w, _ in per["off"])
    off_server = statistics.median(s for _, s in per["off"])
    for name in ("central", "adaptive"):
        wall = statistics.median(w for w, _ in per[name])
        server = statistics.median(s for _, s in per[name])
        print(json.dumps({"ratio": name, "model": args.model, "width": args.width, "round_wall_vs_off": wall / off_wall,
                          "round_s_off": off_wall / (args.rounds - 1), "round_s": wall / (args.rounds - 1),
                          "server_s_per_round_off": off_server / (args.rounds - 1),
                          "server_s_per_round": server / (args.rounds - 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
