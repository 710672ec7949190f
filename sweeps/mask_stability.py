"""FedSAP's mask stability study (docs/studies/mask-stability.md): which reading of line 14 lets a narrow
client deploy what it trained without losing the coverage that moving masks bought.

    python sweeps/mask_stability.py --out runs/mask_stability --seeds 0 1 2   # laptop preset, 42 trials
    python sweeps/mask_stability.py --smoke-test                                # minutes on 2 cores

Seven readings, each with every stability option pinned (so the study means the same after FedSAP's
defaults change), crossed with the DGA signal (``dga_source`` train / probe):

- ``today``: the selection before this study (utilities re-ranked from scratch every round, only
  the dispersion EMA-smoothed);
- ``ema``: beta_EMA also smooths each client's utilities and the layer utilities (Appendix C);
- ``ema-hysteresis``: ``ema`` plus a margin of 0.1 a candidate must beat a held channel by;
- ``ema-budget``: ``ema`` plus at most 10% of a client's active channels swapped per round;
- ``pooled``: ``ema`` with every client ranking by the one federation estimate;
- ``pooled-budget``: ``pooled`` under the 10% swap budget (added after seed 0: ``pooled`` had the best
  deployed and worst-client figures but swapped 13.5% at keep 0.2);
- ``fixed``: today's selection, masks frozen at the end of warm-up (the paper's reference setting).

The margin (0.1) and the budget share (0.1, the issue's target) were fixed before the study ran.
Prints the study's table (``analysis.stability``) at the end.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis`/`sweeps` from a source checkout

from analysis.stability import report as stability_report  # noqa: E402
from fedsap_ray import results  # noqa: E402
from sweeps.study import study_main  # noqa: E402

TODAY = ["algorithm.name=fedsap", "algorithm.smoothing=dispersion", "algorithm.stability=none",
         "algorithm.ranking=client", "algorithm.masks=dynamic"]
EMA = [*TODAY, "algorithm.smoothing=statistics"]
READINGS: dict[str, list[str]] = {
    "today": TODAY,
    "ema": EMA,
    "ema-hysteresis": [*EMA, "algorithm.stability=hysteresis", "algorithm.margin=0.1"],
    "ema-budget": [*EMA, "algorithm.stability=swap_budget", "algorithm.swap_budget=0.1"],
    "pooled": [*EMA, "algorithm.ranking=pooled"],
    "pooled-budget": [*EMA, "algorithm.ranking=pooled", "algorithm.stability=swap_budget", "algorithm.swap_budget=0.1"],
    "fixed": [*TODAY, "algorithm.masks=fixed"],
}
VARIANTS = {f"{name}-{source}": [*ov, f"algorithm.dga_source={source}"]
            for source in ("train", "probe") for name, ov in READINGS.items()}
STUDY = "mask_stability"
DEFAULT_PRESET = "laptop"
SMOKE: list[str] = []


def report(out: str) -> str:
    return stability_report(results.load(out))


def main(argv: list[str] | None = None) -> int:
    return study_main(argv, doc=__doc__, variants=VARIANTS, study=STUDY, default_preset=DEFAULT_PRESET,
                      smoke=SMOKE, report=report)


if __name__ == "__main__":
    raise SystemExit(main())
