"""The learning check (issue 43): flag every run that does not learn, so a collapsed baseline is found by us.

A run is flagged, with the reason, when

- it did not finish (``runs.status`` other than ``finished``: failed, interrupted, still running);
- its **training loss does not fall**: the round's sample-weighted mean local training loss
  (``rounds.train_loss`` of the ``__global__`` rows) at the last round is not below round ``from_round``'s
  (default 2) by at least ``min_drop`` of it (default 2%: ``last <= (1 - min_drop) * reference``), or is not
  finite;
- its **accuracy stays at chance**: at the last evaluated round, the best of its evaluated models'
  mean-over-domains accuracies (``rounds.accuracy`` of the ``__global__`` rows, every ``eval_mode``: the
  server's model, FedSAP's group models, FedSPU's personal ones, the deployed models) is at most
  chance + ``margin``, where chance = 1 / ``num_classes`` and the margin is absolute (default 0.05: with 10
  classes a run must reach more than 15%).

Readings (ours; the issue asks for "training loss does not fall or accuracy stays at chance"):

- *The last round against round 2*: round 2 is the first round in which every method's whole objective is
  in force. A method whose local loss gains terms built from round 1's results starts from a smaller
  objective in round 1: FPL's prototype terms begin in round 2 (on the learning-check federation its loss goes
  2.24 -> 4.47 -> 3.76 over rounds 1, 2, 5 while its model learns), and MOON's round 1 holds a constant
  mu * log 2 with zero gradient (no previous model yet), which later rounds shrink without learning anything
  (its collapsed run of issue 43 fell from 5.75 in round 1 to 4.2 in round 2, then stayed there at chance).
  A learning run's loss may still rise for a round (a FedSAP adaptation step); one that ends no lower than
  round 2 did not learn. 2%: SCAFFOLD, the slowest to lower its loss there, falls by about 5% over rounds 2-5.
  A falling loss alone does not prove learning, which is why the accuracy is checked too.
- *Tuned for five rounds*: chance + 5 points at the final round, 2% of loss, are what a healthy method clears
  on the learning-check federation in 5 rounds. A long run that collapsed may creep above them: MOON's
  collapsed device-time run (issue 43) ended at 21.3% deployed after 25 rounds, its loss 4.20 -> 4.06 over
  rounds 2-25, and passes; judged on its first five rounds (``upto_round=5``, ``--upto-round 5``) it is
  flagged on both counts (loss 4.20 -> 4.23, 11.4% deployed at round 5).
- *The final round's best model*: a run that rose and then fell back to chance (a collapse) is flagged;
  the best evaluated model, not the server's, because a sub-model method's full-width model may stay near
  chance on domains only narrow clients hold while every device's own model learns (docs/studies/fedsap-table1.md).
- *num_classes* is not recorded in the results (the runs table names the dataset only): it is an argument,
  10 by default, the class count of every dataset of our studies (digits, embedded digits, Office-Caltech10,
  CIFAR-10); give ``--num-classes`` for another.

``python -m analysis.learning FOLDER [FOLDER ...] [--num-classes N] [--margin M] [--min-drop F] [--from-round R]``
prints one line per run and exits 1 when some run is flagged (naming run, algorithm, seed and why), 0 when none is, 2 on
bad input. The integration tier runs it on the ``learning_check`` smoke sweep (every algorithm x 3 seeds x 5
rounds: sweeps/learning_check.py).
"""
from __future__ import annotations

import math
import sys
from typing import Any

import pandas as pd

from analysis import runs
from fedsap_ray import results
from fedsap_ray.cli import OneLineParser

NUM_CLASSES = 10  # the class count of every dataset of our studies (module docstring)
MARGIN = 0.05  # absolute accuracy above chance a run must exceed at its last evaluated round
MIN_DROP = 0.02  # share of round FROM_ROUND's training loss the last round must be below it by
FROM_ROUND = 2  # the reference round of the training loss (module docstring: the first with every objective whole)

COLUMNS = ["run_id", "algorithm", "seed", "reason"]


