"""Every command block of README.md, docs/guides and docs/studies runs in CI, smoke-sized.

A fenced ``bash`` or ``python`` block carries a marker on the line before it (an HTML comment that
GitHub does not render); docs/guides/development.md#documented-commands-run-in-ci describes them:

- ``<!-- ci: run -->``: run it, smoke-sized (``fedsap-ray run`` gets :data:`SMOKE_RUN`, a study
  script gets ``--smoke-test``);
- ``<!-- ci: check -->``: validate without training (``fedsap-ray run`` gets ``--print-config``, a
  study script ``--dry-run``); other commands run as written;
- ``<!-- ci: skip: REASON -->``: not run, for the reason given;
- ``<!-- ci: file NAME -->``: the block's text is written to NAME before the page's commands run.

``PATH=smoke:STUDY`` after run/check copies the folder of ``sweeps/STUDY.py --smoke-test`` (the
session's ``smoke_study`` fixture, shared with the sweep and notebook tests) to PATH first;
``shared-data`` skips the block when ../shared/data is missing. The blocks of one page run in order
in one temporary working directory that links the repository's code folders and sees ../shared.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import SHARED_DATA

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "guides").glob("*.md")),
         *sorted((REPO / "docs" / "studies").glob("*.md"))]
CHECKED_LANGUAGES = {"bash", "sh", "shell", "python"}
# What `run` adds to a `fedsap-ray run` command: one round of a tiny model (a later --set wins).
SMOKE_RUN = ["--set", "training.rounds=1", "--set", "training.local_epochs=1", "--set", "training.max_steps_per_epoch=2",
             "--set", "model.width_mult=0.0625", "--set", "data.max_test_per_domain=40", "--quiet"]
SMOKE_SWEEP = ["--smoke-test", "--workers-per-trial", "0"]
LINKED = ("fedsap_ray", "sweeps", "analysis", "benchmarks", "tests", "pyproject.toml", "ray_cluster.yaml",
          "ray_cluster_local.yaml", ".ci")  # not docs/: a command that writes docs/img/... must not touch the repo
OPERATORS = {"&&", "||", ";", "|"}
MARKER = re.compile(r"^\s*<!--\s*ci:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # the marker's text after "ci:", None without one
    mode: str = ""
    reason: str = ""
    smoke: dict[str, str] = field(default_factory=dict)  # path -> study
    shared_data: bool = False
    filename: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def parse_marker(b: Block) -> None:
    """Fill mode / reason / options from the marker text; raise ValueError for a malformed marker."""
    text = b.marker or ""
    if text.startswith("skip"):
        b.mode, b.reason = "skip", text[len("skip"):].lstrip(":").strip()
        if not b.reason:
            raise ValueError(f"{b.where}: a skip marker needs its reason: <!-- ci: skip: REASON -->")
        return
    words = text.split()
    b.mode = words[0] if words else ""
    if b.mode == "file":
        if len(words) != 2:
            raise ValueError(f"{b.where}: <!-- ci: file NAME --> takes one file name")
        b.filename = words[1]
        return
    if b.mode not in ("run", "check"):
        raise ValueError(f"{b.where}: unknown marker {text!r} (run, check, skip: REASON or file NAME)")
    for w in words[1:]:
        if w == "shared-data":
            b.shared_data = True
        elif re.fullmatch(r"[\w./-]+=smoke:\w+", w):
            path, study = w.split("=smoke:")
            b.smoke[path] = study
        else:
            raise ValueError(f"{b.where}: unknown marker option {w!r} (PATH=smoke:STUDY or shared-data)")


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page with the marker on the line before each (blank lines allowed)."""
    out: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mm = MARKER.match(lines[k]) if k >= 0 else None
        out.append(Block(page, i + 1, lang.lower(), body + "\n", mm.group(1) if mm else None))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def test_every_command_block_is_marked() -> None:
    unmarked, bad = [], []
    for b in all_blocks():
        if b.marker is None:
            if b.lang in CHECKED_LANGUAGES:
                unmarked.append(b.where)
            continue
        try:
            parse_marker(b)
        except ValueError as e:
            bad.append(str(e))
    assert not unmarked, ("command blocks without a CI marker (<!-- ci: run -->, <!-- ci: check -->, "
                          "<!-- ci: skip: REASON -->): " + ", ".join(unmarked))
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- turning a block into a script

