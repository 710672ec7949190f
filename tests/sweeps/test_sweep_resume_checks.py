"""What a sweep's ``--resume`` checks before Ray starts (issue 52): a finished trial whose tables lack rows it wrote
(``runs.rows_written``) runs again from the start, deterministically, said in one line (a grid study) or is refused
(tune.py, whose Optuna trial is complete); more rows than a run wrote, or a run with two runs rows, is refused; a
trial that will continue from its checkpoint has one it can continue from (format, content digest, round, tables).
Every refusal: exit 2, one line, nothing in the folder changed. No Ray: ``run_trials`` is replaced by the trials run
in this process, as the trainable would (fresh, or resumed from a checkpoint)."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from fedsap_ray import results
from fedsap_ray.persist import checkpoint, treecodec
from fedsap_ray.experiment import run_experiment
from sweeps import study
from sweeps.trials import to_configs
from sweeps.tuner import SweepOptions
from tests.conftest import steady

REPO = Path(__file__).resolve().parents[2]
# three seeds of the ablation's cheapest variant (FedAvg) on the smoke preset, as --smoke-test would set it, with four
# clients instead of ten (what --resume checks is a trial's rows, not how many clients wrote them; a run in half the time)
ARGS = ["--preset", "smoke", "--variants", "fedavg-het", "--seeds", "0", "1", "2",
        *[a for o in [*study.SMOKE_BASE, "data.num_clients=4"] for a in ("--set", o)]]
IDS = ["fedavg-het-s0", "fedavg-het-s1", "fedavg-het-s2"]


def _ablation():
    spec = importlib.util.spec_from_file_location("sweep_ablation", REPO / "sweeps" / "ablation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ABLATION = _ablation()


def _configs(out: Path) -> dict:
    parsed = study.study_parser(doc=ABLATION.__doc__, variants=ABLATION.VARIANTS, study="ablation",
                                default_preset="laptop").parse_args(["--out", str(out), *ARGS])
    opts = study.options_from(parsed, ABLATION.SMOKE)
    trials = study.grid_trials({"fedavg-het": ABLATION.VARIANTS["fedavg-het"]}, opts, "ablation")
    return {to_configs(t)[1][0]: to_configs(t)[0][0] for t in trials}


@pytest.fixture(scope="module")
def intact(tmp_path_factory, single_thread) -> Path:
    """Two finished trials (s0, s1) and one interrupted after round 1 (s2: its checkpoint is there)."""
    out = tmp_path_factory.mktemp("sweep") / "o"
    cfgs = _configs(out)
    for run_id in IDS[:2]:
        run_experiment(cfgs[run_id], out, run_id=run_id)

    def stop(summary):
        if summary.round == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfgs[IDS[2]], out, run_id=IDS[2], progress=stop)
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory, intact) -> results.Results:
    """What every trial of the sweep gives once it has run to its end (the reference of a re-run)."""
    out = tmp_path_factory.mktemp("whole") / "o"
    shutil.copytree(intact, out)
    run_experiment(_configs(out)[IDS[2]], out, run_id=IDS[2], resume=True)
    return results.load(out)


@pytest.fixture
def folder(intact, tmp_path) -> Path:
    out = tmp_path / "o"
    shutil.copytree(intact, out)
    return out


class Ran:
    """In place of ``sweeps.tuner.run_trials``: records what the sweep asked to run and what the folder held of
    those runs then, and runs them here as the trainable would (resumed where a checkpoint is)."""

    def __init__(self, only: str | None = None) -> None:
        self.ids: list[str] = []
        self.held: dict[str, bool] = {}
        self.only = only  # run only this trial (the others are recorded)

    def __call__(self, todo, opts, name, **kw):
        for t in todo:
            (cfg,), (run_id,) = to_configs(t)
            self.ids.append(run_id)
            self.held[run_id] = bool(results.run_files(Path(opts.out), run_id))
            if self.only not in (None, run_id):
                continue
            resume = checkpoint.path_for(Path(opts.out), run_id).is_file()
            run_experiment(cfg, opts.out, run_id=run_id, resume=resume)
        return []


def sweep(capsys, monkeypatch, out: Path, *extra: str, only: str | None = None) -> tuple[int, list[str], Ran]:
    """``ablation.py --out OUT --resume ...`` in this process: (exit code, stderr lines, what it ran)."""
    ran = Ran(only)
    monkeypatch.setattr(study, "run_trials", ran)
    monkeypatch.setattr("sweeps.tuner.connect", lambda *a, **k: pytest.fail("Ray was started"))
    rc = study.study_main(["--out", str(out), "--resume", *ARGS, *extra], doc=ABLATION.__doc__,
                          variants=ABLATION.VARIANTS, study="ablation", default_preset="laptop", smoke=ABLATION.SMOKE,
                          report=lambda uri: "the report")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, lines, ran


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def refused(capsys, monkeypatch, out: Path, *extra: str) -> str:
    before = snapshot(out)
    rc, lines, ran = sweep(capsys, monkeypatch, out, *extra)
    # the sweep's own refusal (": error: invalid --resume ...") or the reader's, naming the file (": error: results
    # file X holds ..."): a copied or repeated table file is refused by whichever looks first, before Ray starts
    assert rc == 2 and len(lines) == 1 and (": error: invalid " in lines[0] or ": error: results file " in lines[0]), lines
    assert ran.ids == [] and snapshot(out) == before  # refused before anything changed
    return lines[0]


def same_tables(a: results.Results, b: results.Results, only: str | None = None) -> None:
    """Every per-round table equal but for the wall-clock columns (of run ``only`` when given)."""
    for table in ("rounds", "clients", "layers", "allocations"):
        key = [c for c in ("run_id", "round", "eval_mode", "domain", "client_id", "layer") if c in a[table]]
        x, y = (steady(r[table]) for r in (a, b))
        if only is not None:
            x, y = x[x["run_id"] == only], y[y["run_id"] == only]
        pd.testing.assert_frame_equal(x.sort_values(key).reset_index(drop=True), y.sort_values(key).reset_index(drop=True))


def _rewrite(path: Path, keep) -> None:
    t = pq.read_table(path)
    pq.write_table(t.filter(keep(t)).replace_schema_metadata(t.schema.metadata), path)


def _drop_round(r: int):
    return lambda t: pc.not_equal(t.column("round"), r)


def _forget_rows_written(out: Path, run_id: str) -> None:
    """The runs row as a writer before runs.rows_written left it (schema version 10: no such column)."""
    f = out / "runs" / f"{run_id}.parquet"
    t = pq.read_table(f).drop_columns(["rows_written"])
    i = t.schema.get_field_index("schema_version")
    pq.write_table(t.set_column(i, t.schema.field(i), pa.array([10] * len(t), t.schema.field(i).type)), f)


# a finished trial's tables, damaged the ways a folder loses rows: (the trial, the damage, the table named); each
# trial is run again, from the start
LOSSES = {
    "rounds-file-deleted": (IDS[1], lambda out: (out / "rounds" / f"{IDS[1]}.parquet").unlink(), "rounds"),
    "clients-round-2-gone": (IDS[0], lambda out: _rewrite(out / "clients" / f"{IDS[0]}.parquet", _drop_round(2)),
                             "clients"),
    "one-clients-row-gone": (IDS[1], lambda out: _rewrite(out / "clients" / f"{IDS[1]}.parquet", lambda t: pc.greater(
        pc.cumulative_sum(pa.array([1] * len(t))), 1)), "clients"),
    # a run written before runs.rows_written: its rounds table must still hold every round it ran
    "old-run-round-3-gone": (IDS[0], lambda out: (_forget_rows_written(out, IDS[0]),
                                                  _rewrite(out / "rounds" / f"{IDS[0]}.parquet", _drop_round(3))),
                             "rounds"),
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_finished_trial_whose_tables_lack_rows_runs_again_from_the_start(folder, finished, capsys, monkeypatch,
                                                                          loss):
    victim, damage, table = LOSSES[loss]
    damage(folder)
    rc, lines, ran = sweep(capsys, monkeypatch, folder, only=victim)
    assert rc == 0, lines
    again = [line for line in lines if "runs again from the start" in line]
    assert len(again) == 1, lines  # one line, naming the trial and what its tables lacked
    assert f"trial run {victim} finished earlier, but its {table} table" in again[0], again
    assert sorted(ran.ids) == sorted([victim, IDS[2]])  # the damaged trial and the interrupted one, nothing else
    assert ran.held[victim] is False  # its rows were removed before it ran: no mix of two attempts
    assert "1 finished earlier, 2 to run" in next(line for line in lines if "trials (" in line)
    same_tables(results.load(folder), finished, only=victim)  # deterministic: the same rows as before the damage
    rc, lines, ran = sweep(capsys, monkeypatch, folder, only="nothing")  # now all there: it does not run again
    assert rc == 0 and ran.ids == [IDS[2]] and not any("again" in line for line in lines), lines


def test_the_intact_folder_reruns_nothing_but_the_interrupted_trial(folder, finished, capsys, monkeypatch):
    rc, lines, ran = sweep(capsys, monkeypatch, folder)
    assert rc == 0 and ran.ids == [IDS[2]], lines
    same_tables(results.load(folder), finished)


@pytest.mark.parametrize("where", ["own-name", "new-name"])
def test_more_rows_than_a_finished_trial_wrote_are_refused(folder, capsys, monkeypatch, where):
    f = folder / "clients" / "fedavg-het-s0.parquet"
    if where == "own-name":  # rows duplicated inside its own file
        t = pq.read_table(f)
        pq.write_table(pa.concat_tables([t, t.slice(0, 2)]), f)
    else:  # its file copied under another name
        shutil.copy(f, folder / "clients" / "copy.parquet")
    line = refused(capsys, monkeypatch, folder)
    assert "fedavg-het-s0" in line or "copy.parquet" in line, line


@pytest.mark.parametrize("copy", ["runs/fedavg-het-s0.parquet", "runs/fedavg-het-s2.parquet"])
def test_a_run_with_two_runs_rows_is_refused_before_ray(folder, capsys, monkeypatch, copy):
    """A copied runs file (4 rows for 3 trials), of a finished trial or of the one that would continue."""
    shutil.copy(folder / copy, folder / "runs" / "copy-of-a-run.parquet")
    line = refused(capsys, monkeypatch, folder)
    run_id = Path(copy).stem
    assert run_id in line or "copy-of-a-run" in line, line


def _flip(out: Path) -> None:
    """One byte of the parameter vector's data flipped: the npz still opens, the shape and dtype are the same."""
    p = checkpoint.path_for(out, IDS[2])
    params = checkpoint.load(out, IDS[2])["state"].params
    data = bytearray(p.read_bytes())
    at = bytes(data).find(params[:4].tobytes())
    assert at > 0
    data[at + 1] ^= 0x40
    p.write_bytes(bytes(data))


