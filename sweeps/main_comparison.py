"""The main comparison (papers/000 Table 1): FedSAP and every baseline of its Table 1, several seeds.

    python sweeps/main_comparison.py --out runs/table1 --seeds 0 1 2     # laptop preset, 33 runs
    python sweeps/main_comparison.py --smoke-test                        # every method, tiny, one seed

Methods the paper marks without system heterogeneity (FedAvg, MOON, FedSR, FPL, FedSPU)
train the full model on every client; the others train sub-models at each client's keep
ratio (FedProx with ``width=capacity``). Resumable (``sweeps.common.run_variants``);
prints ``analysis.comparison``'s Table 1 at the end.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis` from a source checkout

from analysis.comparison import load_table, to_markdown  # noqa: E402
from sweeps.common import study_main  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "fedavg": ["algorithm.name=fedavg"],
    "moon": ["algorithm.name=moon"],
    "fedsr": ["algorithm.name=fedsr"],
    "fpl": ["algorithm.name=fpl"],
    "fedspu": ["algorithm.name=fedspu"],
    "feddrop": ["algorithm.name=feddrop"],
    "fedprox": ["algorithm.name=fedprox", "algorithm.width=capacity"],
    "fedmp": ["algorithm.name=fedmp"],
    "nefl": ["algorithm.name=nefl"],
    "dapperfl": ["algorithm.name=dapperfl"],
    "fedsap": ["algorithm.name=fedsap"],
}
SMOKE = ["training.rounds=3", "data.max_test_per_domain=60", "model.width_mult=0.0625"]


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study="main_comparison",
                      default_preset="laptop", smoke=SMOKE, report=lambda out: to_markdown(load_table(out)))


if __name__ == "__main__":
    raise SystemExit(main())
