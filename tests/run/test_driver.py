"""The one driver loop (fedsap_ray.run.driver): callbacks see every durable round, stop or break the runs
with the right status, drive resumed sessions in lockstep, and read progress through SessionMetrics."""
from __future__ import annotations

import pandas as pd
import pyarrow.parquet as pq
import pytest

from fedsap_ray import results
from fedsap_ray.persist import checkpoint
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.run.driver import DriverCallback, drive
from fedsap_ray.common.errors import RunStopped
from fedsap_ray.experiment import run_experiment
from fedsap_ray.runtime.local import LocalBackend
from fedsap_ray.run.session import RunSession

TINY = ["algorithm.name=fedavg", "data.num_clients=4", "data.max_test_per_domain=40", "model.width_mult=0.0625",
        "training.rounds=3", "training.local_epochs=1", "training.batch_size=16", "training.max_steps_per_epoch=3"]


@pytest.fixture(scope="module")
def fed():
    return build_federation(build_config(preset="smoke", overrides=TINY))


def _cfg(*extra):
    return build_config(preset="smoke", overrides=[*TINY, *extra])


def _row(out, run_id):
    return pq.read_table(out / "runs" / f"{run_id}.parquet").to_pylist()[0]


class Recorder(DriverCallback):
    """Records every hook call; ``stop_at``/``raise_at``: raise RunStopped / an error after that round."""

    def __init__(self, out=None, stop_at=None, raise_at=None):
        self.out, self.stop_at, self.raise_at = out, stop_at, raise_at
        self.calls: list = []

    def on_start(self, metrics):
        self.calls.append(("start", [m.round for m in metrics], [m.workers for m in metrics]))

    def on_round(self, t, summaries, metrics):
        # the round is durable when the callbacks see it: its checkpoint is on disk already
        ck = [checkpoint.load(self.out, m.run_id)["state"].round for m in metrics] if self.out else None
        self.calls.append(("round", t, [s.round for s in summaries], [m.round for m in metrics], ck))
        if t == self.stop_at:
            raise RunStopped(f"enough after round {t}")
        if t == self.raise_at:
            raise KeyboardInterrupt

    def on_finish(self, outcomes):
        self.calls.append(("finish", [o.status for o in outcomes]))


def test_a_callback_stops_the_run_with_status_stopped_and_sees_each_round_once_durable(tmp_path, fed):
    rec = Recorder(out=tmp_path, stop_at=2)
    outcome = run_experiment(_cfg(), tmp_path, run_id="s", federation=fed, callbacks=[rec])
    assert outcome.status == "stopped"  # returned, not raised
    assert rec.calls == [("start", [0], [()]), ("round", 1, [1], [1], [1]), ("round", 2, [2], [2], [2]),
                         ("finish", ["stopped"])]
    row = _row(tmp_path, "s")
    assert (row["status"], row["error"], row["rounds_done"]) == ("stopped", "enough after round 2", 2)
    assert sorted(results.load(tmp_path).rounds["round"].unique()) == [1, 2]


def test_progress_and_callbacks_both_run_in_order(tmp_path, fed):
    seen = []

    class Tag(DriverCallback):
        def on_round(self, t, summaries, metrics):
            seen.append(("callback", t))

    run_experiment(_cfg(), tmp_path, run_id="p", federation=fed, progress=lambda s: seen.append(("progress", s.round)),
                   callbacks=[Tag()])
    assert seen == [(k, t) for t in (1, 2, 3) for k in ("progress", "callback")]


def test_session_metrics_report_what_the_runs_row_and_summaries_say(tmp_path, fed):
    summaries, views = [], []

    class Keep(DriverCallback):
        def on_round(self, t, s, metrics):
            summaries.extend(s)
            views.extend(metrics)

    run_experiment(_cfg("training.eval_deployed=true"), tmp_path, run_id="m", federation=fed, callbacks=[Keep()])
    assert [v.round for v in views] == [1, 2, 3] and {v.rounds for v in views} == {3} and {v.run_id for v in views} == {"m"}
    for s, v in zip(summaries, views):
        assert (v.global_accuracy, v.best_global_accuracy, v.deployed_accuracy) == (
            s.global_accuracy, s.best_global_accuracy, s.deployed_accuracy)
    assert views[-1].deployed_accuracy is not None
    row = _row(tmp_path, "m")
    assert (row["final_global_accuracy"], row["best_global_accuracy"]) == (views[-1].global_accuracy,
                                                                          views[-1].best_global_accuracy)


