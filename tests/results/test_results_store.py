"""Results storage: one-scan loading, compaction (interruptible), and remote destinations (file://)."""
from __future__ import annotations

import datetime as dt
import os
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedsap_ray import results
from fedsap_ray.results import compaction
from fedsap_ray.cli import main as cli_main
from fedsap_ray.results.destination import ResultsDestination

T0 = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)


def _benchmark_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("load_results_bench",
                                                  Path(__file__).resolve().parents[2] / "benchmarks" / "load_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the per-file reader results.read_table had before the dataset scan (the reference, kept in the benchmark)
old_read_table = _benchmark_module().old_read_table


def write_run(out: Path, run_id: str, status: str = "finished", rounds: int = 3, v1: bool = False,
              acc_shift: float = 0.0, checkpoint: bool = False) -> None:
    """A tiny run written the way RunWriter writes it: one file per table (no allocations in version 1)."""
    sv = 1 if v1 else results.SCHEMA_VERSION
    base = {"schema_version": sv, "run_id": run_id}
    results.write_atomic(results.to_table("runs", [{
        **base, "status": status, "seed": hash(run_id) % 97, "rounds": rounds, "rounds_done": rounds,
        "started_at": T0, "finished_at": None if status == "running" else T0 + dt.timedelta(seconds=5),
        "final_global_accuracy": 0.5 + acc_shift, "algorithm": "fedavg"}]), out / "runs" / f"{run_id}.parquet")
    rnd = [{**base, "round": t, "domain": d, "accuracy": 0.1 * t + acc_shift, "frozen_params": 7 * t,
            "evaluated": True, "n_test": 10} for t in range(1, rounds + 1) for d in ("a", "b", results.GLOBAL_DOMAIN)]
    rt = results.to_table("rounds", rnd)
    if v1:  # what schema version 1 wrote: no frozen_params column, no allocations table
        rt = rt.drop(["frozen_params"])
    results.write_atomic(rt, out / "rounds" / f"{run_id}.parquet")
    cl = [{**base, "round": t, "client_id": c, "capacity_used": 0.25 * (c + 1), "worker": "local"}
          for t in range(1, rounds + 1) for c in range(2)]
    results.write_atomic(results.to_table("clients", cl), out / "clients" / f"{run_id}.parquet")
    la = [{**base, "round": t, "client_id": c, "layer": f"layer{k}", "channels": 8, "keep_ratio": 0.5}
          for t in range(1, rounds + 1) for c in range(2) for k in range(2)]
    results.write_atomic(results.to_table("layers", la), out / "layers" / f"{run_id}.parquet")
    if not v1:
        al = [{**base, "round": t, "client_id": c, "p": 0.5, "adapted": t == 2} for t in range(1, rounds + 1)
              for c in range(3)]
        results.write_atomic(results.to_table("allocations", al), out / "allocations" / f"{run_id}.parquet")
    if checkpoint:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints" / f"{run_id}.npz").write_bytes(b"a checkpoint of round %d" % rounds)


KEYS = {"runs": ["run_id"], "rounds": ["run_id", "round", "domain"], "clients": ["run_id", "round", "client_id"],
        "layers": ["run_id", "round", "client_id", "layer"], "allocations": ["run_id", "round", "client_id"]}


def canon(res: results.Results, table: str) -> pd.DataFrame:
    return res[table].sort_values(KEYS[table]).reset_index(drop=True)


def assert_same(a: results.Results, b: results.Results) -> None:
    for t in ("runs", *results.DATA_TABLES):
        pd.testing.assert_frame_equal(canon(a, t), canon(b, t))


def n_parquet(out: Path) -> int:
    return sum(1 for _ in Path(out).glob("*/*.parquet"))


# ----------------------------------------------------------------------------- loading

def test_dataset_reader_equals_the_per_file_reader_on_200_runs(tmp_path):
    for i in range(200):
        write_run(tmp_path, f"r{i:03d}", rounds=2, v1=(i % 50 == 7))  # a few version-1 files among them
    res = results.load(tmp_path)
    for t in ("runs", *results.DATA_TABLES):
        pd.testing.assert_frame_equal(res[t], old_read_table(tmp_path, t))  # same rows, same order, same dtypes
    assert len(res.runs) == 200 and len(res.rounds) == 200 * 2 * 3
    v1 = res.rounds[res.rounds["schema_version"] == 1]
    assert len(v1) == 4 * 6 and v1["frozen_params"].isna().all()
    assert res.rounds.loc[res.rounds["schema_version"] == results.SCHEMA_VERSION, "frozen_params"].notna().all()


def test_version_1_folder_loads_with_nulls_and_ignores_temp_files(tmp_path):
    write_run(tmp_path, "old", v1=True)
    (tmp_path / "rounds" / ".old.parquet.abcd1234.tmp").write_bytes(b"half a file")
    (tmp_path / "rounds" / "_SUCCESS").write_bytes(b"")
    res = results.load(tmp_path)
    assert len(res.rounds) == 9 and res.rounds["frozen_params"].isna().all()
    assert res.allocations.empty and list(res.allocations.columns) == results.schema("allocations").names
    assert str(res.runs["started_at"].dtype) == "datetime64[us, UTC]"


def test_load_via_uri_and_bad_input(tmp_path):
    write_run(tmp_path, "a")
    assert_same(results.load(tmp_path.as_uri()), results.load(tmp_path))
    with pytest.raises(FileNotFoundError, match="no results folder"):
        results.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="nosuch://x"):
        results.load("nosuch://x")
    with pytest.raises(ValueError, match="table='round'.*rounds"):
        results.read_table(tmp_path, "round")
    assert results.run_statuses(tmp_path / "missing") == {}


