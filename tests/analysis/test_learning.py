"""analysis.learning (issue 43): the learning check on synthetic results tables, and its command line."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from analysis import learning
from fedsap_ray import results

G = results.GLOBAL_DOMAIN
REPO = Path(__file__).resolve().parents[2]


def _run(run_id: str, losses, accs, *, algorithm: str = "fedavg", seed: int = 0, status: str = "finished",
         deployed=None, domain_acc: float = 0.9):
    """The runs row and ``rounds`` rows of one synthetic run: round t's global row holds ``losses[t-1]`` and
    ``accs[t-1]`` (None: not evaluated), the deployed row ``deployed[t-1]``; a per-domain row with accuracy
    ``domain_acc`` (never read: only the global rows count)."""
    rows = []
    for t, (loss, acc) in enumerate(zip(losses, accs), start=1):
        rows.append(dict(run_id=run_id, round=t, domain=G, eval_mode="global", evaluated=acc is not None,
                         accuracy=acc, train_loss=loss))
        rows.append(dict(run_id=run_id, round=t, domain="mnist", eval_mode="global", evaluated=acc is not None,
                         accuracy=domain_acc, train_loss=loss))
        if deployed is not None and deployed[t - 1] is not None:
            rows.append(dict(run_id=run_id, round=t, domain=G, eval_mode="deployed", evaluated=True,
                             accuracy=deployed[t - 1], train_loss=loss))
    run = dict(run_id=run_id, algorithm=algorithm, seed=seed, status=status, label=algorithm)
    return run, rows


def _res(*made) -> SimpleNamespace:
    runs = pd.DataFrame([r for r, _ in made])
    rounds = pd.DataFrame([row for _, rows in made for row in rows])
    return SimpleNamespace(runs=runs, rounds=rounds, clients=None, layers=None, allocations=None)


FALLING = [2.3, 1.9, 1.5, 1.2, 1.0]


def test_a_falling_loss_above_chance_passes():
    res = _res(_run("fedavg-s0", FALLING, [0.2, 0.35, 0.5, 0.6, 0.7]))
    v = learning.run_verdicts(res)
    assert not v["flagged"].any() and v.loc[0, "reason"] == ""
    assert v.loc[0, "best_final_accuracy"] == 0.7 and v.loc[0, "final_round"] == 5
    assert learning.flagged_runs(res).empty


@pytest.mark.parametrize("losses", [[2.3, 2.3, 2.31, 2.3, 2.3], [2.3, 2.0, 2.4, 2.6, 2.35], [2.4, 2.3, 2.29, 2.27, 2.26],
                                    [1.2, 2.3, 2.0, 2.2, 2.3]])
def test_a_flat_or_rising_loss_is_flagged(losses):
    """Flat, rising, or falling by less than 2% of round 2's (2.3 -> 2.26 is 1.7%): flagged, accuracy or not."""
    flagged = learning.flagged_runs(_res(_run("fedprox-s1", losses, [0.3] * 5, algorithm="fedprox", seed=1)))
    assert flagged.to_dict("records") == [dict(run_id="fedprox-s1", algorithm="fedprox", seed=1,
                                               reason=flagged.loc[0, "reason"])]
    assert flagged.loc[0, "reason"].startswith(f"training loss does not fall: {losses[1]:.3f} at round 2, "
                                               f"{losses[-1]:.3f} at round 5 (must end at least 2% lower)")


def test_the_loss_is_read_from_round_2():
    """Round 2 is the reference: a loss that gains its method's extra terms in round 2 (FPL's prototypes) and falls
    from there passes; one that fell only from round 1 to 2 (MOON's constant first-round term) and then stays is
    flagged. ``from_round=1`` reads it from round 1."""
    fpl = _res(_run("fpl-s0", [2.24, 4.47, 4.35, 4.09, 3.76], [0.3] * 5, algorithm="fpl"))
    assert learning.flagged_runs(fpl).empty
    assert "does not fall" in learning.flagged_runs(fpl, from_round=1).loc[0, "reason"]
    moon = _res(_run("moon-s2", [5.75, 4.2, 4.52, 4.46, 4.23], [0.3] * 5, algorithm="moon", seed=2))
    assert learning.flagged_runs(moon).loc[0, "reason"].startswith("training loss does not fall: 4.200 at round 2")
    assert learning.flagged_runs(moon, from_round=1).empty
    v = learning.run_verdicts(_res(_run("r", FALLING, [0.3] * 5)))
    assert (v.loc[0, "first_loss"], v.loc[0, "last_loss"]) == (1.9, 1.0)


