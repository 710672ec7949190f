"""The learning check (issue 43): every registered algorithm x 3 seeds x 5 rounds on a small federation with
strong domain shift, then ``analysis.learning`` flags every run whose training loss does not fall or whose
accuracy stays at chance, so the next collapsed baseline is found by us rather than by a study.

    python sweeps/learning_check.py --smoke-test --workers-per-trial 0   # what the integration tier runs
    python -m analysis.learning runs/learning_check                    # exit 1 when a run is flagged

The federation (:data:`LEARN`, the same with or without ``--smoke-test``, which also keeps the three seeds):
the smoke preset's embedded four-domain digits (MNIST, UCI digits, rendered street numbers and synthetic
digits: strong domain shift) at one client per domain (capacities 1/.8/.6/.4, so every sub-model rule is
exercised), 5% of each domain's training set per client (72-200 samples), ResNet10 at 1/8 width, 5 rounds of 2
full local epochs (no step cap), 60 test images per domain, the models evaluated at round 5 only (the check reads
the last round's accuracy and every round's training loss, which every round records; evaluation trains nothing,
so the numbers are those of an every-round evaluation, a fifth of a trial's time saved).
Small enough for CI, large enough that a healthy method's loss falls and one of its models leaves chance in five
rounds (FedAvg seed 0: training loss 2.24 -> 1.59, deployed 42% at round 5; FedDrop, whose full-width model
stays near chance, 30% deployed). Every algorithm runs at its defaults: the point is the methods as they ship.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis`/`sweeps` from a source checkout

from analysis.learning import report as learning_report, run_verdicts  # noqa: E402
from fedsap_ray import algorithms  # noqa: E402
from sweeps.main_comparison import SETTINGS  # noqa: E402
from sweeps.study import study_main  # noqa: E402

# the federation of every trial (module docstring); under --smoke-test these come after the smoke base's settings
LEARN = ["data.num_clients=4", "data.client_fraction=0.05", "data.max_test_per_domain=60", "model.width_mult=0.125",
         "training.rounds=5", "training.local_epochs=2", "training.max_steps_per_epoch=null",
         "training.eval_every=5", "training.deployed_every=5"]
# one variant per registered algorithm at its Table 1 settings (sweeps/main_comparison.py: FedProx within capacity)
VARIANTS = {name: [f"algorithm.name={name}", *SETTINGS.get(name, []), *LEARN] for name in algorithms.names()}
STUDY = "learning_check"
DEFAULT_PRESET = "smoke"
SMOKE = LEARN
SEEDS = 3  # --smoke-test keeps three seeds: a collapse may show on one seed only (issue 43: MOON seed 2)


def report(out: str) -> str:
    return learning_report(run_verdicts(out))


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study=STUDY, default_preset=DEFAULT_PRESET,
                      smoke=SMOKE, report=report, smoke_seeds=SEEDS)


if __name__ == "__main__":
    raise SystemExit(main())
