"""``python -m analysis.confound OUT``: the command-line entry point of :func:`analysis.confound.report.report`."""
from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence

from analysis.confound.report import CONTROLS, report
from analysis.runs import open_or_exit


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m analysis.confound OUT [--png FIGURE.png]``: print :func:`report` of a results folder."""
    from fedsap_ray.cli import OneLineParser

    ap = OneLineParser(prog="python -m analysis.confound", description=main.__doc__)
    ap.add_argument("results", help="results folder (runs/, rounds/, clients/, allocations/): a path or a URI "
                    "(file://..., s3://...)")
    ap.add_argument("--png", type=Path, default=None, help="also write the Figure 6 frontier here")
    ap.add_argument("--all", action="store_true", help="include runs that did not finish")
    ap.add_argument("--control", choices=CONTROLS, default="tiers",
                    help="how Table 5's partial correlations control for p_max: tier dummies (default) or linear")
    args = ap.parse_args(argv)
    # a missing, empty, foreign or damaged folder: one line and exit 2 (give the --out folder of
    # sweeps/capacity_confound.py or of fedsap-ray run)
    res = open_or_exit(args.results, "analysis.confound")
    print(report(res, finished_only=not args.all, frontier_png=args.png, control=args.control))
