"""Readers that refuse or reconcile hostile tables, by name (issue 52): every way a table file can be hostile is
either read as the intact folder reads or refused with one line naming the file, by ``results.load``,
``read_table``, ``run_statuses``, ``fedsap-ray compact``, every ``python -m analysis.X`` (exit 2) and the notebook
helpers. The folders are written by hand (``results.to_table``, as a run writes its files): no training, seconds."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from analysis import device_time, learning, runs as aruns
from analysis.confound import cli as confound_cli
from fedsap_ray import results
from fedsap_ray.cli import main as cli_main
from fedsap_ray.results import UPTO_KEY, schema as rschema
from fedsap_ray.results.reader import castable
from fedsap_ray.results.store import UnreadableFile, foreign_reason
from fuzzkit import snapshot

V = results.SCHEMA_VERSION
DOMAINS = ("a", "b", results.GLOBAL_DOMAIN)


def config(seed: int) -> str:
    return json.dumps({"seed": seed, "study": "readers", "algorithm": {"name": "fedavg", "options": {}},
                       "training": {"rounds": 3}, "data": {"name": "embedded_digits"}})


def rows_of(run_id: str, seed: int, rounds: int = 3) -> dict[str, list[dict]]:
    base = {"schema_version": V, "run_id": run_id}
    return {
        "runs": [{**base, "status": "finished", "seed": seed, "algorithm": "fedavg", "study": "readers", "rounds": rounds,
                  "rounds_done": rounds, "config_json": config(seed), "final_global_accuracy": 0.3 + seed / 10}],
        "rounds": [{**base, "round": t, "domain": d, "eval_mode": "global", "evaluated": True,
                    "accuracy": 0.1 * t + seed / 100, "global_accuracy": 0.1 * t + seed / 100, "train_loss": 2.0 / t,
                    "frozen_params": 7 * t, "n_test": 10, "bytes_up": 1000 * t}
                   for t in range(1, rounds + 1) for d in DOMAINS],
        "clients": [{**base, "round": t, "client_id": c, "capacity_used": 0.25 * (c + 1), "worker": "local",
                     "n_global": 3 + c, "train_loss": 1.0 / t}
                    for t in range(1, rounds + 1) for c in range(2)],
    }


def write(path: Path, table: str, rows: list[dict], metadata: dict | None = None) -> None:
    t = results.to_table(table, rows)
    results.write_atomic(t.replace_schema_metadata(metadata) if metadata else t, path)


def write_run(out: Path, run_id: str, seed: int) -> None:
    for table, rows in rows_of(run_id, seed).items():
        write(out / table / f"{run_id}.parquet", table, rows)


def rewrite(path: Path, change) -> None:
    """Rewrite a Parquet file with ``change(table)`` (a hand edit: pyarrow, not this package's writer)."""
    t = pq.read_table(path)
    pq.write_table(change(t), path)


def set_column(t: pa.Table, name: str, values) -> pa.Table:
    return t.set_column(t.schema.get_field_index(name), name, values)


@pytest.fixture
def folder(tmp_path) -> Path:
    """Two finished runs, r0 and r1, one file per run and table."""
    out = tmp_path / "res"
    write_run(out, "r0", 0)
    write_run(out, "r1", 1)
    return out


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> results.Results:
    out = tmp_path_factory.mktemp("intact") / "res"
    write_run(out, "r0", 0)
    write_run(out, "r1", 1)
    return results.load(out)


KEYS = {t: list(k) for t, k in results.ROW_KEYS.items()}


def same(a: results.Results, b: results.Results, ignore: tuple[str, ...] = ()) -> None:
    """Every table of ``a`` and ``b`` holds the same rows (order aside), columns ``ignore`` aside."""
    for t in ("runs", "rounds", "clients"):
        x, y = (df.drop(columns=[c for c in ignore if c in df.columns]).sort_values(KEYS[t]).reset_index(drop=True)
                for df in (a[t], b[t]))
        pd.testing.assert_frame_equal(x, y)


# ----------------------------------------------------------------------------- refused, naming the file

def copy_under_another_name(out: Path) -> None:
    shutil.copy(out / "rounds" / "r0.parquet", out / "rounds" / "r7.parquet")


def copy_over_another_run(out: Path) -> None:
    shutil.copy(out / "runs" / "r0.parquet", out / "runs" / "r1.parquet")


def part_of_another_round(out: Path) -> None:  # r1's round 2 again, as a part of round 4 (r1 merged up to round 3)
    rows = rows_of("r1", 1)["clients"]
    write(out / "clients" / "r1.parquet", "clients", rows, {UPTO_KEY: b"3"})
    write(out / "clients" / "r1@r000004.parquet", "clients", [r for r in rows if r["round"] == 2])


def part_of_another_run(out: Path) -> None:
    write(out / "clients" / "r5@r000001.parquet", "clients", [r for r in rows_of("r0", 0)["clients"] if r["round"] == 1])


def row_twice_in_a_file(out: Path) -> None:
    rewrite(out / "clients" / "r0.parquet", lambda t: pa.concat_tables([t, t.slice(3, 1)]))


def row_in_a_file_and_a_live_part(out: Path) -> None:  # the per-run file says it holds rounds up to 2, yet has round 3
    rows = rows_of("r1", 1)["rounds"]
    write(out / "rounds" / "r1.parquet", "rounds", rows, {UPTO_KEY: b"2"})
    write(out / "rounds" / "r1@r000003.parquet", "rounds", [r for r in rows if r["round"] == 3])


def two_compacted_files_that_differ(out: Path) -> None:
    results.compact(out)
    (c,) = (out / "rounds").glob("compacted-*.parquet")
    shutil.copy(c, out / "rounds" / "compacted-ffffffff.parquet")
    rewrite(out / "rounds" / "compacted-ffffffff.parquet",
            lambda t: set_column(t, "accuracy", pc.add(t["accuracy"], 0.5)))


def newer_schema_version(out: Path) -> None:
    rewrite(out / "rounds" / "r1.parquet", lambda t: set_column(t, "schema_version", pa.array([V + 1] * len(t), pa.int32())))


def unknown_schema_version(out: Path) -> None:
    rewrite(out / "clients" / "r0.parquet", lambda t: set_column(t, "schema_version", pa.array([0] * len(t), pa.int32())))


def a_column_its_version_had_missing(out: Path) -> None:  # domain_coverage came with version 3
    rewrite(out / "rounds" / "r1.parquet", lambda t: t.drop_columns(["domain_coverage"]))


def a_key_column_missing(out: Path) -> None:
    rewrite(out / "runs" / "r1.parquet", lambda t: t.drop_columns(["status"]))


def text_where_a_number_belongs(out: Path) -> None:
    rewrite(out / "rounds" / "r1.parquet", lambda t: set_column(t, "accuracy", pc.cast(t["accuracy"], pa.string())))


def a_value_its_type_cannot_hold(out: Path) -> None:
    rewrite(out / "clients" / "r1.parquet",
            lambda t: set_column(t, "client_id", pa.array([0.5] + [float(c) for c in t["client_id"].to_pylist()[1:]])))


def a_column_twice(out: Path) -> None:
    rewrite(out / "rounds" / "r0.parquet", lambda t: t.append_column("loss", t["loss"]))


def config_not_json(out: Path) -> None:
    rewrite(out / "runs" / "r1.parquet", lambda t: set_column(t, "config_json", pa.array(['{"seed": 1,'])))


def config_a_list(out: Path) -> None:
    rewrite(out / "runs" / "r1.parquet", lambda t: set_column(t, "config_json", pa.array(["[1, 2]"])))


def config_a_number(out: Path) -> None:
    rewrite(out / "runs" / "r1.parquet", lambda t: set_column(t, "config_json", pa.array(["7"])))


# (how the folder is made hostile, what the one line must say: the file, relative to the folder, and the problem)
REFUSED = {
    "a per-run file copied under another run's name": (copy_under_another_name, ["rounds/r7.parquet", "of run r0"]),
    "a runs file copied over another run's": (copy_over_another_run, ["runs/r1.parquet", "of run r0"]),
    "a part of another round": (part_of_another_round, ["clients/r1@r000004.parquet", "round 2"]),
    "a part of another run": (part_of_another_run, ["clients/r5@r000001.parquet", "of run r0"]),
    "a row twice in a file": (row_twice_in_a_file, ["clients/r0.parquet", "2 times", "client_id=1"]),
    "a row in a per-run file and in a live part": (row_in_a_file_and_a_live_part,
                                                   ["rounds/r1.parquet", "rounds/r1@r000003.parquet", "round=3"]),
    "a run in two compacted files, with different rows": (two_compacted_files_that_differ,
                                                          ["rounds/compacted-ffffffff.parquet", "different rows"]),
    "a newer schema_version": (newer_schema_version, ["rounds/r1.parquet", f"schema_version {V + 1}", f"({V})"]),
    "an unknown schema_version": (unknown_schema_version, ["clients/r0.parquet", "schema_version 0"]),
    "a column its version had, missing": (a_column_its_version_had_missing, ["rounds/r1.parquet", "domain_coverage"]),
    "a key column missing": (a_key_column_missing, ["runs/r1.parquet", "status"]),
    "text where a number belongs": (text_where_a_number_belongs, ["rounds/r1.parquet", "accuracy", "string", "double"]),
    "a value its type cannot hold": (a_value_its_type_cannot_hold, ["clients/r1.parquet", "client_id"]),
    "a column twice": (a_column_twice, ["rounds/r0.parquet", "loss twice"]),
    "config_json that is not JSON": (config_not_json, ["runs/r1.parquet", "run r1", "config_json is not JSON"]),
    "config_json that is a JSON list": (config_a_list, ["runs/r1.parquet", "run r1", "JSON array"]),
    "config_json that is a JSON number": (config_a_number, ["runs/r1.parquet", "run r1", "JSON number"]),
}
CONFIG_CASES = {k for k in REFUSED if k.startswith("config_json")}  # compact moves config_json, never reads it


def refusal(fn) -> str:
    with pytest.raises(UnreadableFile) as e:
        fn()
    text = str(e.value)
    assert "\n" not in text and len(text) < 400, text
    return text


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_hostile_table_is_refused_in_one_line_naming_the_file(folder, case):
    make, said = REFUSED[case]
    make(folder)
    before = snapshot(folder)
    line = refusal(lambda: results.load(folder))
    for part in said:
        assert part in line, (part, line)
    table = next(t for t in ("runs", "rounds", "clients") if f"{t}/" in said[0])
    assert refusal(lambda: results.read_table(folder, table)) == line
    if table == "runs" and case not in CONFIG_CASES:
        assert refusal(lambda: results.run_statuses(folder)) == line
    with pytest.raises(UnreadableFile):  # the notebook helpers: the same one-line error
        aruns.per_run(str(folder))
    assert snapshot(folder) == before


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_compact_refuses_a_hostile_table_before_it_changes_anything(folder, case, capsys):
    make, said = REFUSED[case]
    make(folder)
    write(folder / "clients" / "r8@r000001.parquet", "clients", rows_of("r8", 8)["clients"][:2])  # a final run's
    write(folder / "runs" / "r8.parquet", "runs", rows_of("r8", 8)["runs"])  # part, which compact would merge first
    before = snapshot(folder)
    rc = cli_main(["compact", str(folder)])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    if case in CONFIG_CASES:
        assert rc == 0
        return
    assert rc == 2 and len(err) == 1 and said[0] in err[0], err
    assert snapshot(folder) == before


PROGS = {"analysis.learning": lambda f: learning.main([f]), "analysis.device_time": lambda f: device_time.main([f"wait_all={f}"]),
         "analysis.confound": lambda f: confound_cli.main([f])}


@pytest.mark.parametrize("prog", sorted(PROGS))
def test_every_analysis_command_exits_2_with_the_readers_line(folder, prog, tmp_path):
    for case in ("a per-run file copied under another run's name", "a row twice in a file", "config_json that is a JSON list",
                 "a newer schema_version"):
        out = tmp_path / case.replace(" ", "_")
        shutil.copytree(folder, out)
        REFUSED[case][0](out)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as e:
            PROGS[prog](str(out))
        lines = [x for x in err.getvalue().splitlines() if x.strip()]
        assert e.value.code == 2 and len(lines) == 1, (case, lines)
        assert lines[0].startswith(f"{prog}: error: results file") and REFUSED[case][1][0] in lines[0], (case, lines)


# ----------------------------------------------------------------------------- read as the intact folder reads

def test_an_extra_column_is_ignored_never_dropping_the_table(folder, intact):
    """Before: one extra column made the whole file 'foreign', skipped with only a Python warning."""
    rewrite(folder / "rounds" / "r1.parquet", lambda t: t.append_column("note", pa.array(["x"] * len(t))))
    rewrite(folder / "runs" / "r0.parquet", lambda t: t.append_column("layer", pa.array(["l1"])))  # another table's key
    same(results.load(folder), intact)
    assert "note" not in results.read_table(folder, "rounds").columns


@pytest.mark.parametrize("column,to", [("bytes_up", pa.float64()), ("frozen_params", pa.int32()),
                                       ("domain", pa.large_string()), ("eval_mode", "dictionary"),
                                       ("n_eval_clients", pa.null())])
def test_a_column_in_another_width_or_encoding_reads_as_the_same_values(folder, intact, column, to):
    """What a pandas round trip or another writer does to a column (an integer with nulls as float64, 32-bit
    integers, large or dictionary strings, a column of nulls): the same values, cast value by value."""
    c = {"dictionary": pc.dictionary_encode, pa.null(): lambda col: pa.nulls(len(col))}.get(to, lambda col: pc.cast(col, to))
    rewrite(folder / "rounds" / "r1.parquet", lambda t: set_column(t, column, c(t[column])))
    same(results.load(folder), intact)


def test_a_version_1_file_lacks_the_later_columns_and_reads_them_as_nulls(folder, intact):
    """Schema evolution: a file of version v needs only the columns of versions <= v (COLUMNS_SINCE)."""
    later = ["frozen_params", "domain_coverage", "train_s"]  # versions 2, 3 and 5
    rewrite(folder / "rounds" / "r1.parquet",
            lambda t: set_column(t.drop_columns(later), "schema_version", pa.array([1] * len(t), pa.int32())))
    res = results.load(folder)
    r1 = res.rounds[res.rounds.run_id == "r1"]
    assert r1[later].isna().all().all() and (r1["schema_version"] == 1).all()
    same(res, intact, ignore=("schema_version", *later))


def test_a_column_a_strategy_declares_is_never_required(folder, intact):
    """Strategies add columns without a schema version: an older file lacks the newer ones."""
    rewrite(folder / "clients" / "r0.parquet", lambda t: t.drop_columns(["n_global"]))
    res = results.load(folder)
    assert res.clients.loc[res.clients.run_id == "r0", "n_global"].isna().all()
    same(res, intact, ignore=("n_global",))


def test_a_null_schema_version_reads_as_version_1(folder, intact):
    rewrite(folder / "runs" / "r1.parquet", lambda t: set_column(t, "schema_version", pa.nulls(1, pa.int32())))
    res = results.load(folder)
    assert pd.isna(res.runs.set_index("run_id").loc["r1", "schema_version"])
    same(res, intact, ignore=("schema_version",))


def test_a_copied_compacted_file_is_one_run_read_once(folder, intact):
    """Equal rows in two compacted files: a copy (compact never leaves a run in two compacted files)."""
    results.compact(folder)
    for table in ("runs", "rounds", "clients"):
        (c,) = (folder / table).glob("compacted-*.parquet")
        shutil.copy(c, folder / table / "compacted-ffffffff.parquet")
    same(results.load(folder), intact)
    assert results.run_statuses(folder) == {"r0": "finished", "r1": "finished"}


def test_a_run_in_parts_reads_as_its_merged_file(folder, intact):
    """A run killed before merging its parts, and one killed after writing the merged file (its parts still there)."""
    for run_id, keep in (("r0", False), ("r1", True)):
        for table in ("rounds", "clients"):
            rows = rows_of(run_id, int(run_id[1]))[table]
            for t in (1, 2, 3):
                write(folder / table / f"{run_id}@r{t:06d}.parquet", table, [r for r in rows if r["round"] == t])
            if keep:
                write(folder / table / f"{run_id}.parquet", table, rows, {UPTO_KEY: b"3"})
            else:
                (folder / table / f"{run_id}.parquet").unlink()
    same(results.load(folder), intact)


def test_a_file_of_another_table_is_told_apart_by_its_key_columns(folder, intact):
    """A layers file among the clients has the clients' key columns too: it is told apart by having the layers'
    and more of their columns; skipped with a warning, never read as clients rows of mostly nulls."""
    write(folder / "clients" / "stray.parquet", "layers",
          [{"schema_version": V, "run_id": "r0", "round": 1, "client_id": 0, "layer": "l1", "channels": 8,
            "keep_ratio": 0.5}])
    shutil.copy(folder / "runs" / "r0.parquet", folder / "rounds" / "stray.parquet")
    with pytest.warns(UserWarning) as caught:
        res = results.load(folder)
    said = " ".join(str(w.message) for w in caught)
    assert "clients/stray.parquet: not a file of the clients table: it is a file of the layers table" in said
    assert "rounds/stray.parquet: not a file of the rounds table: it is a file of the runs table" in said
    same(res, intact)


def test_foreign_reason_tells_tables_apart_and_keeps_damaged_files_of_the_table():
    names = {t: rschema(t).names for t in results.TABLES}
    for t in results.TABLES:
        assert foreign_reason(names[t], t) is None
        assert foreign_reason([*names[t], "note", "status", "domain"], t) is None  # added columns: still its file
        for other in results.TABLES:
            if other != t:
                assert foreign_reason(names[other], t) is not None, (other, t)
    assert foreign_reason([c for c in names["runs"] if c != "status"], "runs") is None  # damaged: refused by name
    assert "lacks the key column" in foreign_reason(["x"], "runs")


def test_castable_accepts_other_widths_and_encodings_never_text_for_numbers():
    ok = [(pa.float64(), pa.int64()), (pa.int32(), pa.int64()), (pa.int64(), pa.float64()), (pa.null(), pa.string()),
          (pa.large_string(), pa.string()), (pa.dictionary(pa.int32(), pa.string()), pa.string()),
          (pa.timestamp("ns", tz="UTC"), pa.timestamp("us", tz="UTC")), (pa.bool_(), pa.bool_())]
    no = [(pa.string(), pa.float64()), (pa.int64(), pa.string()), (pa.bool_(), pa.int64()), (pa.int64(), pa.bool_()),
          (pa.timestamp("us"), pa.timestamp("us", tz="UTC")), (pa.list_(pa.int64()), pa.int64()),
          (pa.string(), pa.timestamp("us", tz="UTC")), (pa.binary(), pa.string()),
          (pa.timestamp("ns", tz="UTC"), pa.int64()), (pa.int64(), pa.timestamp("us", tz="UTC"))]  # a fuzz finding
    assert all(castable(a, b) for a, b in ok) and not any(castable(a, b) for a, b in no)


def test_every_core_column_has_the_version_that_brought_it():
    """A new core column must be listed in COLUMNS_SINCE under its version; else no file is required to have it."""
    for table, cols in results.CORE_TABLES.items():
        listed = results.required_columns(table, V)
        assert sorted(listed) == sorted(c.name for c in cols), table
        assert set(results.ROW_KEYS[table]) <= set(results.required_columns(table, 1))
    assert results.required_columns("rounds", 2) == [*results.required_columns("rounds", 1), "ari_domain", "frozen_params"]


# ----------------------------------------------------------------------------- config_json and the notebook helpers

def test_with_config_columns_names_the_run_of_a_damaged_config():
    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "config_json": [config(0), None, "[1]"]})
    with pytest.raises(UnreadableFile, match=r"^run c's config_json is a JSON array, not an object$"):
        results.with_config_columns(runs)
    ok = results.with_config_columns(runs.iloc[:2])
    assert ok["config.seed"].tolist()[0] == 0 and pd.isna(ok["config.seed"].tolist()[1])  # null: no config values


