"""How FedSAP's masks move, measured on any checkout (no evaluation, so it runs in ~1.5 min on 2 cores).

Per round: client-channels re-activated (Dropped in a client's previous mask, active in its next
one) and Global <-> Private switches; at the end: the share of trainable coordinates that some
client of each domain trained (the union of the plan masks: ``rounds.domain_coverage``), the
channels a domain never saw, and each client's layer budget. It reads only the plans' tri-state
masks, so it measures an older commit the same way as today's code (which records the same
figures in ``rounds.n_reactivated`` / ``domain_coverage``). The before/after figures of
docs/guides/running.md#what-the-default-run-gives:

    git worktree add /tmp/before dcd2d6f
    PYTHONPATH=/tmp/before python benchmarks/fedsap_mask_motion.py --seed 0 --out before_s0.json
    python benchmarks/fedsap_mask_motion.py --seed 0 --out after_s0.json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fedsap_ray import algorithms
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.experiment import build_context
from fedsap_ray.algorithms.fedsap.tristate import DROPPED, GLOBAL, PRIVATE
from fedsap_ray.runtime.local import LocalBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="laptop")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = build_config(preset=args.preset, overrides=[f"seed={args.seed}", *args.overrides])
    fed = build_federation(cfg)
    ctx = build_context(cfg, fed)
    strat = algorithms.get(cfg.algorithm.name)(ctx, cfg.algorithm.opts)
    backend = LocalBackend("cpu", num_workers=2)
    backend.start(ctx)
    state, trainable = strat.init_state(), ctx.trainable
    cover = {d: np.zeros_like(trainable) for d in fed.domains}
    chan_cover = {d: np.zeros(ctx.space.total_channels, bool) for d in fed.domains}
    prev: dict[int, np.ndarray] | None = None
    rows, t0 = [], time.time()
    try:
        for t in range(1, cfg.training.rounds + 1):
            plans = strat.configure_round(state, t)
            cur = {cid: np.asarray(state.strategy_state.states[cid]).copy() for cid in plans}
            for cid, p in plans.items():
                d = fed.clients[cid].domain
                cover[d] |= p.mask & trainable
                chan_cover[d] |= cur[cid] != DROPPED
            row: dict = {"round": t}
            if prev is not None:
                both = [c for c in cur if c in prev]
                row["reactivated"] = int(sum(((prev[c] == DROPPED) & (cur[c] != DROPPED)).sum() for c in both))
                row["role_switches"] = int(sum((((prev[c] == GLOBAL) & (cur[c] == PRIVATE))
                                                | ((prev[c] == PRIVATE) & (cur[c] == GLOBAL))).sum() for c in both))
            row["n_private"] = int(sum((s == PRIVATE).sum() for s in cur.values()))
            prev = cur
            out = strat.aggregate(state, plans, backend.train(plans), t)
            state, info = out.state, out.records.rounds
            row.update({k: float(v) for k, v in info.items() if isinstance(v, (int, float, np.integer, np.floating))})
            rows.append(row)
            print(row, f"{time.time() - t0:.0f}s", flush=True)
    finally:
        backend.close()
    res = dict(seed=args.seed, rounds=rows,
               coverage={d: float(cover[d].sum() / trainable.sum()) for d in fed.domains},
               channels_never_seen={d: int((~chan_cover[d]).sum()) for d in fed.domains},
               total_channels=int(ctx.space.total_channels),
               layer_counts={int(k): [int(x) for x in v] for k, v in state.strategy_state.layer_counts.items()},
               capacities={c.client_id: c.capacity for c in fed.clients},
               domains={c.client_id: c.domain for c in fed.clients}, wall_s=time.time() - t0)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
