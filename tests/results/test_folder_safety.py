"""A results folder cannot be made to write outside itself or lose a run (issue 40, items 1-2).

Every trap a careless user or an attacker can leave in a folder (a link where a lock, a table folder,
a run's file, a part or a checkpoint belongs; a file where a folder belongs; a FIFO where a file
belongs) is refused with exit 2 and one line naming the entry, by every command that touches the
folder (a new run, ``--overwrite``, ``--resume``, ``compact``), and the files outside the folder and
the runs inside it are byte-identical afterwards. ``--overwrite`` keeps the old run until the new one
has checkpointed a round, and brings it back when the new one fails first, also after a kill.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from faultkit import TINY, cli, tiny_run
from fuzzkit import snapshot
from fedsap_ray import algorithms, results
from fedsap_ray.persist import checkpoint
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.persist.outdir import OutDir, UnsafeEntry
from fedsap_ray.results import aside

RUN = ["--preset", "smoke", *[a for o in TINY for a in ("--set", o)], "--quiet"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A folder with a finished run ``done`` and a run ``half`` interrupted after round 1 of 3."""
    out = tmp_path_factory.mktemp("base") / "out"
    tiny_run(out, "done")
    tiny_run(out, "half", stop_after=1)
    return out


@pytest.fixture
def world(base, tmp_path) -> tuple[Path, Path]:
    """(a copy of the base folder, an outside folder with a file and a folder that traps point to)."""
    out = tmp_path / "out"
    shutil.copytree(base, out, symlinks=True)
    outside = tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    (outside / "file").write_bytes(b"precious\n")
    (outside / "folder" / "done.parquet").write_bytes(b"not yours\n")
    return out, outside


def _link_dir(out: Path, name: str, outside: Path) -> None:
    shutil.rmtree(out / name, ignore_errors=True)
    (out / name).symlink_to(outside / "folder", target_is_directory=True)


TRAPS = {
    # name: (set the trap, the entry a refusal must name)
    "lock-link": (lambda out, o: (out / ".new.lock").symlink_to(o / "file"), ".new.lock"),
    "resume-lock-link": (lambda out, o: (out / ".half.lock").symlink_to(o / "file"), ".half.lock"),
    "rounds-folder-link": (lambda out, o: _link_dir(out, "rounds", o), "rounds"),
    "clients-folder-link": (lambda out, o: _link_dir(out, "clients", o), "clients"),
    "checkpoints-folder-link": (lambda out, o: _link_dir(out, "checkpoints", o), "checkpoints"),
    "run-file-link": (lambda out, o: ((out / "runs" / "done.parquet").unlink(),
                                      (out / "runs" / "done.parquet").symlink_to(o / "file")), "done.parquet"),
    "part-link": (lambda out, o: (out / "rounds" / "half@r000002.parquet").symlink_to(o / "file"),
                  "half@r000002.parquet"),
    "checkpoint-link": (lambda out, o: ((out / "checkpoints" / "half.npz").unlink(),
                                        (out / "checkpoints" / "half.npz").symlink_to(o / "file")), "half.npz"),
    "file-as-folder": (lambda out, o: (shutil.rmtree(out / "layers", ignore_errors=True),
                                       (out / "layers").write_bytes(b"x")), "layers"),
    "fifo-as-checkpoint": (lambda out, o: ((out / "checkpoints" / "half.npz").unlink(),
                                           os.mkfifo(out / "checkpoints" / "half.npz")), "half.npz"),
    # the models runs keep (issue 53): the models folder, a run's folder in it, a kept file
    "models-folder-link": (lambda out, o: _link_dir(out, "models", o), "models"),
    "kept-folder-link": (lambda out, o: _link_dir(out, "models/done", o), "models/done"),
    "kept-model-link": (lambda out, o: ((out / "models" / "done" / "final.safetensors").unlink(),
                                        (out / "models" / "done" / "final.safetensors").symlink_to(o / "file")),
                        "final.safetensors"),
}
COMMANDS = {
    "new": ["run", *RUN, "--run-id", "new"],
    "overwrite": ["run", *RUN, "--run-id", "done", "--overwrite"],
    "resume": ["run", "--resume", "half", "--quiet"],
    "compact": ["compact"],
}
# which commands meet which trap (a command that never touches an entry has nothing to refuse)
MEETS = {
    "lock-link": ["new"], "resume-lock-link": ["resume"],
    "rounds-folder-link": ["new", "overwrite", "resume", "compact"],
    "clients-folder-link": ["new", "overwrite", "resume", "compact"],
    "checkpoints-folder-link": ["new", "overwrite", "resume", "compact"],
    "run-file-link": ["overwrite", "compact"],
    "part-link": ["resume", "compact"],
    "checkpoint-link": ["resume", "compact"],
    "file-as-folder": ["new", "overwrite", "resume", "compact"],
    "fifo-as-checkpoint": ["resume", "compact"],
    "models-folder-link": ["new", "overwrite", "resume"], "kept-folder-link": ["new", "overwrite", "resume"],
    "kept-model-link": ["overwrite"],
}
CASES = [(t, c) for t, cs in MEETS.items() for c in cs]


