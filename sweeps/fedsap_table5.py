"""FedSAP's Table 5 ablation (aggregation path x layer-budget rule) plus heterogeneous FedAvg,
over several seeds, on any preset (default: the embedded ``laptop`` preset).

    python sweeps/fedsap_table5.py --out runs/table5 --seeds 0 1 2
    python sweeps/fedsap_table5.py --smoke-test           # seconds: every variant, one seed, tiny

Runs one after another in this process (or on Ray with --backend ray), resumable
(``sweeps.common.run_variants``). Prints the table (``analysis.fedsap``) at the end.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis` from a source checkout

from analysis.fedsap import load_table, to_markdown  # noqa: E402
from sweeps.common import study_main  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "fedsap": ["algorithm.name=fedsap"],
    "fedsap-uniform": ["algorithm.name=fedsap", "algorithm.adaptive_layer_budget=0"],
    "single-adaptive": ["algorithm.name=fedsap", "algorithm.sgp=false"],
    "single-uniform": ["algorithm.name=fedsap", "algorithm.sgp=false", "algorithm.adaptive_layer_budget=0"],
    "fedavg-het": ["algorithm.name=fedavg", "algorithm.width=capacity"],
}
SMOKE = ["training.rounds=3", "data.max_test_per_domain=60", "model.width_mult=0.0625"]


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study="fedsap_table5",
                      default_preset="laptop", smoke=SMOKE, report=lambda out: to_markdown(load_table(out)))


if __name__ == "__main__":
    raise SystemExit(main())