def test_chance_accuracy_is_flagged_with_the_stated_margin():
    """Chance = 1/num_classes; a run must end above chance + margin (default 0.05, absolute): at 10 classes 15%."""
    assert learning.chance(10) == 0.1 and learning.MARGIN == 0.05
    at = _res(_run("moon-s2", FALLING, [0.09, 0.1, 0.1, 0.11, 0.15], algorithm="moon", seed=2))
    just_above = _res(_run("moon-s2", FALLING, [0.09, 0.1, 0.1, 0.11, 0.1501], algorithm="moon", seed=2))
    flagged = learning.flagged_runs(at)
    assert list(flagged["run_id"]) == ["moon-s2"] and list(flagged["seed"]) == [2]
    assert flagged.loc[0, "reason"] == "accuracy at chance: best model (global) 15.0% at round 5, chance 10.0% + margin 5.0%"
    assert learning.flagged_runs(just_above).empty
    # the margin and the class count are arguments: 4 classes -> chance 25%
    assert not learning.flagged_runs(at, num_classes=4, margin=0.0).empty
    assert learning.flagged_runs(_res(_run("r", FALLING, [0.3] * 5)), num_classes=4, margin=0.0).empty


def test_the_final_round_decides_and_the_best_model_counts():
    """A run that learned and fell back to chance is flagged (a collapse); a server model at chance whose deployed
    models learned passes (the best evaluated model at the final evaluated round; unevaluated rounds skipped)."""
    collapsed = _res(_run("moon-s2", FALLING, [0.3, 0.5, 0.2, 0.1, 0.1]))
    assert "accuracy at chance" in learning.flagged_runs(collapsed).loc[0, "reason"]
    deployed = _res(_run("nefl-s0", FALLING, [0.1, 0.1, 0.1, 0.1, 0.1], deployed=[None, 0.3, None, None, 0.6]))
    v = learning.run_verdicts(deployed)
    assert not v["flagged"].any() and v.loc[0, "best_final_mode"] == "deployed"
    sparse = _res(_run("r", FALLING, [None, 0.5, None, 0.6, None]))  # last evaluated round: 4
    assert learning.run_verdicts(sparse).loc[0, "final_round"] == 4 and learning.flagged_runs(sparse).empty


def test_upto_round_judges_a_long_run_on_its_first_rounds():
    """MOON's collapsed device-time run in miniature: at chance for five rounds, then creeping to 21%: it passes at
    its last round and is flagged on its first five (upto_round=5); upto_round must exceed from_round."""
    losses = [5.75, 4.2, 4.52, 4.46, 4.23] + [4.1] * 19 + [4.06]
    accs = [0.1] * 5 + [0.12] * 19 + [0.213]
    res = _res(_run("moon-s2", losses, accs, algorithm="moon", seed=2))
    assert learning.flagged_runs(res).empty
    reason = learning.flagged_runs(res, upto_round=5).loc[0, "reason"]
    assert reason.startswith("training loss does not fall: 4.200 at round 2, 4.230 at round 5")
    assert "accuracy at chance: best model (global) 10.0% at round 5" in reason
    with pytest.raises(ValueError, match="invalid upto_round=2"):
        learning.run_verdicts(res, upto_round=2)


def test_unfinished_nan_and_unevaluated_runs_are_flagged():
    res = _res(_run("a-s0", FALLING, [0.5] * 5, status="failed"),
               _run("b-s0", [2.3, 2.0, math.nan, 1.5, math.inf], [0.5] * 5, algorithm="b"),
               _run("c-s0", FALLING, [None] * 5, algorithm="c"),
               _run("d-s0", [2.3], [0.5], algorithm="d"))
    reasons = dict(zip(*learning.flagged_runs(res)[["run_id", "reason"]].to_numpy().T))
    assert reasons["a-s0"] == "status 'failed', not finished"
    assert reasons["b-s0"].startswith("training loss not finite")  # NaN rounds skipped, the last one is inf
    assert reasons["c-s0"] == "no evaluated round: accuracy unknown"
    assert reasons["d-s0"].startswith("training loss recorded in 0 round(s) from round 2 on")


def test_several_reasons_are_joined_and_every_run_is_named():
    res = _res(_run("x-s0", [2.3] * 5, [0.1] * 5, algorithm="x"), _run("y-s1", FALLING, [0.6] * 5, algorithm="y", seed=1))
    f = learning.flagged_runs(res)
    assert list(f["run_id"]) == ["x-s0"]
    assert "training loss does not fall" in f.loc[0, "reason"] and "; accuracy at chance" in f.loc[0, "reason"]
    text = learning.report(learning.run_verdicts(res))
    assert text.splitlines()[0].startswith("FLAGGED x-s0 (x, seed 0): training loss does not fall")
    assert text.splitlines()[1].startswith("ok      y-s1 (y, seed 1)")
    assert text.splitlines()[-1] == "1 of 2 runs flagged"


@pytest.mark.parametrize("kwargs", [dict(num_classes=1), dict(num_classes=True), dict(margin=-0.1),
                                    dict(margin=0.9), dict(min_drop=1.0), dict(from_round=0)])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match="invalid " + next(iter(kwargs))):
        learning.run_verdicts(_res(_run("r", FALLING, [0.5] * 5)), **kwargs)


