"""Study scripts (``python sweeps/<study>.py``) and the machinery they share, one module per job:

- :mod:`sweeps.trials`: Tune's flat trial dict <-> typed configs, run ids, trial resources;
- :mod:`sweeps.trainable`: the Tune trainable, the one driver loop with Tune's callbacks;
- :mod:`sweeps.live`: the live progress line on the driver;
- :mod:`sweeps.tuner`: running trials under Tune and collecting the failures;
- :mod:`sweeps.study`: every script's command line, grids of variants x seeds, what is left to run.
"""
import os

# Tune's own console output is replaced by sweeps.live.LiveProgress (the old reporter honours
# verbose=0). Set here, before any module of the package can import Tune.
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
