"""FedSAP's one-factor hyperparameter sensitivity (papers/000 Appendix D, Table 7 and Figure 5).

    python sweeps/sensitivity.py --out runs/sensitivity --seeds 0 1 2     # laptop preset, 39 trials
    python sweeps/sensitivity.py --preset paper --address auto            # the Digits protocol, on a cluster
    python sweeps/sensitivity.py --smoke-test                             # minutes on 2 cores: every grid point

The fixed-mask, uniform-budget reference setting (``fedsap_fixed``: masks fixed after
warm-up, adaptive_layer_budget 0) around (g_target, tau_var, beta_EMA) = (0.9, 0.1, 0.3),
one factor at a time, over the paper's value lists. The reference point is shared by the
three factors, so it runs once per seed (13 grid points per seed). Prints the table
(``analysis.sensitivity``) at the end; ``analysis/notebooks/sensitivity.ipynb`` plots it.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis`/`sweeps` from a source checkout

from analysis.sensitivity import sensitivity_table, to_markdown  # noqa: E402
from fedsap_ray import results  # noqa: E402
from sweeps.study import study_main  # noqa: E402

REFERENCE = {"g_target": 0.9, "tau_var": 0.1, "beta_ema": 0.3}  # papers/000 Appendix B, fixed-mask column
GRID = {  # papers/000 Table 7: every evaluated value
    "g_target": [0.5, 0.6, 0.7, 0.8, 0.9, 0.95],
    "tau_var": [0.05, 0.1, 0.2, 0.3, 0.5],
    "beta_ema": [0.3, 0.5, 0.7, 0.9],
}
BASE = ["algorithm.name=fedsap_fixed", *(f"algorithm.{k}={v}" for k, v in REFERENCE.items())]


def variants() -> dict[str, list[str]]:
    """``ref`` plus one variant per non-reference value of each factor."""
    out = {"ref": list(BASE)}
    for factor, values in GRID.items():
        for v in values:
            if v != REFERENCE[factor]:
                out[f"{factor}={v}"] = [*BASE, f"algorithm.{factor}={v}"]
    return out


VARIANTS = variants()
STUDY = "sensitivity"
DEFAULT_PRESET = "laptop"
SMOKE: list[str] = []


def report(out: str) -> str:
    return "Table 7 (one-factor sensitivity, fixed-mask reference setting)\n" + to_markdown(
        sensitivity_table(results.load(out)))


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study=STUDY, default_preset=DEFAULT_PRESET,
                      smoke=SMOKE, report=report)


if __name__ == "__main__":
    raise SystemExit(main())
