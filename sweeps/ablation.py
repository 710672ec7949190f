"""FedSAP's ablations (papers/000): Figure 4, Table 5, Table 2 and the DGA controls.

    python sweeps/ablation.py --out runs/ablation --seeds 0 1 2     # laptop preset, 57 trials
    python sweeps/ablation.py --smoke-test                          # minutes on 2 cores

- Figure 4 (main adaptive configuration): ``full``; ``no-dga`` (dga=none: no pseudo-domain
  grouping, each client its own group); ``no-sgp`` (sgp=false: no Global/Private split,
  every active channel Global); ``no-dga-no-sgp``. In our reading (docs/readings.md#without-sgp) the
  groups only route Private channels, so without SGP the DGA setting cannot change a
  number: the last two bars coincide by construction, which the table shows as such.
- Table 5 (2 x 2, aggregation path x layer-budget rule, dga=gradient): ``full``
  (tri-state, adaptive), ``uniform-budget`` (tri-state, uniform), ``no-sgp`` (single
  path, adaptive), ``single-uniform`` (single path, uniform).
- Table 2 (DGA gradient source, fixed-mask reference setting ``fedsap_fixed``):
  ``fixed-conv1`` / ``fixed-layer1`` / ``fixed-layer2`` / ``fixed-layer3``.
- DGA controls (main configuration): ``dga-oracle`` (the true domains) and ``dga-random``
  (random groups of the gradient grouping's sizes), next to ``full`` and ``no-dga``;
  ``dga-train`` groups by the gradient of local training (``dga_source=train``, the paper's
  signal) instead of the probe gradient, FedSAP's default since issue 24 (one common sub-model's
  gradient on each client's data before training).

- Mask stability (main configuration, whose line 14 is the pooled ranking under a 10% swap budget):
  ``rule-today`` (re-ranked every round, only the dispersion smoothed), ``rule-ema``,
  ``rule-hysteresis``, ``rule-budget`` (own ranking under the budget), ``rule-pooled`` (no budget).
- ``fedavg-het``: heterogeneous FedAvg at the same capacities, the floor under every cell.

Shared runs are not repeated: 19 variants per seed. Prints every table at the end
(``analysis.ablation``); ``analysis/notebooks/ablation.ipynb`` plots them.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis`/`sweeps` from a source checkout

from analysis.ablation import report as ablation_report  # noqa: E402
from fedsap_ray import results  # noqa: E402
from sweeps.study import study_main  # noqa: E402

MAIN = ["algorithm.name=fedsap"]
FIXED = ["algorithm.name=fedsap_fixed"]
VARIANTS: dict[str, list[str]] = {
    # Figure 4
    "full": MAIN,
    "no-dga": [*MAIN, "algorithm.dga=none"],
    "no-sgp": [*MAIN, "algorithm.sgp=false"],
    "no-dga-no-sgp": [*MAIN, "algorithm.dga=none", "algorithm.sgp=false"],
    # Table 5 (with full and no-sgp)
    "uniform-budget": [*MAIN, "algorithm.adaptive_layer_budget=0"],
    "single-uniform": [*MAIN, "algorithm.sgp=false", "algorithm.adaptive_layer_budget=0"],
    # Table 2
    **{f"fixed-{layer}": [*FIXED, f"algorithm.dga_layer={layer}"] for layer in ("conv1", "layer1", "layer2", "layer3")},
    # DGA controls (with full and no-dga)
    "dga-oracle": [*MAIN, "algorithm.dga=oracle"],
    "dga-random": [*MAIN, "algorithm.dga=random"],
    "dga-train": [*MAIN, "algorithm.dga_source=train"],
    # mask stability (docs/readings.md#stable-masks): the line-14 readings other than the default (pooled
    # ranking, EMA-smoothed statistics, 10% swap budget, which is `full`)
    "rule-today": [*MAIN, "algorithm.smoothing=dispersion", "algorithm.stability=none", "algorithm.ranking=client"],
    "rule-ema": [*MAIN, "algorithm.stability=none", "algorithm.ranking=client"],
    "rule-hysteresis": [*MAIN, "algorithm.stability=hysteresis", "algorithm.ranking=client"],
    "rule-budget": [*MAIN, "algorithm.ranking=client"],
    "rule-pooled": [*MAIN, "algorithm.stability=none"],
    # the reference below every cell: heterogeneous FedAvg (sub-models at the same capacities)
    "fedavg-het": ["algorithm.name=fedavg", "algorithm.width=capacity"],
}
STUDY = "ablation"
DEFAULT_PRESET = "laptop"
SMOKE: list[str] = []


def report(out: str) -> str:
    return ablation_report(results.load(out))


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study=STUDY, default_preset=DEFAULT_PRESET,
                      smoke=SMOKE, report=report)


if __name__ == "__main__":
    raise SystemExit(main())
