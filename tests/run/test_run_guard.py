"""What a run checks before it writes: its run id (alphabet, an id the folder holds, an id another
process is running), --out, the device, and on resume every file the run had written."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from faultkit import TINY, cli, runs_row, sets, tiny_run, tmpfs
from fedsap_ray import results
from fedsap_ray.persist import checkpoint
from fedsap_ray.config import build_config
from fedsap_ray.run.guard import RunClaim


@pytest.mark.parametrize("bad", ["../evil", "a/b", "..", ".hidden", "_x", "a..b", "compacted-1", "x" * 129, "",
                                 "a b", "a\\b"])
def test_an_unsafe_run_id_is_refused_before_any_work(tmp_path, capsys, bad):
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--out", str(tmp_path / "o"), "--run-id", bad)
    assert rc == 2 and len(lines) == 1 and f"invalid --run-id={bad!r}" in lines[0], lines
    assert not (tmp_path / "o").exists() and not (tmp_path / "evil.parquet").exists()


def test_the_run_id_alphabet_admits_generated_and_sweep_ids():
    cfg = build_config(preset="smoke")
    from fedsap_ray.experiment import new_run_id

    for ok in (new_run_id(cfg), "g_target=0.5-s0", "tabc123-s2", "A", "run.1_b-2"):
        assert results.check_run_id(ok) == ok


def test_an_existing_run_id_is_refused_and_overwrite_replaces_every_table(tmp_path, capsys):
    out = tmp_path / "o"
    tiny_run(out, "A", "algorithm.name=hasfl", "capacity.scheme=tiers", "data.num_clients=4")  # writes allocations
    before = runs_row(out, "A")
    assert (out / "allocations" / "A.parquet").is_file()
    args = ["run", "--preset", "smoke", "--quiet", "--out", str(out), "--run-id", "A", "--seed", "3",
            *sets(TINY)]
    rc, lines = cli(capsys, *args)
    assert rc == 2 and len(lines) == 1 and "invalid --run-id='A'" in lines[0] and "--overwrite" in lines[0], lines
    assert runs_row(out, "A") == before  # untouched
    rc, lines = cli(capsys, *args, "--overwrite")
    assert rc == 0, lines
    res = results.load(out)
    assert res.runs["seed"].tolist() == [3] and res.runs["algorithm"].tolist() == ["fedavg"]
    assert res.allocations.empty  # the old run's table went with it, not inherited by the new run
    assert sorted(res.rounds["round"].unique()) == [1, 2, 3]


def _hold_claim(out: Path, run_id: str) -> subprocess.Popen:
    code = ("import sys; from fedsap_ray.run.guard import RunClaim; c = RunClaim(sys.argv[1], sys.argv[2]); "
            "c.acquire(); print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(out), run_id], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_resume_takes_no_new_run_options(tmp_path, capsys):
    rc, lines = cli(capsys, "run", "--out", str(tmp_path), "--resume", "r", "--overwrite")
    assert rc == 2 and len(lines) == 1 and "invalid --resume='r'" in lines[0], lines


def test_a_run_id_another_process_is_running_is_refused_and_a_killed_holder_leaves_no_claim(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    holder = _hold_claim(out, "A")
    try:
        rc, lines = cli(capsys, "run", "--preset", "smoke", "--out", str(out), "--run-id", "A")
        assert rc == 2 and len(lines) == 1 and "invalid --run-id='A'" in lines[0], lines
        assert f"pid {holder.pid}" in lines[0] and "another process" in lines[0]
        assert not (out / "runs").exists()
    finally:
        holder.kill()  # kill -9: the kernel drops the lock with the process
        holder.wait()
    with RunClaim(out, "A"):  # free again
        pass
    holder = _hold_claim(out, "B")  # a clean exit releases it as well
    holder.stdin.close()
    holder.wait()
    with RunClaim(out, "B"):
        pass


def test_cuda_without_a_gpu_exits_2(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--out", str(tmp_path / "o"), "--set", "resources.device=cuda")
    assert rc == 2 and len(lines) == 1 and "invalid resources.device='cuda'" in lines[0], lines


def test_an_out_that_is_a_file_or_not_writable_exits_2(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    for out in (f, f / "sub"):
        rc, lines = cli(capsys, "run", "--preset", "smoke", "--out", str(out))
        assert rc == 2 and len(lines) == 1 and f"invalid --out={str(out)!r}" in lines[0], lines
    with tmpfs(tmp_path / "ro", "size=1m,ro") as ro:  # read-only even for root
        rc, lines = cli(capsys, "run", "--preset", "smoke", "--out", str(ro / "o"))
        assert rc == 2 and len(lines) == 1 and "invalid --out=" in lines[0] and "Read-only" in lines[0], lines


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory) -> Path:
    """A tiny run interrupted after round 2 (checkpoint at round 2)."""
    out = tmp_path_factory.mktemp("cut")
    tiny_run(out, "r", stop_after=2)
    return out


@pytest.mark.parametrize("damage, needle", [
    (lambda o: (o / "rounds" / "r.parquet").unlink(), "rounds/r.parquet is missing"),
    (lambda o: (o / "clients" / "r.parquet").unlink(), "clients/r.parquet is missing"),
    (lambda o: os.truncate(o / "clients" / "r.parquet", 100), "clients/r.parquet is unreadable"),
    (lambda o: os.truncate(o / "checkpoints" / "r.npz", 1000), "checkpoints/r.npz is unreadable"),
    (lambda o: os.truncate(o / "runs" / "r.parquet", 100), "runs/r.parquet is unreadable"),
    (lambda o: _keep_round(o / "rounds" / "r.parquet", 1), "lacks rounds 2"),
])
def test_resume_refuses_when_a_file_the_run_wrote_is_missing_or_damaged(cut_run, tmp_path, capsys, damage, needle):
    out = tmp_path / "o"
    shutil.copytree(cut_run, out)
    damage(out)
    rc, lines = cli(capsys, "run", "--out", str(out), "--resume", "r")
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("fedsap-ray: error: invalid --resume='r'") and needle in lines[0], lines


def _keep_round(f: Path, upto: int) -> None:
    t = pq.read_table(f)
    pq.write_table(t.filter(np.asarray(t.column("round")) <= upto), f)


def test_an_intact_interrupted_run_still_resumes(cut_run, tmp_path, capsys):
    out = tmp_path / "o"
    shutil.copytree(cut_run, out)
    rc, lines = cli(capsys, "run", "--quiet", "--out", str(out), "--resume", "r")
    assert rc == 0, lines
    assert sorted(results.load(out).rounds["round"].unique()) == [1, 2, 3]


def test_stale_temp_files_of_a_killed_writer_are_removed_when_the_run_resumes(tmp_path, capsys):
    tiny_run(tmp_path, "r", stop_after=1)
    stale = [tmp_path / "rounds" / ".r.parquet.deadbeef.tmp", tmp_path / "checkpoints" / ".r.npz.deadbeef.tmp"]
    for f in stale:
        f.write_bytes(b"x" * 1000)
    other = tmp_path / "rounds" / ".other.parquet.deadbeef.tmp"  # another run's: not ours to delete
    other.write_bytes(b"y")
    rc, lines = cli(capsys, "run", "--quiet", "--out", str(tmp_path), "--resume", "r")
    assert rc == 0, lines
    assert not any(f.exists() for f in stale) and other.exists()


def test_a_truncated_checkpoint_names_the_file(tmp_path):
    tiny_run(tmp_path, "r", stop_after=1)
    os.truncate(checkpoint.path_for(tmp_path, "r"), 500)
    with pytest.raises(checkpoint.CheckpointUnreadable, match=str(checkpoint.path_for(tmp_path, "r"))):
        checkpoint.load(tmp_path, "r")
