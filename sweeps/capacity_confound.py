"""The capacity-confounds study (papers/003): allocation strategies, the coverage ablation, the
matched-budget random control, TV-vs-capacity correlations and the full-model comparison.

    python sweeps/capacity_confound.py --out runs/confound --seeds 0 1 2      # real MNIST, 27 runs
    python sweeps/capacity_confound.py --preset paper_cifar10 --out runs/c10  # the paper's CIFAR-10 protocol
    python sweeps/capacity_confound.py --smoke-test                           # seconds: every variant, tiny

Default preset ``confound_laptop``: real MNIST (../shared/data/mnist, 20,000 training images)
Dirichlet(0.3) over 20 clients, p_max tiers 7 x 0.25 / 7 x 0.5 / 3 x 0.75 / 3 x 1.0, 10 clients
per round, cnn_small at half width, 50 rounds, papers/003 section 4.1's optimiser and HAS-FL settings.
Resumable (``sweeps.common.run_variants``). Prints ``analysis.confound.report`` at the end
(Tables 3-6 and the Figure 6 frontier, written as PNG next to the results).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis` from a source checkout

from analysis.confound import report  # noqa: E402
from sweeps.common import run_variants  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "hasfl": ["algorithm.name=hasfl"],
    "hasfl-nocov": ["algorithm.name=hasfl", "algorithm.coverage=false"],
    "random_budget": ["algorithm.name=random_budget"],
    "heterofl": ["algorithm.name=heterofl"],
    "fjord": ["algorithm.name=fjord"],
    "uniform": ["algorithm.name=uniform"],
    "fedavg": ["algorithm.name=fedavg"],
    "fedprox": ["algorithm.name=fedprox", "algorithm.mu=1.0"],  # papers/003 section 4.5: "the standard mu = 1.0"
    "scaffold": ["algorithm.name=scaffold"],
}
SMOKE = ["training.rounds=4", "data.max_test_per_domain=60", "model.width_mult=0.0625"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/capacity_confound")
    p.add_argument("--preset", default="confound_laptop")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument("--jobs", type=int, default=1, help="runs at once in worker processes (local backend)")
    p.add_argument("--smoke-test", action="store_true", help="smoke preset (HAS-FL adapts and normalises), one seed")
    args = p.parse_args(argv)
    preset, seeds, extra = args.preset, args.seeds, list(args.overrides)
    if args.smoke_test:
        preset, seeds, extra = "smoke", seeds[:1], extra + SMOKE
    out = Path(args.out)
    run_variants(out, {v: VARIANTS[v] for v in args.variants}, seeds, preset=preset, extra=extra,
                 backend=args.backend, jobs=args.jobs, study="capacity_confound")
    print(report(out, frontier_png=out / "frontier.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
