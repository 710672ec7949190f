"""The main comparison (papers/000 Table 1): every registered algorithm on the chosen dataset.

    python sweeps/main_comparison.py --out runs/table1 --seeds 0 1 2     # laptop preset, every algorithm
    python sweeps/main_comparison.py --variants fedavg fedsap dapperfl   # a subset
    python sweeps/main_comparison.py --smoke-test                        # every algorithm, tiny, one seed

Besides one variant per registered algorithm, ``dapperfl-capacity`` runs DapperFL with
``full_first_epoch=false`` (within each device's capacity).

The variant list is read from the algorithm registry, so an algorithm registered later
joins the comparison without touching this file. Methods the paper marks without system
heterogeneity (FedAvg, MOON, FedSR, FPL, FedSPU, SCAFFOLD) train the full model on every
client; the others train sub-models at each client's capacity (kappa_i / p_max) (FedProx with
``width=capacity``, as the paper's Table 1 row). Prints ``analysis.comparison``'s table
(best-so-far per domain and global, mean ± std over seeds) at the end;
``analysis/notebooks/main_comparison.ipynb`` plots the convergence curves.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis`/`sweeps` from a source checkout

from analysis.comparison import table1, to_markdown  # noqa: E402
from fedsap_ray import algorithms, results  # noqa: E402
from sweeps.study import study_main  # noqa: E402

# per-algorithm settings of the Table 1 row (anything not listed runs with its defaults)
SETTINGS: dict[str, list[str]] = {"fedprox": ["algorithm.width=capacity"]}


# further rows: a registered method run with a non-default option
EXTRA_VARIANTS: dict[str, list[str]] = {
    # DapperFL within each device's capacity (its fused first epoch on the pruned model; analysis labels it
    # "DapperFL (capacity)"), so the comparison can be read both ways (issue 13)
    "dapperfl-capacity": ["algorithm.name=dapperfl", "algorithm.full_first_epoch=false"],
}


def variants() -> dict[str, list[str]]:
    out = {name: [f"algorithm.name={name}", *SETTINGS.get(name, [])] for name in algorithms.names()}
    return {**out, **EXTRA_VARIANTS}


VARIANTS = variants()
STUDY = "main_comparison"
DEFAULT_PRESET = "laptop"
SMOKE: list[str] = []


def report(out: str) -> str:
    return to_markdown(table1(results.load(out)))


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study=STUDY, default_preset=DEFAULT_PRESET,
                      smoke=SMOKE, report=report)


if __name__ == "__main__":
    raise SystemExit(main())
