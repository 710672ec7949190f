"""What client-level DP costs each capacity tier (issue 57, item 4; docs/studies/privacy.md).

    python sweeps/privacy.py --out runs/privacy --seeds 0 1 2 --workers-per-trial 0   # 16 variants x 3 seeds
    python sweeps/privacy.py --smoke-test --workers-per-trial 0                       # every variant, seconds each

Design, fixed before the runs (the page gives the reasons):

- the ``laptop`` preset's capacities (cyclic pruning ratios 0/.2/.4/.6/.8: tiers of keep 1/.8/.6/.4/.2, client i
  in tier i mod 5) over a federation of **300 clients** of the embedded four-domain digits (domain partition, 1% of
  its domain's training pool each: 40 images, 14 on uci_digits), 30 clients a round (participation 0.1), 10 rounds
  of 3 local epochs at batch 16, lr 0.05; ``cnn_small`` at width 0.25 (11,642 parameters); 200 test images a
  domain; the deployed models of a seeded 40 clients evaluated at the last round and kept with the final model;
- FedAvg, HeteroFL and FjORD at epsilon = infinity (privacy off) and, under central DP, epsilon 8 and 2 (delta
  1/300, the default; ``target_epsilon`` calibrates sigma for the 10 rounds), each with ``denominator`` cohort and
  coverage, clip norm C = 0.75 (the median ``clients.dp_update_norm``, 0.76, of one HeteroFL pilot at sigma 0 and
  C = 1000, not part of the results); FedSAP at epsilon = infinity only: privacy refuses it by name (its masks come
  from the channel statistics its clients upload, which no mechanism here covers).

Prints the study's tables (``analysis.privacy``) at the end; the per-tier deployed accuracies are computed from the
kept final models (``python -m analysis.privacy OUT``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis`/`sweeps` from a source checkout

from analysis.privacy import report as privacy_report  # noqa: E402
from sweeps.study import study_main  # noqa: E402

BASE = ["data.name=embedded_digits", "data.partition=domain", "data.num_clients=300", "data.client_fraction=0.01",
        "data.max_test_per_domain=200", "model.name=cnn_small", "model.width_mult=0.25",
        "training.participation=0.1", "training.rounds=10", "training.local_epochs=3", "training.batch_size=16",
        "training.lr=0.05", "training.eval_clients=40", "training.deployed_every=10", "training.keep_model=final"]
CLIP_NORM = 0.75  # the pilot's median update norm (0.76), docs/studies/privacy.md#design-fixed-before-the-runs
METHODS = ("fedavg", "heterofl", "fjord")  # privacy-supported
EPSILONS = (8, 2)
DENOMINATORS = ("cohort", "coverage")


def variants() -> dict[str, list[str]]:
    """``<method>-inf`` (privacy off, FedSAP too) and ``<method>-eps<E>-<denominator>`` (central DP)."""
    out = {f"{m}-inf": [*BASE, f"algorithm.name={m}"] for m in (*METHODS, "fedsap")}
    for m in METHODS:
        for eps in EPSILONS:
            for den in DENOMINATORS:
                out[f"{m}-eps{eps}-{den}"] = [*BASE, f"algorithm.name={m}", "privacy.mode=central",
                                              f"privacy.target_epsilon={eps}", f"privacy.clip_norm={CLIP_NORM}",
                                              f"privacy.denominator={den}"]
    return out


VARIANTS = variants()
STUDY = "privacy"
DEFAULT_PRESET = "laptop"
SMOKE = ["data.num_clients=20"]  # 2 clients a round: seconds a trial


def report(out: str) -> str:
    return privacy_report(out)


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study=STUDY, default_preset=DEFAULT_PRESET,
                      smoke=SMOKE, report=report)


if __name__ == "__main__":
    raise SystemExit(main())
