"""A failed run keeps its original error and leaves nothing behind: a full disk, a runs row that
cannot be written."""
from __future__ import annotations

import os

import pytest

from faultkit import TINY, cli, runs_row, sets, temp_files, tmpfs
from fedsap_ray import results
from fedsap_ray.persist import checkpoint
from fedsap_ray.config import build_config
from fedsap_ray.experiment import run_experiment


def test_a_full_disk_keeps_the_original_error_leaves_no_temp_file_and_resumes_once_freed(tmp_path, capsys):
    # the reproduction: a 2 MB tmpfs holds no checkpoint of the smoke run at all
    with tmpfs(tmp_path / "small", "size=2m") as mnt:
        rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(mnt / "o"), "--run-id", "full")
        assert rc == 1
        assert lines[0].startswith("fedsap-ray: run failed: OSError: [Errno 28] No space left on device: "), lines
        assert str(mnt / "o") in lines[0], lines  # names the file it failed on
        assert temp_files(mnt) == []
        row = runs_row(mnt / "o", "full")  # writable again once the temporary checkpoint was removed
        assert row["status"] == "failed" and "No space left on device" in row["error"]
    # the disk fills during round 2; freeing it lets the run resume to the end
    with tmpfs(tmp_path / "big", "size=8m") as mnt:
        out = mnt / "o"
        filler = mnt / "filler"

        def fill_after_round_1(summary):
            if summary.round == 1:
                st = os.statvfs(mnt)
                with open(filler, "wb") as f:  # leave less than a checkpoint, more than a runs row
                    os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - 96 * 1024)

        cfg = build_config(preset="smoke", overrides=["algorithm.name=fedavg", "training.rounds=3"])
        with pytest.raises(OSError) as e:
            run_experiment(cfg, out, run_id="r", progress=fill_after_round_1)
        assert e.value.errno == 28 and not getattr(e.value, "__notes__", None)
        assert temp_files(mnt) == []
        row = runs_row(out, "r")
        assert row["status"] == "failed" and "No space left on device" in row["error"] and row["rounds_done"] == 1
        filler.unlink()
        rc, lines = cli(capsys, "run", "--quiet", "--out", str(out), "--resume", "r")
        assert rc == 0, lines
        assert runs_row(out, "r")["status"] == "finished"
        assert sorted(results.load(out).rounds["round"].unique()) == [1, 2, 3]
        assert temp_files(mnt) == [] and not checkpoint.path_for(out, "r").exists()


def test_a_runs_row_that_cannot_be_written_never_replaces_the_error(tmp_path, capsys, monkeypatch):
    from fedsap_ray.results import RunWriter
    from fedsap_ray.engine.server import Server

    real_round, real_set_run = Server.round, RunWriter.set_run

    def round_2_breaks(self, state, t):
        if t == 2:
            raise RuntimeError("boom in round 2")
        return real_round(self, state, t)

    def set_run(self, row):
        if row["status"] != "running":
            raise OSError(28, "No space left on device")
        return real_set_run(self, row)

    monkeypatch.setattr(Server, "round", round_2_breaks)
    monkeypatch.setattr(RunWriter, "set_run", set_run)
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path), "--run-id", "x",
                    *sets(TINY))
    assert rc == 1
    assert lines[0] == "fedsap-ray: run failed: RuntimeError: boom in round 2", lines
    assert lines[1].startswith("fedsap-ray: also: the runs row could not be updated to status 'failed': OSError")


def test_a_disk_full_error_names_the_file_it_failed_on(tmp_path, monkeypatch):
    """A write on a full disk raises ENOSPC with no file name; atomic_write adds the file's own path
    (what the user must free space for), and leaves no temporary file."""
    from fedsap_ray.persist.atomic import atomic_write

    target = tmp_path / "checkpoints" / "r.npz"
    with pytest.raises(OSError) as e:
        with atomic_write(target) as f:
            f.write(b"x")
            raise OSError(28, "No space left on device")
    assert e.value.errno == 28 and str(e.value) == f"[Errno 28] No space left on device: {str(target)!r}"
    assert temp_files(tmp_path) == [] and not target.exists()
    with pytest.raises(OSError) as e:  # an error that already names its file keeps it
        with atomic_write(target):
            raise FileNotFoundError(2, "No such file or directory", "/elsewhere")
    assert e.value.filename == "/elsewhere"


def _losing(monkeypatch, lose) -> None:
    """``fedsap-ray run``'s progress line, replaced by ``lose()`` after round 1 (something deleting files while the
    run goes on: another user, a cleanup script, an ``rm -r`` of the wrong folder)."""
    import fedsap_ray.run.progress

    class Printer:
        def __init__(self, rounds: int) -> None:
            pass

        def __call__(self, summary) -> None:
            if summary.round == 1:
                lose()

    monkeypatch.setattr(fedsap_ray.run.progress, "ProgressPrinter", Printer)


@pytest.mark.parametrize("what", ["the-folder", "a-table-folder", "a-part", "the-runs-file"])
def test_a_run_whose_written_rows_are_gone_stops_with_exit_2_instead_of_finishing_incomplete(tmp_path, capsys,
                                                                                            monkeypatch, what):
    """Before, the folder was recreated and the run ended ``finished`` holding only rounds 2-3: the writer checks
    that every file it wrote is still there before each round's write (results.writer.RowsLost). Nothing is
    recreated; where the run's own runs file survived it says ``failed`` and why."""
    import shutil

    out = tmp_path / "o"
    lose = {"the-folder": lambda: shutil.rmtree(out), "a-table-folder": lambda: shutil.rmtree(out / "clients"),
            "a-part": lambda: (out / "rounds" / "x@r000001.parquet").unlink(),
            "the-runs-file": lambda: (out / "runs" / "x.parquet").unlink()}[what]
    _losing(monkeypatch, lose)
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--out", str(out), "--run-id", "x", *sets(TINY))
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("fedsap-ray: error: run x: "), lines
    assert "the run stops rather than finish without those rows" in lines[0], lines
    if what == "the-folder":
        assert "its results folder" in lines[0] and not out.exists()  # not recreated
        return
    assert not any(p.name.startswith("x@r000002") for p in out.rglob("*")), "round 2 was written"
    if what == "the-runs-file":
        assert not (out / "runs" / "x.parquet").exists()  # not recreated either
    else:
        row = runs_row(out, "x")
        assert row["status"] == "failed" and "RowsLost" in row["error"] and row["rounds_done"] == 1