def test_the_notebook_helpers_refuse_a_results_object_holding_a_run_twice(folder):
    res = results.load(folder)
    twice = aruns.replace_tables(res, runs=pd.concat([res.runs, res.runs.iloc[:1]], ignore_index=True))
    with pytest.raises(aruns.DuplicateRuns, match=r"^the runs table holds run r0 2 times"):
        aruns.per_run(twice)
    pr = aruns.per_run(res)
    assert sorted(pr["run_id"]) == ["r0", "r1"] and pr["seed"].tolist() == [0, 1]


def test_load_sweep_gives_each_seed_once(folder):
    """Before: a copied per-run file came back as a second run, so a mean over seeds had a std of 0 over one seed."""
    copy_under_another_name(folder)
    with pytest.raises(UnreadableFile, match="r7.parquet"):
        aruns.load_sweep(str(folder))
    (folder / "rounds" / "r7.parquet").unlink()
    pr = aruns.per_run(str(folder))
    assert len(pr) == 2 and pr["seed"].is_unique


@pytest.mark.parametrize("text,kind", [("[1, 2]", "list"), ("7", "int"), ('"x"', "str")])
def test_a_resume_of_a_run_whose_config_json_is_no_object_exits_2(folder, capsys, text, kind):
    """The leftover of issue 52: a runs row whose config_json is a JSON list was a traceback (AttributeError)."""
    write(folder / "runs" / "r1.parquet", "runs", [{**rows_of("r1", 1)["runs"][0], "status": "interrupted",
                                                   "config_json": text}])
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "r1.npz").write_bytes(b"a checkpoint")
    before = snapshot(folder)
    rc = cli_main(["run", "--out", str(folder), "--resume", "r1", "--quiet"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1 and "config_json that is no JSON object" in err[0] and f"({kind})" in err[0], err
    assert snapshot(folder) == before


def test_a_per_run_file_that_says_it_holds_a_part_it_lacks_is_refused(folder):
    """A run's merged file whose fedsap_ray.upto_round covers a part it has no rows of: readers would skip the
    part and lose its round."""
    rows = rows_of("r1", 1)["rounds"]
    write(folder / "rounds" / "r1.parquet", "rounds", [r for r in rows if r["round"] < 3], {UPTO_KEY: b"3"})
    write(folder / "rounds" / "r1@r000003.parquet", "rounds", [r for r in rows if r["round"] == 3])
    line = refusal(lambda: results.load(folder))
    assert "rounds/r1.parquet has no rows of round 3" in line and "r1@r000003.parquet" in line, line
    write(folder / "rounds" / "r1.parquet", "rounds", rows, {UPTO_KEY: b"3"})  # the merge that was interrupted
    assert len(results.load(folder).rounds) == 2 * 3 * 3


def test_compact_keeps_the_per_run_rows_readers_give_over_an_edited_compacted_copy(folder, capsys):
    """A fuzz finding: a per-run file older than a compacted file holding its run was deleted as the leftover of
    an interrupted compaction, leaving the compacted copy's other rows in its place."""
    before = results.load(folder)
    results.compact(folder)
    write_run(folder, "r1", 1)  # back, as if compaction had been interrupted before deleting it ...
    (c,) = (folder / "runs").glob("compacted-*.parquet")
    rewrite(c, lambda t: set_column(t, "wall_s", pa.array([9.0 if r == "r1" else w for r, w in zip(  # ... but its
        t["run_id"].to_pylist(), t["wall_s"].to_pylist())], pa.float64())))  # compacted row edited since
    for table in ("runs", "rounds", "clients"):
        f = folder / table / "r1.parquet"
        os.utime(f, ns=(1, 1))  # older than the compacted files: what a leftover looks like
    same(results.load(folder), before)
    assert cli_main(["compact", str(folder)]) == 0
    same(results.load(folder), before)
    assert not (folder / "runs" / "r1.parquet").exists()