def test_lockstep_sessions_step_only_the_rounds_each_still_needs(tmp_path, fed):
    """A resumed session (2 rounds done) and a fresh one: round 1 and 2 run the fresh one alone, round 3 both;
    the resumed run's tables equal an uninterrupted run's."""
    cfg = _cfg()
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", run_id="a", federation=fed, callbacks=[Recorder(raise_at=2)])
    assert _row(tmp_path / "cut", "a")["status"] == "interrupted"
    sessions = [RunSession(cfg, tmp_path / "cut", "a", backend=LocalBackend("cpu"), federation=fed, resume=True),
                RunSession(cfg, tmp_path / "cut", "b", backend=LocalBackend("cpu"), federation=fed)]
    rec = Recorder()
    outcomes = drive(sessions, 3, [rec])
    assert [o.status for o in outcomes] == ["finished", "finished"]
    assert rec.calls == [("start", [2, 0], [(), ()]), ("round", 1, [1], [2, 1], None), ("round", 2, [2], [2, 2], None),
                         ("round", 3, [3, 3], [3, 3], None), ("finish", ["finished", "finished"])]
    run_experiment(cfg, tmp_path / "whole", run_id="a", federation=fed)
    cut, whole = results.load(tmp_path / "cut"), results.load(tmp_path / "whole")
    key = ["round", "domain", "eval_mode"]
    drop = list(results.WALL_CLOCK)
    pd.testing.assert_frame_equal(
        cut.rounds[cut.rounds["run_id"] == "a"].drop(columns=drop, errors="ignore").sort_values(key).reset_index(drop=True),
        whole.rounds.drop(columns=drop, errors="ignore").sort_values(key).reset_index(drop=True))


def test_a_run_killed_after_its_last_checkpoint_resumes_to_finished_without_training(tmp_path, fed):
    """The window between the last round's checkpoint and the close: the resume has nothing left to train,
    closes the run ``finished`` and removes the checkpoint."""
    cfg = _cfg()
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path, run_id="k", federation=fed, callbacks=[Recorder(raise_at=3)])
    before = _row(tmp_path, "k")
    assert (before["status"], before["rounds_done"]) == ("interrupted", 3)
    rounds_before = results.load(tmp_path).rounds
    rec = Recorder()
    outcome = run_experiment(cfg, tmp_path, run_id="k", federation=fed, resume=True, callbacks=[rec])
    assert outcome.status == "finished" and rec.calls == [("start", [3], [()]), ("finish", ["finished"])]
    assert _row(tmp_path, "k")["rounds_done"] == 3 and not checkpoint.path_for(tmp_path, "k").exists()
    pd.testing.assert_frame_equal(results.load(tmp_path).rounds, rounds_before)


def test_an_error_in_one_lockstep_session_closes_every_session_failed(tmp_path, fed, monkeypatch):
    cfg = _cfg()
    sessions = [RunSession(cfg, tmp_path, rid, backend=LocalBackend("cpu"), federation=fed) for rid in ("x", "y")]
    real = sessions[1].step

    def breaks_in_round_2(t):
        if t == 2:
            raise RuntimeError("boom")
        return real(t)

    monkeypatch.setattr(sessions[1], "step", breaks_in_round_2)
    rec = Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        drive(sessions, 3, [rec])
    assert rec.calls[-1] == ("finish", ["failed", "failed"])
    for rid in ("x", "y"):
        row = _row(tmp_path, rid)
        assert row["status"] == "failed" and row["error"].startswith("RuntimeError: boom")