@pytest.mark.parametrize("trap,command", CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_a_trap_is_refused_naming_it_and_nothing_outside_or_inside_changes(world, capsys, trap, command):
    out, outside = world
    set_trap, entry = TRAPS[trap]
    set_trap(out, outside)
    before_out, before_outside = snapshot(out), snapshot(outside)
    args = COMMANDS[command]
    args = [*args, str(out)] if command == "compact" else [*args[:1], "--out", str(out), *args[1:]]
    rc, err = cli(capsys, *args)
    assert rc == 2, err
    assert len(err) == 1 and entry in err[0] and len(err[0]) < 400, err
    assert snapshot(outside) == before_outside  # nothing outside written, truncated or deleted
    assert snapshot(out) == before_out  # no run lost, nothing half done


def test_out_itself_may_be_a_link_and_is_resolved_once(tmp_path, capsys):
    real = tmp_path / "scratch" / "runs"
    real.mkdir(parents=True)
    (tmp_path / "runs").symlink_to(real, target_is_directory=True)
    rc, err = cli(capsys, "run", "--out", str(tmp_path / "runs"), *RUN, "--run-id", "r", "--set", "training.rounds=1")
    assert rc == 0, err
    assert (real / "runs" / "r.parquet").is_file()
    assert len(results.load(tmp_path / "runs").runs) == 1


def test_outdir_refuses_paths_that_leave_the_folder_and_links_at_any_depth(tmp_path):
    d = OutDir(tmp_path / "out")
    d.mkdir(tmp_path / "out" / "a" / "b")
    with pytest.raises(UnsafeEntry, match="outside the results folder"):
        d.check(tmp_path / "out" / ".." / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out" / "a" / "b" / "c").symlink_to(tmp_path / "elsewhere")
    for op in (lambda: d.mkdir(tmp_path / "out" / "a" / "b" / "c" / "d"),
               lambda: d.atomic_write(tmp_path / "out" / "a" / "b" / "c" / "f").__enter__(),
               lambda: d.unlink(tmp_path / "out" / "a" / "b" / "c" / "f"),
               lambda: d.listdir(tmp_path / "out" / "a" / "b" / "c")):
        with pytest.raises(UnsafeEntry, match="a/b/c is a symbolic link"):
            op()
    assert list((tmp_path / "elsewhere").iterdir()) == []
    fs = d.filesystem()  # the Parquet door: the same checks
    with pytest.raises(UnsafeEntry):
        fs.open_output_stream(str(tmp_path / "out" / "a" / "b" / "c" / "x.parquet"))
    with pytest.raises(UnsafeEntry):
        fs.delete_file(str(tmp_path / "out" / "a" / "b" / "c" / "x.parquet"))


# ------------------------------------------------------------------ --overwrite moves the old run aside


class _Boom:
    """A backend whose training fails in round 1 (after the new run wrote its first rows)."""

    def start(self, ctx):
        pass

    def train(self, plans):
        raise RuntimeError("device lost")

    def close(self):
        pass


def test_overwrite_that_fails_before_its_first_checkpoint_restores_the_old_run(world):
    out, _ = world
    before = snapshot(out)
    with pytest.raises(RuntimeError, match="device lost"):
        tiny_run(out, "done", overwrite=True, backend=_Boom())
    assert snapshot(out) == before


def test_overwrite_refused_late_by_the_model_build_restores_the_old_run(world, capsys):
    out, _ = world
    before = snapshot(out)
    rc, err = cli(capsys, "run", "--out", str(out), *RUN, "--run-id", "done", "--overwrite",
                  "--set", "model.name=char_lstm")
    assert rc == 2 and "model.name" in err[0], err
    assert snapshot(out) == before


def test_overwrite_replaces_every_table_of_the_old_run_compacted_rows_too(world, capsys):
    out, _ = world
    assert cli(capsys, "compact", str(out))[0] == 0
    old = results.load(out)
    assert (old.layers.run_id == "done").sum() == 0 and (old.clients.run_id == "done").sum() > 0
    rc, err = cli(capsys, "run", "--out", str(out), *RUN, "--run-id", "done", "--overwrite",
                  "--set", "training.rounds=2", "--set", "data.num_clients=5")
    assert rc == 0, err
    new = results.load(out)
    assert set(new.clients[new.clients.run_id == "done"]["round"]) == {1, 2}
    assert int(new.runs.set_index("run_id").loc["done", "num_clients"]) == 5
    assert not (out / aside.ASIDE).exists()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_killed_overwrite_is_finished_by_the_next_claim(world, capsys, checkpointed):
    """Killed after setting the old run aside: before the new run's first checkpoint the old run comes
    back; after it the old run is gone. Either way no half state stays."""
    out, _ = world
    before = snapshot(out)
    aside.set_aside(out, "done")
    results.RunWriter(out, "done").set_run({"status": "running", "rounds": 3})  # the new run's first write
    if checkpointed:  # ... and its first checkpoint, then the process died
        shutil.copy(out / "checkpoints" / "half.npz", out / "checkpoints" / "done.npz")
    rc, err = cli(capsys, "run", "--out", str(out), *RUN, "--run-id", "other", "--set", "training.rounds=1")  # its claim
    assert rc == 0, err
    assert not (out / aside.ASIDE / "done").exists()
    if checkpointed:
        assert checkpoint.path_for(out, "done").is_file()  # the new run, resumable
    else:
        now = snapshot(out)
        assert {k: v for k, v in now.items() if "other" not in k} == before


# ------------------------------------------------------------------ resume checks everything first


def _tamper(out: Path, run_id: str, **change) -> None:
    ck = checkpoint.load(out, run_id)
    st = ck["state"]
    state = {"round": st.round, "params": st.params, "strategy": st.strategy_state, **change.pop("state", {})}
    from fedsap_ray.common.messages import ServerState

    checkpoint.save(out, run_id, ServerState(round=state["round"], params=state["params"],
                                             strategy_state=state["strategy"]),
                    change.get("server", ck["server"]), change.get("tables", ck["tables"]),
                    rows=change.get("rows", ck.get("rows")))


def _strategy_of(out: Path) -> dict:
    return checkpoint.load(out, "half")["state"].strategy_state


TAMPER = {
    "round-negative": (dict(state={"round": -3}), "round -3"),
    "round-zero": (dict(state={"round": 0}), "round 0"),
    "round-ahead": (dict(state={"round": 2}), "lacks rounds 2"),
    "params-short": (dict(state={"params": np.zeros(7, np.float32)}), "params holds 7"),
    "params-nan": (dict(state={"params": None}), "non-finite"),
    "params-float64": (dict(state={"params": "f64"}), "float32"),
    "tables-int": (dict(tables=[1]), "tables is [1]"),
    "tables-unknown": (dict(tables=["rounds", "nope"]), "tables is"),
    "rows-negative": (dict(rows={"rounds": {1: -1}}), "rows.rounds[1]"),
    "server-missing": (dict(server={}), "server.best_by_mode is missing"),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_resume_refuses_a_checkpoint_that_does_not_fit_the_run_before_deleting_anything(world, capsys, case):
    out, _ = world
    change, needle = TAMPER[case]
    params = change.get("state", {}).get("params", "")
    if params is None:
        p = checkpoint.load(out, "half")["state"].params.copy()
        p[5] = np.nan
        change = dict(state={"params": p})
    elif isinstance(params, str) and params == "f64":
        change = dict(state={"params": checkpoint.load(out, "half")["state"].params.astype(np.float64)})
    _tamper(out, "half", **change)
    before = snapshot(out)
    rc, err = cli(capsys, "run", "--out", str(out), "--resume", "half", "--quiet")
    assert rc == 2, err
    assert len(err) == 1 and needle in err[0], err
    assert snapshot(out) == before


@pytest.mark.parametrize("table", ["clients", "rounds"])
def test_resume_refuses_a_deleted_part_of_any_table(world, capsys, table):
    out, _ = world
    for f in (out / table).glob("half*.parquet"):
        f.unlink()
    rc, err = cli(capsys, "run", "--out", str(out), "--resume", "half", "--quiet")
    assert rc == 2 and table in err[0], err


def test_resume_refuses_rows_beyond_the_checkpoint(world, capsys):
    """A checkpoint older than the tables (an old copy put back) is refused, not resumed over them."""
    out, _ = world
    import pyarrow.parquet as pq

    t = pq.read_table(out / "rounds" / "half.parquet")
    pq.write_table(t.set_column(t.schema.get_field_index("round"), "round",
                                pa.array([3] * t.num_rows, t.schema.field("round").type)),
                   out / "rounds" / "half@r000003.parquet")
    rc, err = cli(capsys, "run", "--out", str(out), "--resume", "half", "--quiet")
    assert rc == 2 and "round 3" in err[0], err


@pytest.mark.parametrize("algorithm", ["fedsap", "scaffold", "dapperfl", "fpl"])
def test_every_strategy_state_checkpoint_passes_and_a_foreign_field_is_named(tmp_path, capsys, algorithm):
    """A real checkpoint of the strategy resumes to the uninterrupted tables; the same checkpoint with a
    field added, a field dropped, or an array of text where the state holds numbers is refused naming it."""
    out = tmp_path / "out"
    tiny_run(out, "r", f"algorithm.name={algorithm}", stop_after=1)
    pristine = snapshot(out)
    state = checkpoint.load(out, "r")["state"].strategy_state
    names = sorted(k for k in state if k not in algorithms.get(algorithm).state_keys)
    edits = [({**state, "bogus": np.zeros(1)}, "strategy.bogus")]
    if names:
        edits.append(({k: v for k, v in state.items() if k != names[0]}, f"strategy.{names[0]}"))
        arr = next((k for k in names if isinstance(state[k], np.ndarray)), None)
        if arr is not None:
            edits.append(({**state, arr: np.array(["a"] * state[arr].size)}, f"strategy.{arr}"))
    for edited, needle in edits:
        _tamper(out, "r", state={"strategy": edited})
        rc, err = cli(capsys, "run", "--out", str(out), "--resume", "r", "--quiet")
        assert rc == 2 and needle in err[0], (needle, err)
    for rel, data in pristine.items():  # put the real checkpoint back: it resumes
        if isinstance(data, bytes):
            (out / rel).write_bytes(data)
    rc, err = cli(capsys, "run", "--out", str(out), "--resume", "r", "--quiet")
    assert rc == 0, err
    ref = tmp_path / "ref"
    tiny_run(ref, "r", f"algorithm.name={algorithm}")
    a, b = results.load(out), results.load(ref)
    cols = ["round", "eval_mode", "domain", "global_accuracy"]
    pd.testing.assert_frame_equal(a.rounds[cols].sort_values(cols[:3]).reset_index(drop=True),
                                  b.rounds[cols].sort_values(cols[:3]).reset_index(drop=True))


def test_a_stale_checkpoint_of_a_finished_run_is_named_by_resume_and_removed_by_compact(world, capsys):
    """Killed between writing 'finished' and removing the checkpoint: the run is final, the checkpoint
    can never be resumed; compact used to skip such a run forever."""
    out, _ = world
    shutil.copy(out / "checkpoints" / "half.npz", out / "checkpoints" / "done.npz")
    rc, err = cli(capsys, "run", "--out", str(out), "--resume", "done", "--quiet")
    assert rc == 2 and "already finished" in err[0] and "stale" in err[0], err
    assert cli(capsys, "compact", str(out))[0] == 0
    assert not (out / "checkpoints" / "done.npz").exists()
    assert (out / "checkpoints" / "half.npz").exists()  # a resumable run keeps its checkpoint
    assert "done" in set(results.load(out).runs.run_id)


def test_availability_that_empties_a_round_is_refused_before_round_one(tmp_path, capsys):
    rc, err = cli(capsys, "run", "--out", str(tmp_path / "o"), *RUN, "--run-id", "a",
                  "--set", "devices.availability=0.02", "--set", "training.rounds=40")
    assert rc == 2 and "devices.availability" in err[0] and "round" in err[0], err
    assert not (tmp_path / "o").exists()


def test_config_error_is_what_unsafe_entries_are():
    assert issubclass(UnsafeEntry, ConfigError)
