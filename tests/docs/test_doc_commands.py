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

A command that is one call of this project's code (``fedsap-ray ...``, ``python -m MODULE ...``,
``python -c CODE``, ``python FILE.py ...``, a ``python`` block, a study script's ``--dry-run``) runs in
this process through the same ``main`` or ``__main__`` code the interpreter would run
(:func:`run_in_process`: the page's working directory, its argv, captured output, the exit code a
subprocess would give), which saves each command an interpreter and torch start-up (about 4.4 s). Shell
pipelines, redirections, expansions, non-Python tools and anything that would start Ray (a sweep under
Tune, a ``--backend ray`` run) run in ``bash`` as written. The console script itself (``fedsap-ray`` on
PATH, its exit code) is tested as a subprocess in tests/test_cli_subprocess.py.
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
    """What CI runs for a bash block, in order: a shell command line (str) or, for a line that is one
    call of this project's code (:func:`in_process`), its argv (list), which :func:`run_in_process` calls
    through the same ``main`` or ``__main__`` code a subprocess would run."""
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
        if len(argvs) == 1 and in_process(argvs[0]) and not shell_only(line):
            out.append(argvs[0])
        elif parts:
            out.append(" ".join(parts[:-1]))
    return out


# What only a shell does, outside single quotes: redirections, expansions, globs, subshells, background jobs.
SHELL_ONLY = re.compile(r"[<>$`*?~(){}\\[\];|]|(?<!&)&(?!&)")


def shell_only(line: str) -> bool:
    """Whether ``line`` (its comment left out) needs a shell beyond running one command: it then runs in bash."""
    lex = shlex.shlex(line, posix=False)
    lex.whitespace_split, lex.commenters = True, "#"
    return any(SHELL_ONLY.search(re.sub(r"'[^']*'", "", tok)) for tok in lex)


def in_process(argv: list[str]) -> bool:
    """Commands that are one call of this project's code and start no Ray: the console script (but a Ray
    run), ``python -m``/``-c``/a file, a study script only with ``--dry-run`` (a sweep starts Ray under Tune)."""
    if argv[:1] == ["fedsap-ray"]:
        return not (len(argv) > 1 and argv[1] == "run" and "--print-config" not in argv and starts_ray(argv))
    if argv[:1] != ["python"] or len(argv) < 2:
        return False
    if argv[1].startswith("sweeps/"):
        return "--dry-run" in argv
    return (argv[1] in ("-m", "-c") and len(argv) > 2) or argv[1].endswith(".py")


def starts_ray(argv: list[str]) -> bool:
    """A ``fedsap-ray run`` that says on its command line that it runs on Ray (``--backend ray``, ``--address``,
    ``resources.backend``/``resources.address``): it runs as a subprocess, with a Ray of its own. (A run whose
    config file says so would start one here; :func:`run_in_process` shuts it down after.)"""
    text = " ".join(argv)
    return "ray" in argv or "--address" in argv or "resources.backend" in text or "resources.address" in text


