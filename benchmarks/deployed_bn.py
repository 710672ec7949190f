"""What BatchNorm statistics a deployed sub-model needs (docs/readings.md#deployed-evaluation).

Trains a strategy in-process for a few rounds, then evaluates every client's deployed model
(``Strategy.deployed_model``) on its own domain twice: with the server's aggregated running
statistics (``training.deployed_bn=aggregated``) and with statistics recomputed on the client's
own training data (``client``, the default). One line per client, then the means.

    python benchmarks/deployed_bn.py                          # HeteroFL, laptop preset, 6 rounds, seed 0
    python benchmarks/deployed_bn.py --algorithm fedsap --rounds 3 --preset smoke
"""
from __future__ import annotations

import argparse

import torch

from fedsap_ray.algorithms import Strategy
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.engine.evaluate import DeployedModel, evaluate_deployed
from fedsap_ray.experiment import build_context
from fedsap_ray import algorithms
from fedsap_ray.runtime.local import LocalBackend


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algorithm", default="heterofl")
    ap.add_argument("--preset", default="laptop")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = build_config(preset=args.preset, overrides=[f"algorithm.name={args.algorithm}",
                                                      f"training.rounds={args.rounds}", f"seed={args.seed}"])
    fed = build_federation(cfg)
    ctx = build_context(cfg, fed)
    strat: Strategy = algorithms.get(cfg.algorithm.name)(ctx, cfg.algorithm.opts)
    backend = LocalBackend("cpu", num_workers=1)
    backend.start(ctx)
    state = strat.init_state()
    try:
        for t in range(1, args.rounds + 1):
            plans = strat.configure_round(state, t)
            state = strat.aggregate(state, plans, backend.train(plans), t).state
    finally:
        backend.close()
    models = [DeployedModel(c.client_id, c.domain, *strat.deployed_model(state, c.client_id)) for c in fed.clients]
    own = {c.client_id: fed.client_data(c.client_id) for c in fed.clients}
    cpu = torch.device("cpu")
    agg = evaluate_deployed([ctx.model], ctx.layout, models, fed.test, cpu, fed.num_classes)
    mine = evaluate_deployed([ctx.model], ctx.layout, models, fed.test, cpu, fed.num_classes, bn_data=own)
    for c in fed.clients:
        print(f"{args.algorithm} client {c.client_id} {c.domain:<10} keep {c.capacity:.1f}: "
              f"aggregated BN {agg[c.client_id][0]:.3f}  own BN {mine[c.client_id][0]:.3f}")
    n = len(fed.clients)
    print(f"mean over clients: aggregated BN {sum(a for a, _ in agg.values()) / n:.3f}  "
          f"own BN {sum(a for a, _ in mine.values()) / n:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