def _nudge_without_digest(out: Path) -> None:
    """The parameter vector nudged and the file rewritten whole, its JSON (and so its old digest) kept."""
    p = checkpoint.path_for(out, IDS[2])
    with np.load(p) as z:
        members = {n: z[n] for n in z.files}
    name = next(n for n, a in members.items() if n != treecodec.META and a.dtype == np.float32 and a.ndim == 1
                and a.size > 1000)
    members[name] = members[name] + np.float32(1e-3)
    with open(p, "wb") as f:
        np.savez(f, **members)


CHECKPOINTS = {
    "random-bytes": (lambda out: checkpoint.path_for(out, IDS[2]).write_bytes(np.random.default_rng(0).bytes(4096)),
                     "is unreadable"),
    "flipped-byte": (_flip, "is unreadable (TreeFormatError: BadZipFile: Bad CRC-32"),  # the zip's own check
    "nudged-without-digest": (_nudge_without_digest, "changed after the run wrote it"),
    "round-beyond-the-trial": (lambda out: _resave(out, round_=7), "holds round 7"),
    "rounds-file-deleted": (lambda out: (out / "rounds" / f"{IDS[2]}.parquet").unlink(), "is missing"),
}


def _resave(out: Path, round_: int) -> None:
    from fedsap_ray.common.messages import ServerState

    ck = checkpoint.load(out, IDS[2])
    st = ck["state"]
    checkpoint.save(out, IDS[2], ServerState(round_, st.params, st.strategy_state), ck["server"], tables=ck["tables"],
                    rows=ck.get("rows"))


