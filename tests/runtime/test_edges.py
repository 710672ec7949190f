"""Clean failures at the edges (issue 40): Ray addresses fail in seconds naming the option that gave them,
``--address`` belongs to the Ray backend, and every analysis command line exits 2 with one line on a
folder it cannot read. Nothing here starts Ray or sends traffic anywhere but 127.0.0.1."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from faultkit import cli
from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.runtime import address

REPO = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------- Ray addresses
def test_address_without_the_ray_backend_is_refused(tmp_path, capsys):
    rc, err = cli(capsys, "run", "--preset", "smoke", "--out", str(tmp_path), "--address", "127.0.0.1:6379")
    assert rc == 2 and len(err) == 1 and "--address" in err[0] and "--backend ray" in err[0], err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("form", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}", "localhost:{port}"])
def test_an_unreachable_address_is_refused_naming_address(tmp_path, capsys, form):
    given = form.format(port=closed_port())
    rc, err = cli(capsys, "run", "--preset", "smoke", "--out", str(tmp_path), "--backend", "ray", "--address", given)
    assert rc == 2 and len(err) == 1, err
    assert f"invalid --address={given!r}" in err[0] and "no Ray cluster answers" in err[0]
    assert not (tmp_path / "runs").exists()


def test_a_listening_address_passes_the_check():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        address.check_reachable(f"127.0.0.1:{srv.getsockname()[1]}", "--address")  # no error
    address.check_reachable(None, "--address")
    address.check_reachable("local", "--address")


@pytest.mark.parametrize("env, needle", [("garbage", "must be auto, local, HOST:PORT"),
                                         ("127.0.0.1:{port}", "no Ray cluster answers")])
def test_connect_checks_RAY_ADDRESS_naming_it(monkeypatch, env, needle):
    from fedsap_ray.runtime import ray as runtime_ray

    monkeypatch.setenv("RAY_ADDRESS", env.format(port=closed_port()))
    monkeypatch.setattr(runtime_ray.ray, "is_initialized", lambda: False)  # the check comes before ray.init
    monkeypatch.setattr(runtime_ray.ray, "init", lambda **kw: pytest.fail("ray.init reached"))
    with pytest.raises(ConfigError, match="^invalid RAY_ADDRESS=") as e:
        runtime_ray.connect(None)
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^invalid --address='127\.0\.0\.1:1'"):  # the option wins over the env
        runtime_ray.connect("127.0.0.1:1", field="--address")


def test_auto_without_a_cluster_is_refused(monkeypatch):
    from ray._private import services

    def none_running(addr, temp_dir=None):
        raise ConnectionError("Could not find any running Ray instance. Please specify ...")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "canonicalize_bootstrap_address_or_die", none_running)
    with pytest.raises(ConfigError, match=r"^invalid resources\.address='auto': no Ray cluster is running"):
        address.check_reachable("auto", "resources.address")
    port = closed_port()
    monkeypatch.setattr(services, "canonicalize_bootstrap_address_or_die", lambda addr, temp_dir=None: f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=f"auto found the cluster at 127.0.0.1:{port}"):
        address.check_reachable("auto", "--address")


# ---------------------------------------------------------------------------------------- analysis CLIs
def write_runs(out: Path, rows: list[dict]) -> None:
    """A results folder holding only ``rows`` in its runs table (one file per run, as runs write it)."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    sch = results.schema("runs").empty_table().schema
    for row in rows:
        pq.write_table(pa.Table.from_pylist([row], schema=sch), out / "runs" / f"{row['run_id']}.parquet")


def run_row(run_id: str, study: str = "adhoc", *overrides: str) -> dict:
    cfg = build_config(preset="smoke", overrides=[f"study={json.dumps(study)}", *overrides])
    return {"run_id": run_id, "study": study, "status": "finished", "config_json": json.dumps(cfg.to_dict()),
            "config_hash": cfg.config_hash()}


def entry_points() -> set[str]:
    """Every ``python -m analysis.X`` of the source tree (a module with a ``__main__`` guard or a package's __main__.py)."""
    found = set()
    for f in (REPO / "analysis").rglob("*.py"):
        rel = f.relative_to(REPO).with_suffix("")
        if f.name == "__main__.py":
            found.add(".".join(rel.parts[:-1]))
        elif 'if __name__ == "__main__"' in f.read_text():
            found.add(".".join(rel.parts))
    return found


