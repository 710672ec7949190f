"""FedSAP's Table 5 ablation (aggregation path x layer-budget rule) plus heterogeneous FedAvg,
over several seeds, on any preset (default: the embedded ``laptop`` preset).

    python sweeps/fedsap_table5.py --out runs/table5 --seeds 0 1 2
    python sweeps/fedsap_table5.py --smoke-test           # seconds: every variant, one seed, tiny

Runs one after another in this process (or on Ray with --backend ray), resumable
(``sweeps.common.run_variants``). Prints the table (``analysis.fedsap``) at the end.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis` from a source checkout

from analysis.fedsap import load_table, to_markdown  # noqa: E402
from sweeps.common import run_variants  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "fedsap": ["algorithm.name=fedsap"],
    "fedsap-uniform": ["algorithm.name=fedsap", "algorithm.adaptive_layer_budget=0"],
    "single-adaptive": ["algorithm.name=fedsap", "algorithm.sgp=false"],
    "single-uniform": ["algorithm.name=fedsap", "algorithm.sgp=false", "algorithm.adaptive_layer_budget=0"],
    "fedavg-het": ["algorithm.name=fedavg", "algorithm.width=capacity"],
}
SMOKE = ["training.rounds=3", "data.max_test_per_domain=60", "model.width_mult=0.0625"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/fedsap_table5")
    p.add_argument("--preset", default="laptop")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument("--jobs", type=int, default=1, help="runs at once in worker processes (local backend)")
    p.add_argument("--smoke-test", action="store_true", help="smoke preset, one seed, tiny model")
    args = p.parse_args(argv)
    preset, seeds, extra = args.preset, args.seeds, list(args.overrides)
    if args.smoke_test:
        preset, seeds, extra = "smoke", seeds[:1], extra + SMOKE
    out = Path(args.out)
    run_variants(out, {v: VARIANTS[v] for v in args.variants}, seeds, preset=preset, extra=extra,
                 backend=args.backend, jobs=args.jobs, study="fedsap_table5")
    print(to_markdown(load_table(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