def logical_lines(text: str) -> list[tuple[str, str]]:
    """("cmd", one command line with continuations joined) or ("raw", a here-document command, verbatim)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.strip().startswith("#"):
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        heredoc = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if heredoc:
            tag, body = heredoc.group(1), [line]
            while i < len(lines) and lines[i].strip() != tag:
                body.append(lines[i])
                i += 1
            body.append(tag)
            i += 1
            out.append(("raw", "\n".join(body)))
        else:
            out.append(("cmd", line))
    return out


def rewrite(segment: list[str], mode: str, where: str) -> list[str] | None:
    """One simple command, smoke-sized for ``mode``; None drops it (pip installs: the environment is set)."""
    if segment[:1] == ["pip"] or segment[1:3] == ["-m", "pip"]:
        return None
    if segment[:1] == ["fedsap-ray"] or segment[:3] == ["python", "-m", "fedsap_ray"]:
        sub = segment[1] if segment[0] == "fedsap-ray" else segment[3]
        if sub == "run" and "--print-config" not in segment and "--resume" not in segment:
            return segment + (SMOKE_RUN if mode == "run" else ["--print-config"])
        return segment
    if segment[:1] == ["python"] and len(segment) > 1 and segment[1].startswith("sweeps/"):
        if mode == "check":
            return segment if "--dry-run" in segment else segment + ["--dry-run"]
        return segment if "--smoke-test" in segment else segment + SMOKE_SWEEP
    if segment[:1] == ["python"] and len(segment) > 1 and (segment[1] in ("-c", "-m", "-") or segment[1].endswith(".py")):
        return segment
    if segment[:1] in (["optuna"], ["mkdir"], ["ls"], ["cat"]):
        return segment
    raise AssertionError(f"{where}: the test does not know how to run {shlex.join(segment)!r}; "
                         "mark the block <!-- ci: skip: REASON --> if it cannot run in CI")


def commands(b: Block) -> list[str | list[str]]:
    """What CI runs for a bash block, in order: a shell command line (str) or, for a command that only
    validates (``fedsap-ray`` without training, a study script with ``--dry-run``), its argv (list),
    which :func:`run_in_process` calls through the same ``main`` the console script calls."""
    out: list[str | list[str]] = []
    for kind, line in logical_lines(b.text):
        if kind == "raw":
            out.append(line)
            continue
        tokens = shlex.split(line, comments=True)
        parts: list[str] = []
        argvs: list[list[str]] = []
        segment: list[str] = []
        for tok in [*tokens, "&&"]:
            if tok in OPERATORS:
                new = rewrite(segment, b.mode, b.where) if segment else None
                if new is not None:
                    parts += [shlex.join(new), tok]
                    argvs.append(new)
                segment = []
            else:
                segment.append(tok)
        if len(argvs) == 1 and in_process(argvs[0]):
            out.append(argvs[0])
        elif parts:
            out.append(" ".join(parts[:-1]))
    return out


def in_process(argv: list[str]) -> bool:
    """Commands that validate or list without training: cheap to run inside the test process."""
    if argv[:1] == ["fedsap-ray"]:
        return argv[1] != "run" or "--print-config" in argv
    return argv[:1] == ["python"] and argv[1].startswith("sweeps/") and "--dry-run" in argv


def run_in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    """``fedsap_ray.cli.main(argv[1:])`` or the study script's ``main(argv[2:])``, run from ``cwd``."""
    import contextlib
    import importlib.util
    import io

    buf = io.StringIO()
    old = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            if argv[0] == "fedsap-ray":
                from fedsap_ray import cli

                code = cli.main(argv[1:])
            else:
                path = REPO / argv[1]
                spec = importlib.util.spec_from_file_location(f"doc_{path.stem}", path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                code = mod.main(argv[2:])
    except SystemExit as e:  # argparse rejected the command line
        code = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(old)
    return int(code or 0), buf.getvalue()


def script(b: Block) -> str:
    """The whole block as one shell script (what :func:`commands` runs, all in a shell)."""
    lines = [c if isinstance(c, str) else shlex.join(c) for c in commands(b)]
    return "set -euo pipefail\n" + "\n".join(lines) + "\n"


def test_rewrite_smoke_sizes_runs_and_checks_sweeps() -> None:
    b = Block(REPO / "README.md", 1, "bash", "python -m pip install -e . && fedsap-ray run --set a.b=1  # note\n"
              "python sweeps/ablation.py --out runs/x \\\n    --seeds 0 1\n", None, mode="run")
    s = script(b)
    assert "pip install" not in s and "note" not in s
    assert "fedsap-ray run --set a.b=1 " + shlex.join(SMOKE_RUN) in s
    assert "python sweeps/ablation.py --out runs/x --seeds 0 1 --smoke-test --workers-per-trial 0" in s
    b.mode = "check"
    s = script(b)
    assert "fedsap-ray run --set a.b=1 --print-config" in s and "--seeds 0 1 --dry-run" in s
    with pytest.raises(AssertionError, match="does not know"):
        script(Block(REPO / "README.md", 1, "bash", "ray up ray_cluster.yaml\n", None, mode="run"))


# ----------------------------------------------------------------------------- running a page

def workdir(tmp_path: Path) -> Path:
    """``tmp/repo`` with the repository's code folders linked in and ``tmp/shared`` -> the shared folder."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in LINKED:
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    if SHARED_DATA.is_dir():
        (tmp_path / "shared").mkdir()
        (tmp_path / "shared" / "data").symlink_to(SHARED_DATA)
    return root


def page_ids(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", PAGES, ids=page_ids)
def test_documented_commands_run(page: Path, tmp_path: Path, smoke_study) -> None:
    todo = [b for b in blocks(page) if b.marker is not None]
    for b in todo:
        parse_marker(b)
    runnable = [b for b in todo if b.mode in ("run", "check")]
    if not runnable:
        pytest.skip(f"{page_ids(page)} has no runnable command blocks (every one is marked skip, with its reason)")
    cwd = workdir(tmp_path)
    for b in todo:
        if b.mode == "file":
            (cwd / b.filename).write_text(b.text)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    skipped = []
    for n, b in enumerate(runnable):
        if b.shared_data and not SHARED_DATA.is_dir():
            skipped.append(f"{b.where} (needs {SHARED_DATA})")
            continue
        for path, study in b.smoke.items():
            dest = cwd / path
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copytree(smoke_study(study), dest)
        if b.lang == "python":
            f = cwd / f".block{n}.py"
            f.write_text(b.text)
            steps: list[str | list[str]] = [shlex.join([sys.executable, str(f)])]
        else:
            steps = commands(b)
        for step in steps:
            if isinstance(step, list):
                code, output = run_in_process(step, cwd)
                ran, out, err = shlex.join(step) + "   (in-process)", output, ""
            else:
                proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + step], cwd=cwd, env=env,
                                      capture_output=True, text=True, timeout=900)
                code, ran, out, err = proc.returncode, step, proc.stdout, proc.stderr
            assert code == 0, (f"{b.where}: a documented command failed (ci: {b.marker}), exit {code}\n"
                               f"--- ran:\n{ran}\n--- stdout:\n{out[-3000:]}\n--- stderr:\n{err[-5000:]}")
    if skipped:
        pytest.skip("blocks skipped: " + "; ".join(skipped))
