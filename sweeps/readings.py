"""The authors'-code readings study (issue 55, docs/studies/readings.md): do our conclusions about HeteroFL,
FjORD and FedRolex change when each runs as its authors' code runs it rather than as we read the papers?

    python sweeps/readings.py --out runs/readings --seeds 0 1 2 --max-concurrent 2 --workers-per-trial 0
    python -m analysis.readings runs/readings          # the study's tables (also printed at the end)

The laptop federation at its defaults (25 rounds, ResNet10 at 1/4 width, the deployed models every 5th round),
one variant per reading, every option of the method pinned so the study means the same after a default moves:

- ``heterofl``: our default (each coordinate averaged over its holders by samples; classifier unmasked);
- ``heterofl-count``: the authors' count weighting alone (``weighting=count``);
- ``heterofl-authors``: the authors' code (``weighting=count``, ``label_mask=true``);
- ``fjord``: our default, papers/003 section 4.2 (one random tier at or below p_max per round, shared BatchNorm);
- ``fjord-batch``: Flower's per-step widths and p_max upload with our shared BatchNorm (``od_sampling=batch``);
- ``fjord-authors``: Flower's baseline (``od_sampling=batch``, ``od_bn=per_width``);
- ``fedrolex``: the authors' rolling window (``direction=backward``, our default);
- ``fedrolex-paper``: the paper's section 3 window (``direction=forward``).

The measures were fixed before the study ran (analysis/readings.py :data:`~analysis.readings.MEASURES`).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis`/`sweeps` from a source checkout

from analysis.readings import report as readings_report  # noqa: E402
from fedsap_ray import results  # noqa: E402
from sweeps.study import study_main  # noqa: E402

HETEROFL = ["algorithm.name=heterofl", "algorithm.weighting=samples", "algorithm.label_mask=false"]
FJORD = ["algorithm.name=fjord", "algorithm.od_sampling=round", "algorithm.od_bn=shared"]
VARIANTS: dict[str, list[str]] = {
    "heterofl": HETEROFL,
    "heterofl-count": [*HETEROFL, "algorithm.weighting=count"],
    "heterofl-authors": [*HETEROFL, "algorithm.weighting=count", "algorithm.label_mask=true"],
    "fjord": FJORD,
    "fjord-batch": [*FJORD, "algorithm.od_sampling=batch"],
    "fjord-authors": [*FJORD, "algorithm.od_sampling=batch", "algorithm.od_bn=per_width"],
    "fedrolex": ["algorithm.name=fedrolex", "algorithm.direction=backward"],
    "fedrolex-paper": ["algorithm.name=fedrolex", "algorithm.direction=forward"],
}
STUDY = "readings"
DEFAULT_PRESET = "laptop"
SMOKE: list[str] = []


def report(out: str) -> str:
    return readings_report(results.load(out))


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study=STUDY, default_preset=DEFAULT_PRESET,
                      smoke=SMOKE, report=report)


if __name__ == "__main__":
    raise SystemExit(main())
