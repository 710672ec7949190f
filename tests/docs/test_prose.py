"""Prose that restates the code cannot drift (issue 43): the generated regions of hand-written pages are
fresh, the round the architecture page shows is the round ``Server.round`` runs, and every dotted code
name the docs put in backticks (``ClientPlan.extra``, ``golden.DROP``, ``training.rounds``) still exists."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import re
import shutil
import typing
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import fedsap_ray
from fedsap_ray.engine import server
from fedsap_ray.dev import docgen

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


# ----------------------------------------------------------------------------- generated regions

def test_generated_regions_match_the_code() -> None:
    stale = docgen.stale_regions()
    assert not stale, f"stale generated regions in {stale}: regenerate with `{docgen.COMMAND}` and commit"


def _copy_pages(root: Path) -> None:
    for page in {pg for pg, _ in docgen.REGIONS.values()}:
        (root / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, root / page)


def test_docgen_check_names_a_page_whose_region_is_stale(tmp_path, capsys) -> None:
    _copy_pages(tmp_path)
    page = tmp_path / "docs" / "guides" / "development.md"
    page.write_text(page.read_text().replace("| all |  | ", "| all |  | 1"))  # a hand-edited count
    assert docgen.main(["--root", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "development.md" in err and "architecture.md" not in err and docgen.COMMAND in err
    assert docgen.main(["--root", str(tmp_path)]) == 0  # rewrites the region ...
    assert page.read_text() == (REPO / "docs" / "guides" / "development.md").read_text()  # ... as it was


def test_a_lost_or_unknown_region_marker_is_an_error(tmp_path) -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    start, end = "<!-- generated: server-round", "<!-- end generated: server-round -->"
    without = text[:text.index(start)] + text[text.index(end) + len(end):]
    with pytest.raises(ValueError, match="lost its generated regions"):
        docgen.fill_regions(without, "docs/architecture.md")
    with pytest.raises(ValueError, match="without their end marker"):
        docgen.fill_regions(text.replace("<!-- end generated: server-round -->", ""), "docs/architecture.md")
    with pytest.raises(ValueError, match="'golden-cases' is not one of"):
        docgen.fill_regions(text + "\n<!-- generated: golden-cases x -->\n<!-- end generated: golden-cases -->\n",
                            "docs/architecture.md")


# ----------------------------------------------------------------------------- the round

OWNERS = ("strategy", "backend", "clock", "recorder")  # what Server.round calls methods of (self.<owner>.<method>)


def round_calls_in_code() -> list[str]:
    """The calls ``Server.round`` makes, in source order: ``owner.method`` for the strategy, backend, device
    clock and recorder, the package's functions it calls by name, and its own helpers (``self._x``, as ``x``)."""
    tree = ast.parse(inspect.getsource(server.Server.round).lstrip())
    ours = {name for name, v in vars(server).items() if inspect.isfunction(v) and v.__module__.startswith("fedsap_ray")
            and not name.startswith("_")}
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr in OWNERS \
                and isinstance(f.value.value, ast.Name) and f.value.value.id == "self":
            calls.append((node.lineno, node.col_offset, f"{f.value.attr}.{f.attr}"))
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            calls.append((node.lineno, node.col_offset, f.attr.lstrip("_")))
        elif isinstance(f, ast.Name) and f.id in ours:
            calls.append((node.lineno, node.col_offset, f.id))
    names: list[str] = []
    for *_, name in sorted(calls):
        if name not in names:
            names.append(name)
    return names


def round_calls_in_docstring(block: str, names: typing.Iterable[str]) -> list[str]:
    """The ``owner.method`` calls the pseudo-code names, and which of ``names`` it names, in order of first mention."""
    found = [(m.start(), m.group(0)) for m in re.finditer(rf"\b(?:{'|'.join(OWNERS)})\.\w+", block)]
    found += [(m.start(), n) for n in names if "." not in n for m in [re.search(rf"\b{n}\b", block)] if m]
    out: list[str] = []
    for _, name in sorted(found):
        if name not in out:
            out.append(name)
    return out


def test_the_documented_round_makes_the_calls_server_round_makes_in_order() -> None:
    """The pseudo-code in fedsap_ray/engine/server.py's docstring (which docgen puts on the architecture page) names
    every call of ``Server.round`` in the order the code makes them, and no call the code does not make:
    the page once left out the device clock and the straggler branch."""
    code = round_calls_in_code()
    assert {"strategy.configure_round", "backend.train", "clock.round", "strategy.aggregate", "client_cost",
            "recorder.record"} <= set(code), f"the reader of Server.round lost its way: {code}"
    block = docgen.round_pseudocode(inspect.getdoc(server) or "")
    assert round_calls_in_docstring(block, code) == code, (
        f"fedsap_ray/engine/server.py's docstring round names {round_calls_in_docstring(block, code)}; Server.round makes "
        f"{code}: update the docstring, then run `{docgen.COMMAND}`")
    assert "if sim.stragglers:" in block, "the docstring round must show the straggler branch Server.round takes"


def test_the_round_check_sees_a_missing_step() -> None:
    block = docgen.round_pseudocode(inspect.getdoc(server) or "")
    code = round_calls_in_code()
    without_clock = "\n".join(line for line in block.splitlines() if "clock.round" not in line)
    assert round_calls_in_docstring(without_clock, code) != code


# ----------------------------------------------------------------------------- dotted names in backticks