# how each command line takes a results folder
ARGS = {"analysis.confound": lambda folder: [folder], "analysis.device_time": lambda folder: [f"wait_all={folder}"],
        "analysis.learning": lambda folder: [folder], "analysis.readings": lambda folder: [folder],
        "analysis.privacy": lambda folder: [folder],
        "analysis.trackers": lambda folder: [folder, "--study", "s", "--png", "never-written.png"]}


def test_every_analysis_command_line_is_covered():
    assert entry_points() == set(ARGS), "a new analysis command line: add it to ARGS (and to open_or_exit)"


def folders(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """case -> (the folder argument, what the one line must say)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign" / "notes").mkdir(parents=True)
    (tmp_path / "foreign" / "notes" / "a.txt").write_text("not results")
    (tmp_path / "foreign_parquet" / "runs").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1]}), tmp_path / "foreign_parquet" / "runs" / "x.parquet")
    write_runs(tmp_path / "cut_runs", [run_row("a")])
    f = tmp_path / "cut_runs" / "runs" / "a.parquet"
    f.write_bytes(f.read_bytes()[:60])  # truncated
    write_runs(tmp_path / "cut_rounds", [run_row("a")])
    (tmp_path / "cut_rounds" / "rounds").mkdir()
    (tmp_path / "cut_rounds" / "rounds" / "a.parquet").write_bytes(b"PAR1" + b"\0" * 30)
    (tmp_path / "a_file").write_text("x")
    return {"missing": (str(tmp_path / "nope"), "no such folder"), "empty path": ("", "empty path"),
            "empty": (str(tmp_path / "empty"), "the folder is empty"),
            "foreign": (str(tmp_path / "foreign"), "not a results folder"),
            "foreign parquet": (str(tmp_path / "foreign_parquet"), "not a results folder"),
            "truncated runs": (str(tmp_path / "cut_runs"), "cannot be read"),
            "truncated rounds": (str(tmp_path / "cut_rounds"), "cannot be read"),
            "a file": (str(tmp_path / "a_file"), "not a folder"),
            "bad URI": ("nosuchscheme://x/y", "invalid results location")}


CASES = ["missing", "empty path", "empty", "foreign", "foreign parquet", "truncated runs", "truncated rounds", "a file",
         "bad URI"]


@pytest.fixture(scope="module")
def analysis_exits(tmp_path_factory) -> tuple[dict, dict]:
    """Every command line's real ``python -m`` entry (``runpy``, ``__main__``) on every case in turn, in one
    subprocess for all of them (a Python importing pandas and torch costs seconds to start): (case -> (folder,
    what the line must say), module -> case -> [exit code, stderr])."""
    cases = folders(tmp_path_factory.mktemp("edges"))
    code = ("import importlib, runpy, sys, io, contextlib, json\n"
            "out = {}\n"
            "for module, argvs in json.loads(sys.argv[1]).items():\n"
            "    out[module] = {}\n"
            "    for case, folder in argvs.items():\n"
            "        err = io.StringIO()\n"
            "        sys.argv = ['x', *folder]\n"
            "        try:\n"
            "            with contextlib.redirect_stderr(err):\n"
            "                runpy.run_module(module, run_name='__main__')\n"
            "            rc = 0\n"
            "        except SystemExit as e:\n"
            "            rc = e.code\n"
            "        out[module][case] = [rc, err.getvalue()]\n"
            "print(json.dumps(out))\n")
    argv = {module: {case: ARGS[module](folder) for case, (folder, _) in cases.items()} for module in sorted(ARGS)}
    p = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True, cwd=REPO,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return cases, json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", sorted(ARGS))
def test_analysis_command_lines_exit_2_with_one_line(analysis_exits, module):
    """Through the command line's real ``python -m`` entry in a subprocess, every case in turn."""
    cases, ran = analysis_exits
    got = ran[module]
    for case in CASES:
        rc, err = got[case]
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1, (case, err)
        assert cases[case][1] in lines[0] and module in lines[0] and "Traceback" not in err, (case, err)


def test_analysis_command_lines_take_file_uris(tmp_path, capsys):
    from analysis.confound.cli import main as confound

    write_runs(tmp_path / "res", [run_row("a")])
    confound([(tmp_path / "res").as_uri()])  # would exit 2 if the URI were taken as a local path
    assert "# Capacity-confound analysis" in capsys.readouterr().out


def test_device_time_on_runs_that_never_trained_exits_2(tmp_path, capsys):
    from analysis import device_time

    write_runs(tmp_path / "res", [run_row("a")])
    assert device_time.main([f"wait_all={(tmp_path / 'res').as_uri()}"]) == 2
    assert "no rounds rows" in capsys.readouterr().err