# ----------------------------------------------------------------------------- compaction

def sweep(out: Path, n: int = 20) -> None:
    for i in range(n):
        write_run(out, f"f{i:02d}", status=("finished", "failed", "stopped", "interrupted")[i % 4], v1=(i == 3))
    write_run(out, "live", status="running")
    write_run(out, "resumable", status="interrupted", checkpoint=True)


def test_compact_gives_the_same_frames_from_far_fewer_files(tmp_path):
    sweep(tmp_path)
    before = results.load(tmp_path)
    files_before = n_parquet(tmp_path)
    n = results.compact(tmp_path)
    assert n == {"runs_compacted": 20, "files_written": 5, "files_rewritten": 0, "files_removed": 20 * 5 - 1,
                 "runs_kept": 2}
    assert_same(results.load(tmp_path), before)
    assert n_parquet(tmp_path) == files_before - n["files_removed"] + n["files_written"] == 5 + 2 * 5
    # the running and the resumable run keep their per-run files (a run rewrites/resumes from them)
    for t in ("runs", *results.DATA_TABLES):
        assert (tmp_path / t / "live.parquet").is_file() and (tmp_path / t / "resumable.parquet").is_file()
        assert not (tmp_path / t / "f00.parquet").exists()
        assert len(list((tmp_path / t).glob("compacted-*.parquet"))) == 1
    assert results.run_statuses(tmp_path) == {**{f"f{i:02d}": ("finished", "failed", "stopped", "interrupted")[i % 4]
                                                 for i in range(20)}, "live": "running", "resumable": "interrupted"}
    assert results.compact(tmp_path)["files_written"] == 0  # nothing left to do


@pytest.mark.parametrize("stop_after", [0, 1, 19, 45, 98])  # deletions done before the interruption
def test_interrupted_compaction_loads_every_row_once_and_a_second_compact_finishes(tmp_path, monkeypatch, stop_after):
    sweep(tmp_path)
    before = results.load(tmp_path)
    real, calls = compaction._unchanged, []

    def interrupt(fs, info):  # called right before each per-run file is deleted
        if len(calls) == stop_after:
            raise KeyboardInterrupt
        calls.append(info.path)
        return real(fs, info)

    monkeypatch.setattr(compaction, "_unchanged", interrupt)
    with pytest.raises(KeyboardInterrupt):
        results.compact(tmp_path)
    monkeypatch.undo()
    assert_same(results.load(tmp_path), before)  # compacted + leftover per-run files: each row once
    assert set(results.run_statuses(tmp_path)) == set(before.runs["run_id"])
    results.compact(tmp_path)
    assert_same(results.load(tmp_path), before)
    for t in ("runs", *results.DATA_TABLES):
        left = sorted(f.name for f in (tmp_path / t).glob("*.parquet") if not f.name.startswith("compacted-"))
        assert left == ["live.parquet", "resumable.parquet"]
        for f in (tmp_path / t).glob("compacted-*.parquet"):  # no run in two compacted files
            others = [g for g in (tmp_path / t).glob("compacted-*.parquet") if g != f]
            ids = set(pq.read_table(f, columns=["run_id"])["run_id"].to_pylist())
            assert not any(ids & set(pq.read_table(g, columns=["run_id"])["run_id"].to_pylist()) for g in others)


