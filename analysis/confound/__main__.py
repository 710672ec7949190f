"""``python -m analysis.confound OUT [--png F] [--all] [--control tiers|linear]`` (:func:`analysis.confound.cli.main`)."""
from analysis.confound.cli import main

main()