FILE_SUFFIXES = {"py", "md", "txt", "csv", "parquet", "json", "yaml", "yml", "toml", "png", "npz", "h5", "mat", "gz",
                 "tar", "ipynb", "sh", "cfg", "jpg", "zip", "bz2", "log", "html", "pkl", "pt", "so", "whl", "ini"}
NOT_CODE = {"fedsap_ray.upto_round": "the Parquet schema metadata key of a merged run file",
            "fedsap_ray.datasets": "the entry point group of dataset plugins (fedsap_ray.data.own.GROUP)"}
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


@cache
def package_modules() -> dict[str, ModuleType]:
    """Every module of the package (the registries loaded), by full name."""
    out: dict[str, ModuleType] = {"fedsap_ray": fedsap_ray}
    for m in pkgutil.walk_packages(fedsap_ray.__path__, "fedsap_ray."):
        if not m.name.endswith("__main__"):
            out[m.name] = importlib.import_module(m.name)
    from fedsap_ray import algorithms
    from fedsap_ray.data.registry import dataset_names

    algorithms.names(), dataset_names()
    return out


@cache
def package_classes() -> dict[str, list[type]]:
    """Every class defined in the package, by name (two modules may define one name)."""
    out: dict[str, list[type]] = {}
    for m in package_modules().values():
        for name, v in vars(m).items():
            if inspect.isclass(v) and v.__module__.startswith("fedsap_ray") and v not in out.get(name, []):
                out.setdefault(name, []).append(v)
    return out


def has_attr(obj: Any, name: str) -> bool:
    """``obj.name`` exists: an attribute, a dataclass field, or an annotation of a class or its bases."""
    if hasattr(obj, name):
        return True
    if inspect.isclass(obj):
        return any(name in getattr(k, "__annotations__", {}) for k in obj.__mro__)
    return False


def resolve(obj: Any, path: list[str]) -> bool:
    for part in path:
        if not has_attr(obj, part):
            return False
        obj = getattr(obj, part, None)
        if obj is None:  # an annotation without a value: nothing below it to check
            return True
    return True


def config_sections() -> dict[str, set[str]]:
    """Config section -> its fields (``algorithm`` also takes every registered strategy's options)."""
    from fedsap_ray import algorithms
    from fedsap_ray.config.schema import ExperimentConfig

    hints = typing.get_type_hints(ExperimentConfig)
    out = {f.name: {g.name for g in dataclasses.fields(hints[f.name])} for f in dataclasses.fields(ExperimentConfig)
           if dataclasses.is_dataclass(hints[f.name])}
    out["algorithm"] |= {f.name for n in algorithms.names() for f in dataclasses.fields(algorithms.get(n).Options)}
    return out


def name_problem(dotted: str) -> str | None:
    """None when ``dotted`` names something that exists (a module attribute, a class attribute, a config field),
    or is not a code name this check knows (a file, another package); else what is missing."""
    parts = dotted.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None
    mods = package_modules()
    if parts[0] == "fedsap_ray":
        for i in range(len(parts), 1, -1):
            if ".".join(parts[:i]) in mods:
                return None if resolve(mods[".".join(parts[:i])], parts[i:]) else f"no {dotted}"
        return None if dotted in NOT_CODE else f"no {dotted}"
    if importlib.util.find_spec(parts[0]) is not None:
        return None  # another package (ray.init, torch.nn) or a top-level folder (sweeps.study)
    sections = config_sections()
    classes = package_classes().get(parts[0], [])
    owners = [m for name, m in mods.items() if name.endswith("." + parts[0])]
    if parts[0] not in sections and not classes and not owners:
        return None  # not the package's name (OUT.rounds, self.payload, ...)
    found = ((parts[0] in sections and len(parts) == 2 and parts[1] in sections[parts[0]])
             or any(resolve(c, parts[1:]) for c in classes) or any(resolve(m, parts[1:]) for m in owners))
    kinds = [k for k, there in (("config section", parts[0] in sections), ("class", classes), ("module", owners)) if there]
    return None if found else f"no {dotted} (no such name in the {' or '.join(kinds)} {parts[0]})"


def dotted_names(text: str) -> list[tuple[int, str]]:
    """(line, name) of every backticked dotted name in Markdown ``text``, fenced code blocks left out."""
    out, fence = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            fence = not fence
        elif not fence:
            out += [(i, m.group(1)) for m in DOTTED.finditer(line)]
    return out


def test_every_dotted_code_name_in_the_docs_exists() -> None:
    """``ClientPlan.extra`` stayed on the architecture page after the field was gone; a name the docs give a
    reader to look up must be there."""
    problems = [f"{p.relative_to(REPO)}:{line}: `{name}`: {problem}" for p in PAGES
                for line, name in dotted_names(p.read_text(encoding="utf-8"))
                if (problem := name_problem(name)) is not None]
    assert not problems, "names in the docs that the code no longer has:\n" + "\n".join(problems)


def test_the_name_check_finds_a_gone_name() -> None:
    assert name_problem("ClientPlan.extra") is not None
    assert name_problem("ClientPlan.hooks") is None
    assert name_problem("golden.DROP") is None and name_problem("golden.NOT_THERE") is not None
    assert name_problem("training.rounds") is None and name_problem("training.no_such_field") is not None
    assert name_problem("algorithm.mu") is None
    assert name_problem("fedsap_ray.data.status.default_root") is None
    assert name_problem("fedsap_ray.data.status.gone") is not None
    assert name_problem("torch.nn") is None and name_problem("server.py") is None and name_problem("ray.init") is None
    assert name_problem("devices.DeviceClock") is None and name_problem("devices.policy") is None  # module, section
    assert name_problem("sliced.gather") is not None