def chance(num_classes: int) -> float:
    """Top-1 accuracy of a guess: 1 / num_classes."""
    return 1.0 / num_classes


def _check_args(num_classes: int, margin: float, min_drop: float, from_round: int = FROM_ROUND) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"invalid num_classes={num_classes!r}: must be an integer >= 2")
    if not 0 <= margin < 1 - chance(num_classes):
        raise ValueError(f"invalid margin={margin!r}: must be >= 0 and below 1 - 1/num_classes")
    if not 0 <= min_drop < 1:
        raise ValueError(f"invalid min_drop={min_drop!r}: must be in [0, 1)")
    if isinstance(from_round, bool) or not isinstance(from_round, int) or from_round < 1:
        raise ValueError(f"invalid from_round={from_round!r}: must be an integer >= 1")


def run_verdicts(res: Any, *, num_classes: int = NUM_CLASSES, margin: float = MARGIN,
                 min_drop: float = MIN_DROP, from_round: int = FROM_ROUND, upto_round: int | None = None) -> pd.DataFrame:
    """One row per run of ``res`` (a results folder or a loaded one): ``run_id, algorithm, seed, first_loss``
    (round ``from_round``'s), ``last_loss, final_round, best_final_accuracy, best_final_mode, flagged, reason``
    (``reason`` empty when the run passes; several reasons joined by "; "). The rules: module docstring.
    ``upto_round``: judge only rounds 1..upto_round (a long run judged as the 5-round sweep would judge it)."""
    _check_args(num_classes, margin, min_drop, from_round)
    if upto_round is not None and (isinstance(upto_round, bool) or not isinstance(upto_round, int)
                                   or upto_round <= from_round):
        raise ValueError(f"invalid upto_round={upto_round!r}: must be an integer above from_round={from_round}")
    res = runs.load_sweep(res)
    rounds = runs.table(res, "rounds")
    glob = rounds[rounds["domain"] == results.GLOBAL_DOMAIN] if len(rounds) else rounds
    if upto_round is not None and len(glob):
        glob = glob[glob["round"] <= upto_round]
    threshold = chance(num_classes) + margin
    out = []
    for _, run in runs.table(res, "runs").iterrows():
        rid = run["run_id"]
        g = glob[glob["run_id"] == rid]
        reasons = []
        if run.get("status") != "finished":
            reasons.append(f"status {run.get('status')!r}, not finished")
        loss = g.dropna(subset=["train_loss"]).groupby("round")["train_loss"].first().sort_index()
        loss = loss[loss.index >= from_round]
        first = float(loss.iloc[0]) if len(loss) else math.nan
        last = float(loss.iloc[-1]) if len(loss) else math.nan
        if len(loss) < 2:
            reasons.append(f"training loss recorded in {len(loss)} round(s) from round {from_round} on: cannot tell "
                           "whether it falls")
        elif not (math.isfinite(first) and math.isfinite(last)):
            reasons.append(f"training loss not finite (round {loss.index[0]}: {first}, round {loss.index[-1]}: {last})")
        elif not last <= (1 - min_drop) * first:
            reasons.append(f"training loss does not fall: {first:.3f} at round {loss.index[0]}, {last:.3f} at round "
                           f"{loss.index[-1]} (must end at least {min_drop:.0%} lower)")
        evaluated = g[g["evaluated"].fillna(False).astype(bool)].dropna(subset=["accuracy"]) if len(g) else g
        final_round, best, mode = None, math.nan, None
        if len(evaluated):
            final_round = int(evaluated["round"].max())
            at = evaluated[evaluated["round"] == final_round]
            top = at.loc[at["accuracy"].astype(float).idxmax()]
            best, mode = float(top["accuracy"]), str(top["eval_mode"])
            if not best > threshold:
                reasons.append(f"accuracy at chance: best model ({mode}) {best:.1%} at round {final_round}, "
                               f"chance {chance(num_classes):.1%} + margin {margin:.1%}")
        else:
            reasons.append("no evaluated round: accuracy unknown")
        out.append(dict(run_id=rid, algorithm=run.get("algorithm"), seed=run.get("seed"), first_loss=first,
                        last_loss=last, final_round=final_round, best_final_accuracy=best, best_final_mode=mode,
                        flagged=bool(reasons), reason="; ".join(reasons)))
    cols = ["run_id", "algorithm", "seed", "first_loss", "last_loss", "final_round", "best_final_accuracy",
            "best_final_mode", "flagged", "reason"]
    return pd.DataFrame(out, columns=cols).sort_values(["algorithm", "seed", "run_id"], ignore_index=True)


