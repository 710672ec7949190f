"""The capacity-confounds study (papers/003): allocation strategies, the coverage ablation, the
matched-budget random control, TV-vs-capacity correlations and the full-model comparison.

    python sweeps/capacity_confound.py --out runs/confound --seeds 0 1 2      # real MNIST, 30 trials
    python sweeps/capacity_confound.py --preset paper_cifar10 --out s3://bucket/c10 --address auto
    python sweeps/capacity_confound.py --preset paper_shakespeare --variants hasfl random_budget heterofl fjord uniform
    python sweeps/capacity_confound.py --preset confound_shakespeare --out runs/confound_shk   # laptop-scale text
    python sweeps/capacity_confound.py --smoke-test                           # every variant, tiny

Tables 3 and 6 (allocation strategies and the full-model methods FedAvg / FedProx /
SCAFFOLD), Table 4 (coverage ablation: ``hasfl-nocov``), Table 5 (TV-vs-capacity
correlations of the final estimates), the matched-budget random control
(``random_budget``) and, with ``--preset paper_shakespeare``, Table 7. Beside papers/003's rows,
FedRolex (``fedrolex``, rolling sub-models, Alam et al. 2022). The variants are the rows the registered
methods declare (``Strategy.confound_variants``), so a new sub-model method joins without editing this file.

Default preset ``confound_laptop``: real MNIST (../shared/data/mnist, 20,000 training images)
Dirichlet(0.3) over 20 clients, p_max tiers 7 x 0.25 / 7 x 0.5 / 3 x 0.75 / 3 x 1.0 (our split: the
paper gives only the mean 0.525), 10 clients
per round, cnn_small at half width, 50 rounds, papers/003 section 4.1's optimiser and HAS-FL settings.
Runs under Ray Tune (``sweeps.study``; ``--resume`` continues a killed sweep). Prints
``analysis.confound.report`` at the end (Tables 3-6 and the Figure 6 frontier, written as
``frontier.png`` in the results folder when it is local);
``analysis/notebooks/capacity_confound.ipynb`` plots allocations and estimates.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis` from a source checkout

from analysis.confound import report  # noqa: E402
from fedsap_ray import algorithms  # noqa: E402
from sweeps.study import study_main  # noqa: E402

# papers/003's row order (Tables 3, 4 and 6); a method that declares rows later follows, in registry order
PAPER_ORDER = ("hasfl", "hasfl-nocov", "random_budget", "heterofl", "fjord", "uniform", "fedavg", "fedprox", "scaffold")


def variants() -> dict[str, list[str]]:
    """Every row a registered method declares (``Strategy.confound_variants``, read from its own class body), so
    a sub-model method joins the study without editing this file; papers/003's rows first, in its order."""
    rows: dict[str, list[str]] = {}
    for name in algorithms.names():
        for variant, overrides in vars(algorithms.get(name)).get("confound_variants", {}).items():
            if variant in rows:
                raise ValueError(f"capacity-confound variant {variant!r} is declared twice (second: {name})")
            rows[variant] = [f"algorithm.name={name}", *overrides]
    order = {v: i for i, v in enumerate(PAPER_ORDER)}
    return dict(sorted(rows.items(), key=lambda kv: order.get(kv[0], len(order))))


VARIANTS = variants()
STUDY = "capacity_confound"
DEFAULT_PRESET = "confound_laptop"
SMOKE = ["training.rounds=4"]  # past HAS-FL's smoke warm-up: adaptation steps at rounds 2-4


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study=STUDY, default_preset=DEFAULT_PRESET,
                      smoke=SMOKE, report=_report)


def _report(out: str) -> str:
    local = "://" not in out
    return report(out, frontier_png=Path(out) / "frontier.png" if local else None)


if __name__ == "__main__":
    raise SystemExit(main())
