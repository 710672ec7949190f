"""``python -m analysis.confound OUT``: the command-line entry point of :func:`analysis.confound.report.report`."""
from __future__ import annotations

import sys
from pathlib import Path
from collections.abc import Sequence

from analysis.confound.report import CONTROLS, report


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m analysis.confound OUT [--png FIGURE.png]``: print :func:`report` of a results folder."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("results", type=Path, help="results folder (runs/, rounds/, clients/, allocations/)")
    ap.add_argument("--png", type=Path, default=None, help="also write the Figure 6 frontier here")
    ap.add_argument("--all", action="store_true", help="include runs that did not finish")
    ap.add_argument("--control", choices=CONTROLS, default="tiers",
                    help="how Table 5's partial correlations control for p_max: tier dummies (default) or linear")
    args = ap.parse_args(argv)
    folder = str(args.results)
    if "://" not in folder and not args.results.is_dir():
        print(f"analysis.confound: results={folder!r}: no such folder (give the --out folder of "
              "sweeps/capacity_confound.py or of fedsap-ray run)", file=sys.stderr)
        raise SystemExit(2)
    print(report(args.results, finished_only=not args.all, frontier_png=args.png, control=args.control))