def test_leftover_per_run_files_of_a_finished_compaction_load_once(tmp_path):
    """The brief's simulation: compacted files written, per-run files put back (as if not yet deleted)."""
    sweep(tmp_path, n=8)
    before = results.load(tmp_path)
    saved = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in tmp_path.glob("*/f0*.parquet")}
    results.compact(tmp_path)
    for f, (data, mtime) in saved.items():
        f.write_bytes(data)
        os.utime(f, ns=(mtime, mtime))  # as old as when compact read it
    assert_same(results.load(tmp_path), before)
    n = results.compact(tmp_path)
    assert n["files_written"] == 0 and n["files_rewritten"] == 0 and n["files_removed"] == len(saved)
    assert_same(results.load(tmp_path), before)
    assert not any(f.exists() for f in saved)


def test_a_failed_write_leaves_no_compacted_file(tmp_path, monkeypatch):
    sweep(tmp_path, n=4)
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())

    class Broken(pq.ParquetWriter):
        def write_table(self, *a, **k):
            raise OSError("disk full")

    monkeypatch.setattr(pq, "ParquetWriter", Broken)
    with pytest.raises(OSError, match="disk full"):
        results.compact(tmp_path)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()) == files  # temp removed


def test_a_run_rerun_after_compaction_replaces_its_compacted_rows(tmp_path):
    """A failed run without checkpoint is re-run from scratch under the same id (sweeps do that)."""
    sweep(tmp_path, n=8)
    results.compact(tmp_path)
    write_run(tmp_path, "f01", status="running", rounds=2, acc_shift=0.5)  # f01 had failed; re-run starts
    res = results.load(tmp_path)
    assert results.run_statuses(tmp_path)["f01"] == "running"
    assert res.rounds[res.rounds.run_id == "f01"]["accuracy"].round(6).tolist() == [0.6] * 3 + [0.7] * 3
    assert results.compact(tmp_path)["runs_kept"] == 3  # live, resumable and the running re-run
    write_run(tmp_path, "f01", status="finished", rounds=2, acc_shift=0.5)
    expected = results.load(tmp_path)
    n = results.compact(tmp_path)
    assert n["runs_compacted"] == 1 and n["files_rewritten"] == 5  # f01 left the older compacted files
    assert_same(results.load(tmp_path), expected)
    assert results.run_statuses(tmp_path)["f01"] == "finished"
    assert len(expected.rounds[expected.rounds.run_id == "f01"]) == 6