@pytest.mark.parametrize("damage", list(CHECKPOINTS))
def test_a_trials_checkpoint_is_checked_before_ray_starts_it(folder, capsys, monkeypatch, damage):
    edit, needle = CHECKPOINTS[damage]
    edit(folder)
    line = refused(capsys, monkeypatch, folder)
    assert f"trial run {IDS[2]}" in line and needle in line, line
    assert "restore" in line and "delete it" in line, line  # what to do


def test_tune_refuses_a_finished_run_whose_tables_lack_rows(tmp_path, capsys, monkeypatch, single_thread):
    """tune.py's trials are Optuna's: a complete one is not proposed again, so its lost rows are refused, by name,
    before the Optuna storage is opened or Ray starts."""
    spec = importlib.util.spec_from_file_location("sweep_tune", REPO / "sweeps" / "tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    out = tmp_path / "o"
    cfg = _configs(out)[IDS[0]]
    from dataclasses import replace

    run_experiment(replace(cfg, study="tune"), out, run_id="tabc-s0")
    opts = SweepOptions(out=str(out), preset="smoke", seeds=[0], resume=True)
    tune.refuse_incomplete(opts)  # intact: nothing to say
    (out / "clients" / "tabc-s0.parquet").unlink()
    monkeypatch.setattr("sweeps.tuner.connect", lambda *a, **k: pytest.fail("Ray was started"))
    before = snapshot(out)
    rc = tune.main(["--out", str(out), "--smoke-test", "--resume"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert "run tabc-s0" in lines[0] and "clients table holds 0 of the" in lines[0], lines
    assert snapshot(out) == before and not (out / "optuna.db").exists()


def test_rows_written_records_every_table_a_run_wrote(intact):
    res = results.load(intact)
    for run_id in IDS[:2]:
        wrote = json.loads(res.runs.set_index("run_id").loc[run_id, "rows_written"])
        held = {t: int((res[t]["run_id"] == run_id).sum()) for t in results.DATA_TABLES}
        assert wrote == {t: n for t, n in held.items() if n}, run_id
