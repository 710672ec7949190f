"""The documentation: generated reference pages are fresh, links and anchors resolve, nothing cites
a document outside the repository, and the README stays a short entry point."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fedsap_ray.dev import docgen

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MARKDOWN = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
SOURCE_DIRS = ("fedsap_ray", "analysis", "sweeps", "benchmarks", "tests", "docs", ".ci")
SOURCE_SUFFIXES = {".py", ".md", ".ipynb", ".yaml", ".yml", ".toml", ".txt", ""}


def rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def source_files() -> list[Path]:
    """The repository's own text files (code, docs, notebooks, configs), without build output or caches."""
    files = [p for p in REPO.iterdir() if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    for d in SOURCE_DIRS:
        files += [p for p in (REPO / d).rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES
                  and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts]
    return sorted(files)


# ----------------------------------------------------------------------------- generated pages

def test_reference_pages_match_the_code() -> None:
    pages = docgen.render_all()
    assert set(pages) == {p.name for p in (DOCS / "reference").glob("*.md")}, "docs/reference holds other pages"
    stale = [name for name, text in pages.items() if (DOCS / "reference" / name).read_text(encoding="utf-8") != text]
    assert not stale, (f"stale reference pages {stale}: the code changed; regenerate them with "
                       f"`{docgen.COMMAND}` and commit the result")


def test_reference_pages_say_what_the_code_says() -> None:
    """Spot checks against the code the pages come from (the default algorithm the old README got wrong,
    every registered algorithm and option, every results column, validator messages)."""
    from fedsap_ray import algorithms, results
    from fedsap_ray.config import AlgorithmConfig

    pages = docgen.render_all()
    assert f"| `algorithm.name` | str | `{AlgorithmConfig.name}` |" in pages["config.md"]
    assert "| `training.rounds` | int | `100` | must be an integer >= 1 |" in pages["config.md"]
    for name in algorithms.names():
        assert f"\n## {name}\n" in pages["algorithms.md"]
    for table, cols in results.TABLES.items():
        assert f"\n## {table}\n" in pages["results.md"]
        for col, _, _ in cols:
            assert f"| `{col}` |" in pages["results.md"], (table, col)
    assert "`--dry-run`" in pages["cli.md"] and "### sweeps/tune.py" in pages["cli.md"]


def test_docgen_check_names_a_stale_page(tmp_path, capsys) -> None:
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    assert docgen.main(["--root", str(tmp_path)]) == 0
    assert docgen.main(["--root", str(tmp_path), "--check"]) == 0
    page = tmp_path / "docs" / "reference" / "config.md"
    page.write_text(page.read_text().replace("fedsap", "fedavg"))
    assert docgen.main(["--root", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "config.md" in err and docgen.COMMAND in err and "algorithms.md" not in err


def test_allowed_values_are_the_validators_answers() -> None:
    """The probe quotes a validator's one-line error; a field without a constraint gets nothing."""
    from fedsap_ray.config import CapacityConfig
    from fedsap_ray.config.build import _construct

    msgs = docgen.probe_messages("capacity.scheme", str, lambda v: _construct(CapacityConfig, {"scheme": v}, "capacity."))
    assert msgs == ["allowed values are cyclic, tiers, full, explicit"]
    assert docgen.probe_messages("x", bool, lambda v: None) == []


def test_field_comments_read_the_line_and_the_lines_above() -> None:
    from fedsap_ray.config import ResourcesConfig, TrainingConfig

    assert docgen.field_comments(TrainingConfig)["lr_decay"].startswith("multiplicative per round")
    assert docgen.field_comments(ResourcesConfig)["torch_threads"].startswith("Intra-op threads")


# ----------------------------------------------------------------------------- links and anchors

def strip_code(text: str) -> str:
    """Markdown without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^\s*(```|~~~).*?^\s*\1[ \t]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            in_fence = not in_fence
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m and not in_fence:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def check_target(source: Path, target: str) -> str | None:
    """None when ``target`` (a relative link from ``source``) exists, with its anchor; else the problem."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    dest = (source.parent / path_part).resolve() if path_part else source
    if not dest.exists():
        return f"{target}: no such file"
    if not str(dest).startswith(str(REPO)):
        return f"{target}: outside the repository"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target}: no heading with anchor #{anchor} in {rel(dest)}"
    return None


@pytest.mark.parametrize("page", MARKDOWN, ids=rel)
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    problems = [p for t in LINK.findall(strip_code(page.read_text(encoding="utf-8")))
                if (p := check_target(page, t)) is not None]
    assert not problems, f"{rel(page)}: broken links:\n" + "\n".join(problems)


def test_docs_cited_in_the_code_exist() -> None:
    """Every ``docs/...md#anchor`` named in a docstring, comment or page resolves."""
    cite = re.compile(r"\bdocs/\w[\w./-]*?\.md(?:#[\w-]+)?")
    problems = []
    for f in source_files():
        for target in cite.findall(f.read_text(encoding="utf-8", errors="replace")):
            problem = check_target(REPO / "README.md", target)
            if problem:
                problems.append(f"{rel(f)}: {problem}")
    assert not problems, "\n".join(problems)


def test_nothing_cites_documents_outside_the_repository() -> None:
    """The old design notes and the paper files live outside the repository: the code and docs cite
    docs/ pages and papers/000 / papers/003 (explained in docs/index.md) instead."""
    design, papers = "DESIGN", "papers"  # spelled apart so that this test does not find itself
    patterns = [re.compile(p) for p in (rf"{design} section", rf"{design} §", rf"{design}\.md", rf"shared/{design}",
                                        rf"shared/{papers}", r"\b00[0-3]_[0-9a-f]{16}\b", rf"{papers}/README")]
    hits = []
    for f in source_files():
        for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(p.search(line) for p in patterns):
                hits.append(f"{rel(f)}:{i}: {line.strip()[:120]}")
    assert not hits, "cites a document outside the repository:\n" + "\n".join(hits)


def test_docs_explain_the_paper_citations() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for short, arxiv in (("papers/000", "2610.01638"), ("papers/003", "2608.07157")):
        assert short in index and arxiv in index


# ----------------------------------------------------------------------------- the README

def test_readme_is_short_and_keeps_the_ci_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250  # short: the results sections point to the study pages for detail
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")][-2:]
    assert ci == ['python -m pip install -e ".[test]" && python -m pytest -q',
                  "python -m pytest -q -m integration -n 0 --durations=25"]
    for line in ci:
        assert f"\n{line}\n" in readme, "the README must show the test commands .ci/run runs, verbatim"
    image = re.search(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme)
    assert image and (REPO / image.group(1)).is_file()


def test_the_link_check_catches_a_missing_file_or_anchor() -> None:
    page = DOCS / "index.md"
    assert check_target(page, "architecture.md#layout") is None
    assert "no heading" in check_target(page, "architecture.md#no-such-heading")
    assert "no such file" in check_target(page, "guides/no-such-page.md")
    assert slug("Sensitivity: `sweeps/sensitivity.py` (papers/000 Table 7)") == \
        "sensitivity-sweepssensitivitypy-papers000-table-7"


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a checkout")
def test_what_the_docs_keep_is_not_ignored_by_git():
    """Recorded study runs, figures and pages under docs/ must be committable. A ``runs/`` pattern in
    .gitignore once matched docs/studies/runs/ as well, so seven finished study runs were never committed
    and were lost with the machine they ran on."""
    probes = ["docs/studies/runs/device-time/dt_deadline/runs/fedavg-s0.parquet",
              "docs/studies/runs/device-time/dt_deadline/rounds/fedavg-s0.parquet", "docs/img/curves.png",
              "docs/studies/runs/device-time/dt_wait/clients/dapperfl-s2.parquet", "docs/studies/device-time.md"]
    r = subprocess.run(["git", "check-ignore", "--no-index", "-v", *probes], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 1 and not r.stdout, f"ignored by git:\n{r.stdout}"  # 1: none of them is ignored