def flagged_runs(res: Any, **kwargs: Any) -> pd.DataFrame:
    """The runs :func:`run_verdicts` flags: ``run_id, algorithm, seed, reason`` (empty when every run learns)."""
    v = run_verdicts(res, **kwargs)
    return v.loc[v["flagged"], COLUMNS].reset_index(drop=True)


def report(verdicts: pd.DataFrame) -> str:
    """One line per run (``ok`` or ``FLAGGED`` with the reason), then how many runs were flagged."""
    lines = []
    for _, v in verdicts.iterrows():
        head = f"{v['run_id']} ({v['algorithm']}, seed {v['seed']})"
        if v["flagged"]:
            lines.append(f"FLAGGED {head}: {v['reason']}")
        else:
            lines.append(f"ok      {head}: training loss {v['first_loss']:.3f} -> {v['last_loss']:.3f}, best model "
                         f"({v['best_final_mode']}) {v['best_final_accuracy']:.1%} at round {int(v['final_round'])}")
    n = int(verdicts["flagged"].sum())
    lines.append(f"{n} of {len(verdicts)} runs flagged" if n else f"every run learns ({len(verdicts)} runs)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m analysis.learning FOLDER [FOLDER ...] [--num-classes N] [--margin M] [--min-drop F]
    [--from-round R]``: flag the runs that do not learn; exit 1 when some run is flagged."""
    p = OneLineParser(prog="python -m analysis.learning", description=main.__doc__)
    p.add_argument("folders", nargs="+", metavar="FOLDER", help="results folders (a sweep's or a run's --out)")
    p.add_argument("--num-classes", type=int, default=NUM_CLASSES,
                   help=f"classes of the runs' dataset: chance is 1/N (default {NUM_CLASSES})")
    p.add_argument("--margin", type=float, default=MARGIN,
                   help=f"accuracy above chance a run must exceed at its last evaluated round (default {MARGIN})")
    p.add_argument("--min-drop", type=float, default=MIN_DROP,
                   help=f"share by which the last round's training loss must be below the reference round's "
                        f"(default {MIN_DROP})")
    p.add_argument("--from-round", type=int, default=FROM_ROUND,
                   help=f"the reference round of the training loss (default {FROM_ROUND})")
    p.add_argument("--upto-round", type=int, default=None,
                   help="judge only rounds 1..R (a long study's runs as the 5-round sweep would judge them)")
    args = p.parse_args(argv)
    if args.num_classes < 2:
        p.error(f"invalid --num-classes={args.num_classes}: must be an integer >= 2")
    if not 0 <= args.margin < 1 - chance(args.num_classes):
        p.error(f"invalid --margin={args.margin}: must be >= 0 and below 1 - 1/num-classes")
    if not 0 <= args.min_drop < 1:
        p.error(f"invalid --min-drop={args.min_drop}: must be in [0, 1)")
    if args.from_round < 1:
        p.error(f"invalid --from-round={args.from_round}: must be an integer >= 1")
    if args.upto_round is not None and args.upto_round <= args.from_round:
        p.error(f"invalid --upto-round={args.upto_round}: must be above --from-round={args.from_round}")
    prog = "analysis.learning"
    verdicts = pd.concat([run_verdicts(runs.open_or_exit(f, prog), num_classes=args.num_classes, margin=args.margin,
                                       min_drop=args.min_drop, from_round=args.from_round,
                                       upto_round=args.upto_round) for f in args.folders],
                         ignore_index=True)
    print(report(verdicts))
    return 1 if verdicts["flagged"].any() else 0


if __name__ == "__main__":
    sys.exit(main())