def test_command_line_exit_codes(tmp_path, capsys):
    """Exit 0 when every run learns, 1 naming run, algorithm, seed and reason when one does not, 2 on a bad folder
    or argument. The folder is a real results folder: one two-round smoke run at chance-level size."""
    from fedsap_ray.config import build_config
    from fedsap_ray.experiment import run_experiment

    cfg = build_config(preset="smoke", overrides=["algorithm.name=fedavg", "training.rounds=2", "model.width_mult=0.0625",
                                                  "data.max_test_per_domain=20", "training.max_steps_per_epoch=2"])
    run_experiment(cfg, tmp_path / "out", run_id="fedavg-s0")
    v = learning.run_verdicts(tmp_path / "out")
    assert list(v["run_id"]) == ["fedavg-s0"] and list(v["algorithm"]) == ["fedavg"] and list(v["seed"]) == [cfg.seed]
    lenient = ["--margin", "0", "--min-drop", "0", "--num-classes", "1000", "--from-round", "1"]  # above 0.1% passes
    code_lenient = learning.main([str(tmp_path / "out"), *lenient])
    out = capsys.readouterr().out
    assert (code_lenient == 0) == (not learning.run_verdicts(tmp_path / "out", num_classes=1000, margin=0.0,
                                                             min_drop=0.0, from_round=1)["flagged"].any())
    assert out.splitlines()[-1] in ("every run learns (1 runs)", "1 of 1 runs flagged")
    strict = learning.main([str(tmp_path / "out"), "--margin", "0.89"])  # must exceed 99%: flagged
    out = capsys.readouterr().out
    assert strict == 1 and out.startswith(f"FLAGGED fedavg-s0 (fedavg, seed {cfg.seed}): ") and "accuracy at chance" in out
    for argv in ([str(tmp_path / "missing")], [str(tmp_path / "out"), "--num-classes", "1"],
                 [str(tmp_path / "out"), "--margin", "0.95"], [str(tmp_path / "out"), "--min-drop", "1"],
                 [str(tmp_path / "out"), "--from-round", "0"], [str(tmp_path / "out"), "--upto-round", "2"]):
        with pytest.raises(SystemExit) as e:
            learning.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and "invalid --num-classes=1" in err and "invalid --min-drop=1.0" in err
    assert "invalid --from-round=0" in err and "invalid --upto-round=2" in err
    assert np.isfinite(v.loc[0, "first_loss"])


def test_the_learning_check_sweep_plans_every_algorithm_on_three_seeds_at_five_rounds(tmp_path, capsys):
    """``--smoke-test`` keeps three seeds (other studies keep one) and the learning-check federation: 5 rounds, full
    local epochs (the smoke base's step cap lifted). A dry run: nothing trained."""
    import importlib.util

    from fedsap_ray import algorithms

    spec = importlib.util.spec_from_file_location("sweep_learning_check", REPO / "sweeps" / "learning_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke-test", "--dry-run", "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"learning_check: {3 * len(algorithms.names())} trials, preset smoke, seeds [0, 1, 2]")
    assert lines[1].startswith(f"learning_check: keeps {3 * len(algorithms.names())} models")  # what it keeps, then the trials
    trials = [line for line in lines[2:] if line.startswith("  ")]
    assert sorted(t.split(":")[0].strip() for t in trials) == sorted(f"{a}-s{s}" for a in algorithms.names()
                                                                     for s in (0, 1, 2))
    for t in trials:
        assert "training.rounds=5" in t and "training.max_steps_per_epoch=null" in t and "data.num_clients=4" in t


# --- integration tier: the learning-check smoke sweep (sweeps/learning_check.py) --------------------------
def test_every_algorithm_learns_on_three_seeds(smoke_study, capsys):
    """Every registered algorithm x seeds 0-2 x 5 rounds on the four-domain federation: no run is flagged, and the
    command says so with exit 0 (it names run, algorithm, seed and reason otherwise). MOON, the baseline that
    collapsed under eval-mode frozen models (issue 43), learns on every seed at its default frozen_bn=train."""
    from fedsap_ray import algorithms

    out = smoke_study("learning_check")
    v = learning.run_verdicts(out)
    assert sorted(v["algorithm"].unique()) == sorted(algorithms.names())
    assert (v.groupby("algorithm")["seed"].apply(sorted).map(tuple) == (0, 1, 2)).all()
    assert (v["final_round"] == 5).all()
    code = learning.main([str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    moon = v[v["algorithm"] == "moon"]  # 2026-12-03: loss 4.73-4.89 -> 4.15-4.24 over rounds 2-5, deployed 20-28%
    assert (moon["last_loss"] < 0.92 * moon["first_loss"]).all(), moon