def run_in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``argv`` as :func:`in_process` allows, from ``cwd``, with stdout and stderr captured; return the
    exit code a subprocess would give (``SystemExit``'s code, 1 for an uncaught exception, with its
    traceback in the output) and the output.

    ``fedsap-ray ARGS`` is ``fedsap_ray.cli.main(ARGS)``; a study script's ``--dry-run`` its ``main``;
    ``python -m MODULE ARGS`` is ``runpy.run_module(MODULE, run_name="__main__")`` and ``python FILE ARGS``
    ``runpy.run_path(FILE, run_name="__main__")``, with ``sys.argv`` as the interpreter sets it;
    ``python -c CODE`` executes CODE as ``__main__``. What such a call may change in this process is put
    back afterwards: the working directory, ``sys.argv``, torch's thread count (a run sets it), matplotlib's
    open figures (drawn with the Agg backend, as ``MPLBACKEND=Agg`` gives the shell commands), and a Ray the
    call started."""
    import contextlib
    import importlib.util
    import io
    import runpy
    import traceback
    import warnings

    import torch

    import analysis  # noqa: F401  (imported from the repository before the working directory changes)
    import sweeps  # noqa: F401

    buf = io.StringIO()
    old_cwd, old_argv, threads = Path.cwd(), sys.argv[:], torch.get_num_threads()
    ray_before = _ray_running()
    os.environ["MPLBACKEND"] = "Agg"
    if "matplotlib" in sys.modules:
        sys.modules["matplotlib"].use("Agg")
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                if argv[0] == "fedsap-ray":
                    from fedsap_ray import cli

                    code = cli.main(argv[1:])
                elif argv[1].startswith("sweeps/"):
                    path = REPO / argv[1]
                    spec = importlib.util.spec_from_file_location(f"doc_{path.stem}", path)
                    mod = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(mod)
                    code = mod.main(argv[2:])
                elif argv[1] == "-m":
                    sys.argv = [argv[2], *argv[3:]]  # runpy puts the module's file in argv[0]
                    with warnings.catch_warnings():  # a fresh __main__ copy of a module imported here already
                        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
                        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
                    code = 0
                elif argv[1] == "-c":
                    sys.argv = ["-c", *argv[3:]]
                    exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
                    code = 0
                else:
                    sys.argv = argv[1:]
                    runpy.run_path(str(cwd / argv[1]), run_name="__main__")
                    code = 0
            except SystemExit as e:  # argparse, or the module's own `raise SystemExit(main())`
                code = e.code if isinstance(e.code, int) or e.code is None else 1
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except Exception:  # what the interpreter would print before exiting 1
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(old_cwd)
        sys.argv = old_argv
        torch.set_num_threads(threads)
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
        if _ray_running() and not ray_before:
            sys.modules["ray"].shutdown()
    return int(code or 0), buf.getvalue()


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


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


def test_one_call_of_the_project_runs_in_process_and_the_rest_in_bash(tmp_path) -> None:
    text = ("fedsap-ray run --out runs/a   # a run (x) in ~/runs\n"
            "python -m analysis.confound runs/c --png 'runs/c/f.png'\n"
            "python -c 'import sys; print(sys.argv[1:] == [], \"$HOME\")'\n"
            "python sweeps/ablation.py --out runs/x\n"
            "fedsap-ray run --backend ray --out runs/r\n"
            "python -c 'print(1)' > out.txt\n"
            "fedsap-ray algorithms | cat\n"
            "python -m analysis.confound \"$OUT\"\n"
            "ls runs/*\n")
    got = commands(Block(REPO / "README.md", 1, "bash", text, None, mode="run"))
    assert [isinstance(c, list) for c in got] == [True, True, True, False, False, False, False, False, False]
    assert got[0] == ["fedsap-ray", "run", "--out", "runs/a", *SMOKE_RUN]
    assert got[1] == ["python", "-m", "analysis.confound", "runs/c", "--png", "runs/c/f.png"]
    # in-process as a subprocess would be: argv, exit codes, output, the working directory
    assert run_in_process(["python", "-c", "import sys, os; print(sys.argv, os.getcwd())"], tmp_path) == \
        (0, f"['-c'] {tmp_path}\n")
    code, out = run_in_process(["python", "-c", "raise ValueError('no')"], tmp_path)
    assert code == 1 and out.rstrip().endswith("ValueError: no")
    assert run_in_process(["python", "-c", "raise SystemExit(3)"], tmp_path) == (3, "")
    code, out = run_in_process(["python", "-m", "fedsap_ray.dev.docgen", "--no-such-flag"], tmp_path)
    assert code == 2 and "--no-such-flag" in out
    assert run_in_process(["fedsap-ray", "run", "--set", "training.rounds=-1"], tmp_path)[0] == 2
    (tmp_path / "b.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    assert run_in_process(["python", "b.py", "x"], tmp_path) == (0, "__main__ ['x']\n")
    assert Path.cwd() != tmp_path


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
            steps: list[str | list[str]] = [["python", f.name]]  # in-process, as `python .blockN.py`
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