def test_cli_compact(tmp_path, capsys):
    sweep(tmp_path, n=4)
    before = results.load(tmp_path)
    assert cli_main(["compact", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "compacted 4 runs" in out and "removed 19 per-run files" in out and "2 running or resumable" in out
    assert_same(results.load(tmp_path), before)
    assert cli_main(["compact", str(tmp_path / "nope")]) == 2
    assert "no results folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------- destinations

def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_file_uri_destination_push_pull_and_checkpoint_deletion(tmp_path):
    remote = tmp_path / "bucket" / "sweep"
    dest = ResultsDestination(remote.as_uri(), staging_root=tmp_path / "stage")
    assert dest.is_remote and dest.uri == remote.as_uri() and dest.local.parent == tmp_path / "stage"
    for i, status in enumerate(["finished", "running"]):
        write_run(dest.local, f"r{i}", status=status, checkpoint=(status == "running"))
        dest.push(f"r{i}")
    assert files_of(remote) == files_of(dest.local)  # every table file and the checkpoint, nothing else
    assert not any(p.name.startswith(".") for p in remote.rglob("*"))  # no temporary files left
    assert_same(results.load(dest.uri), results.load(dest.local))
    assert dest.statuses() == {"r0": "finished", "r1": "running"}
    # another node resumes r1: pull into a fresh staging dir restores exactly its files
    other = ResultsDestination(remote.as_uri(), staging_root=tmp_path / "node2")
    (other.local / "rounds").mkdir(parents=True)
    (other.local / "rounds" / "r1.parquet").write_bytes(b"stale")  # an older attempt on this node
    (other.local / "layers").mkdir()
    (other.local / "layers" / "r1.parquet").write_bytes(b"not at the destination")
    other.pull("r1")
    assert files_of(other.local) == {k: v for k, v in files_of(remote).items() if "r1" in k}
    # r1 finishes there: its checkpoint is removed locally, and push removes it at the destination
    write_run(other.local, "r1", status="finished")
    (other.local / "checkpoints" / "r1.npz").unlink()
    other.push("r1")
    assert not (remote / "checkpoints" / "r1.npz").exists()
    assert results.run_statuses(remote.as_uri()) == {"r0": "finished", "r1": "finished"}
    before = results.load(remote.as_uri())
    pd.testing.assert_frame_equal(canon(before, "rounds").query("run_id == 'r1'").reset_index(drop=True),
                                  canon(results.load(other.local), "rounds"))  # r1 as finished on node 2
    assert results.compact(remote.as_uri())["runs_compacted"] == 2  # compaction works through the URI too
    assert_same(results.load(remote.as_uri()), before)
    assert sorted(p.name[:10] for p in (remote / "rounds").iterdir()) == ["compacted-"]


def test_local_destination_is_a_no_op(tmp_path):
    for out in (tmp_path / "o", str(tmp_path / "o"), "runs/relative"):
        dest = ResultsDestination(out)
        assert not dest.is_remote and dest.local == Path(out) and dest.uri == str(out)
    dest = ResultsDestination(tmp_path / "o")
    write_run(dest.local, "a", checkpoint=True)
    before = files_of(dest.local)
    dest.pull("a")
    dest.push("a")
    assert files_of(dest.local) == before and sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert dest.statuses() == {"a": "finished"}
    with pytest.raises(ValueError, match="run_id='../x'"):
        dest.push("../x")
    with pytest.raises(ValueError, match="nosuch://b"):
        ResultsDestination("nosuch://b/sweep", staging_root=tmp_path)


def test_a_file_of_another_table_is_skipped_with_a_warning(tmp_path):
    write_run(tmp_path, "r")
    shutil.copy(tmp_path / "runs" / "r.parquet", tmp_path / "rounds" / "intruder.parquet")
    shutil.copy(tmp_path / "clients" / "r.parquet", tmp_path / "runs" / "intruder2.parquet")
    with pytest.warns(UserWarning) as caught:
        res = results.load(tmp_path)
    said = " ".join(str(w.message) for w in caught)
    assert "intruder.parquet: not a file of the rounds table" in said
    assert "intruder2.parquet: not a file of the runs table" in said
    assert set(res.rounds["run_id"]) == {"r"} and res.rounds["round"].notna().all()
    assert res.runs["run_id"].tolist() == ["r"]
    with pytest.warns(UserWarning):
        results.compact(tmp_path)
    assert (tmp_path / "rounds" / "intruder.parquet").is_file()  # left alone, not compacted or deleted


def test_remove_run_deletes_one_runs_rows_from_per_run_and_compacted_files(tmp_path):
    """What --overwrite does before a new run takes the id: no row of the old run is left to show through."""
    from fedsap_ray.run import guard

    for r in ("a", "b"):
        write_run(tmp_path, r)
    results.compact(tmp_path)
    write_run(tmp_path, "c")
    assert guard.existing_run(tmp_path, "a") == "rows in a compacted file"
    assert guard.existing_run(tmp_path, "c") == "status finished" and guard.existing_run(tmp_path, "z") is None
    results.remove_run(tmp_path, "a")
    res = results.load(tmp_path)
    for t in ("runs", *results.DATA_TABLES):
        assert set(res[t]["run_id"]) == {"b", "c"}, t
    assert guard.existing_run(tmp_path, "a") is None


def test_runs_gain_flattened_config_columns_from_their_resolved_config(tmp_path):
    """Issue 16: every leaf of config_json becomes a config.<section>.<field> column on read; a leaf one run
    lacks (an algorithm option only the other set) is NaN there; the files themselves keep one schema."""
    import json

    cfgs = {"a": {"seed": 0, "training": {"rounds": 5, "lr": 0.1}, "algorithm": {"name": "fedsap", "options": {"g_target": 0.5}},
                  "capacity": {"tiers": [0.25, 1.0]}},
            "b": {"seed": 1, "training": {"rounds": 7, "lr": 0.1}, "algorithm": {"name": "fedavg", "options": {}},
                  "capacity": {"tiers": [0.5]}}}
    for rid, cfg in cfgs.items():
        results.write_atomic(results.to_table("runs", [{"schema_version": results.SCHEMA_VERSION, "run_id": rid,
                                                        "status": "finished", "config_json": json.dumps(cfg)}]),
                             tmp_path / "runs" / f"{rid}.parquet")
    for runs in (results.load(tmp_path).runs, results.read_table(tmp_path, "runs")):
        r = runs.set_index("run_id")
        assert r.loc["a", "config.training.rounds"] == 5 and r.loc["b", "config.training.rounds"] == 7
        assert r.loc["b", "config.algorithm.name"] == "fedavg"
        assert r.loc["a", "config.algorithm.options.g_target"] == 0.5
        assert pd.isna(r.loc["b", "config.algorithm.options.g_target"])
        assert r.loc["a", "config.capacity.tiers"] == [0.25, 1.0]
    assert not any(c.startswith("config.") for c in pq.read_schema(tmp_path / "runs" / "a.parquet").names)


def _round_rows(t: int, n_clients: int = 8) -> dict[str, list[dict]]:
    return {"rounds": [{"round": t, "domain": d, "accuracy": 0.1 * t, "evaluated": True} for d in ("a", "b")],
            "clients": [{"round": t, "client_id": c, "train_loss": 1.0 / t} for c in range(n_clients)]}


def _stamps(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*.parquet"))}


def test_a_round_write_adds_new_part_files_and_never_touches_earlier_ones(tmp_path):
    """Append-only results (issue 17): a round's flush writes only that round's parts (and the one-row runs
    file); a run in progress loads from its parts; a final status merges them into the per-run files."""
    w = results.RunWriter(tmp_path, "r")
    w.set_run({"status": "running"})
    for t in (1, 2):
        for table, rows in _round_rows(t).items():
            w.add(table, rows)
        w.flush()
    before = _stamps(tmp_path)
    assert sorted(k for k in before if not k.startswith("runs/")) == [
        "clients/r@r000001.parquet", "clients/r@r000002.parquet", "rounds/r@r000001.parquet", "rounds/r@r000002.parquet"]
    for table, rows in _round_rows(3).items():
        w.add(table, rows)
    w.flush()
    after = _stamps(tmp_path)
    changed = sorted(k for k in after if before.get(k) != after[k])
    assert changed == ["clients/r@r000003.parquet", "rounds/r@r000003.parquet", "runs/r.parquet"]  # only new files
    running = results.load(tmp_path)  # a run in progress loads from its parts
    assert running.rounds["round"].tolist() == [1, 1, 2, 2, 3, 3] and len(running.clients) == 3 * 8
    assert results.run_statuses(tmp_path) == {"r": "running"}
    assert w.tables_written() == ["rounds", "clients"]
    w.set_run({"status": "finished"})  # the run's end merges its parts
    assert sorted(p.name for p in tmp_path.rglob("*.parquet")) == ["r.parquet"] * 3
    assert sorted(w.consolidate()) == ["clients", "rounds"]  # nothing left to merge: the tables it has
    meta = pq.read_schema(tmp_path / "rounds" / "r.parquet").metadata
    assert meta[results.UPTO_KEY] == b"3"
    done = results.load(tmp_path)
    pd.testing.assert_frame_equal(done.rounds, running.rounds)
    pd.testing.assert_frame_equal(done.clients, running.clients)


def test_parts_a_merged_file_holds_are_read_once_and_compact_merges_leftover_parts(tmp_path):
    w = results.RunWriter(tmp_path, "r")
    for t in (1, 2, 3):
        for table, rows in _round_rows(t).items():
            w.add(table, rows)
        w.flush()
    parts = {f: f.read_bytes() for f in tmp_path.glob("*/r@r*.parquet")}
    assert len(parts) == 6
    w.set_run({"status": "interrupted"})  # final: merged
    assert not list(tmp_path.glob("*/r@r*.parquet"))
    for f, b in parts.items():  # a merge killed before it deleted its parts
        f.write_bytes(b)
    res = results.load(tmp_path)
    assert res.rounds["round"].tolist() == [1, 1, 2, 2, 3, 3]
    t3 = pq.read_table(tmp_path / "rounds" / "r@r000003.parquet")  # a round a killed writer added after the merge
    i = t3.schema.get_field_index("round")
    pq.write_table(t3.set_column(i, t3.schema.field(i), pa.array([4] * t3.num_rows, pa.int64())),
                   tmp_path / "rounds" / "r@r000004.parquet")
    assert results.load(tmp_path).rounds["round"].tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    n = results.compact(tmp_path)  # final, no checkpoint: its parts are merged, then compacted
    assert n["runs_compacted"] == 1 and not list(tmp_path.glob("*/r@r*.parquet"))
    assert results.load(tmp_path).rounds["round"].tolist() == [1, 1, 2, 2, 3, 3, 4, 4]


def test_a_read_of_a_folder_its_writer_merges_meanwhile_reads_the_merged_files(tmp_path, monkeypatch):
    """A notebook (or a sweep's progress check) reading a live folder: the run ends and merges its parts between
    the reader's listing and its scan. The read starts again from a fresh listing and gets every row once; the
    same vanished part on an unchanged listing is a refusal naming it (tests/results/test_readers.py)."""
    import fedsap_ray.results.reader as reader

    w = results.RunWriter(tmp_path, "r")
    for t in (1, 2):
        for table, rows in _round_rows(t).items():
            w.add(table, rows)
        w.flush()
    running = results.load(tmp_path)
    real, merged = reader.list_table, []

    def list_then_merge(fs, base, table):
        listing = real(fs, base, table)
        if table == "rounds" and not merged:  # the writer ends the run right after this listing
            merged.append(table)
            w.set_run({"status": "finished"})
        return listing

    monkeypatch.setattr(reader, "list_table", list_then_merge)
    res = results.load(tmp_path)
    assert merged == ["rounds"] and not list(tmp_path.glob("*/r@r*.parquet"))
    pd.testing.assert_frame_equal(res.rounds, running.rounds)
    pd.testing.assert_frame_equal(res.clients, running.clients)

    w2 = results.RunWriter(tmp_path / "b", "s")
    for table, rows in _round_rows(1).items():
        w2.add(table, rows)
    w2.flush()
    stale = real(*results.store.filesystem(tmp_path / "b"), "rounds")
    (tmp_path / "b" / "rounds" / "s@r000001.parquet").unlink()  # gone for good: the listing stays as it is now
    monkeypatch.setattr(reader, "list_table", lambda fs, base, table: stale if table == "rounds" else real(fs, base, table))
    with pytest.raises(results.UnreadableFile, match=r"s@r000001\.parquet"):
        results.load(tmp_path / "b")


def test_a_merge_that_fails_leaves_the_parts_loadable(tmp_path, monkeypatch):
    """The end-of-run merge is best effort: an OSError (a full disk) warns and keeps every part, which load reads."""
    w = results.RunWriter(tmp_path, "r")
    for table, rows in _round_rows(1).items():
        w.add(table, rows)
    w.flush()

    def full_disk(*a, **kw):
        raise OSError("No space left on device")

    monkeypatch.setattr(results.writer, "consolidate_run", full_disk)
    with pytest.warns(UserWarning, match="not merged"):
        w.set_run({"status": "failed"})
    assert (tmp_path / "rounds" / "r@r000001.parquet").is_file()
    res = results.load(tmp_path)
    assert res.rounds["round"].tolist() == [1, 1] and res.runs["status"].tolist() == ["failed"]


def test_destination_push_and_pull_carry_parts_and_drop_them_once_merged(tmp_path):
    remote = tmp_path / "bucket" / "sweep"
    dest = ResultsDestination(remote.as_uri(), staging_root=tmp_path / "stage")
    w = results.RunWriter(dest.local, "r")
    w.set_run({"status": "running"})
    for t in (1, 2):
        for table, rows in _round_rows(t).items():
            w.add(table, rows)
        w.flush()
        dest.push("r")
    assert files_of(remote) == files_of(dest.local) and (remote / "rounds" / "r@r000002.parquet").is_file()
    other = ResultsDestination(remote.as_uri(), staging_root=tmp_path / "node2")  # resumed elsewhere
    (other.local / "clients").mkdir(parents=True)
    (other.local / "clients" / "r@r000007.parquet").write_bytes(b"an older attempt on this node")
    other.pull("r")
    assert files_of(other.local) == files_of(remote)
    running = results.load(remote.as_uri())
    w.set_run({"status": "finished"})
    dest.push("r")
    assert files_of(remote) == files_of(dest.local) and not list(remote.glob("*/r@r*.parquet"))
    done = results.load(remote.as_uri())
    pd.testing.assert_frame_equal(done.rounds, running.rounds)
    pd.testing.assert_frame_equal(done.clients, running.clients)


def test_submodel_speed_benchmark_runs_its_write_case_tiny(capsys):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("submodel_speed_bench",
                                                  Path(__file__).resolve().parents[2] / "benchmarks" / "submodel_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--cases", "writes", "--write-rounds", "3", "--write-window", "2", "--write-clients", "2"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["case"] == "writes" and rec["rounds"] == 3 and rec["append_growth"] > 0 and rec["rewrite_growth"] > 0
