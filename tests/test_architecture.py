"""The package's import graph, read from the source with :mod:`ast` (nothing is imported).

What makes an edge ``a -> b`` (module ``a`` depends on module ``b``):

- every ``import``/``from ... import`` statement in ``a``, at module level *and* inside functions
  and classes. A function-level import is still a dependency, only a deferred one; deferring an
  import is exactly how the cycles this test was written against (config <-> algorithms.registry,
  experiment <-> runtime.ray, models <-> masks) were kept from failing at import time, so a graph
  of module-level imports alone would not have seen any of them. ``if TYPE_CHECKING:`` imports
  count too: a type-only dependency on a higher layer is still one.
- ``from p import n`` points at the module ``p.n`` when ``n`` is a module, else at ``p``.
- Python runs a package's ``__init__`` before any module in it, so an import of ``p.q.r`` also
  points at ``p.q`` (and ``p``), except where ``a`` is itself inside that package (it is then
  already being imported). This is why ``masks -> models.space`` closed a cycle with
  ``models/__init__ -> masks``.

The folder rules: every folder of the package states its one job and the folders it may import in its
``__init__`` docstring (``May import:``; read by ``dev.docgen.folder_rules``, which also draws the layout block
of docs/architecture.md from them), and every edge of the graph above is checked against them.
"""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import INTEGRATION_MODULES, REPO
from fedsap_ray.dev.docgen import folder_rules, may_import_list

PACKAGE = "fedsap_ray"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

Edge = tuple[str, str, int]  # (target module, path of the importing file, line)


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``)."""
    out: dict[str, tuple[Path, bool]] = {}
    for p in sorted(root.rglob("*.py")):
        parts = [package, *p.relative_to(root).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(module: str, is_pkg: bool, tree: ast.AST) -> list[tuple[str, int]]:
    """(imported module or name's module, line) for every import statement anywhere in ``tree``."""
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[:len(here) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
            out.append((base, node.lineno))
    return out


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, Edge]]:
    """Module -> {module it depends on: where} over the package's own modules (see the module docstring)."""
    mods = module_files(root, package)
    graph: dict[str, dict[str, Edge]] = {m: {} for m in mods}
    for mod, (path, is_pkg) in mods.items():
        own = {mod, *_ancestors(mod)}
        for name, line in _imports(mod, is_pkg, ast.parse(path.read_text(encoding="utf-8"))):
            if name not in mods:
                continue  # an external module, or ``from p import n`` with n not a module (``p`` is listed too)
            for target in [name, *_ancestors(name)]:
                if target in mods and target not in own:
                    graph[mod].setdefault(target, (target, path.relative_to(root.parent).as_posix(), line))
    return graph


def find_cycle(graph: dict[str, dict[str, Edge]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    colour: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if colour.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        colour[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = 2
                stack.pop()
            elif colour.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not colour.get(nxt):
                colour[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def describe(graph: dict[str, dict[str, Edge]], cycle: list[str]) -> str:
    return "\n".join(f"  {a} -> {b}  ({graph[a][b][1]}:{graph[a][b][2]})" for a, b in zip(cycle, cycle[1:]))


def test_the_import_graph_has_no_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "fedsap_ray.config" in graph["fedsap_ray.cli"], "the graph reader lost its way"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n" + describe(graph, cycle or [])


def test_algorithm_code_never_reaches_ray() -> None:
    """Strategies run the same on every backend: no module an algorithm depends on (directly or not)
    imports Ray."""
    graph = import_graph()
    mods = module_files()
    seen: set[str] = set()
    todo = [m for m in graph if m == "fedsap_ray.algorithms" or m.startswith("fedsap_ray.algorithms.")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += list(graph[m])
    uses_ray = sorted(m for m in seen for name, _ in _imports(m, mods[m][1], ast.parse(mods[m][0].read_text()))
                      if name == "ray" or name.startswith("ray."))
    assert not uses_ray, f"algorithm code reaches modules that import Ray: {uses_ray}"


def test_the_reader_sees_deferred_imports_and_package_inits(tmp_path: Path) -> None:
    """On a made-up package: a cycle closed by a function-level import through a package ``__init__``."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("def f():\n    from toy.low import g\n")
    (pkg / "sub" / "leaf.py").write_text("from . import sibling\n")
    (pkg / "sub" / "sibling.py").write_text("")
    (pkg / "low.py").write_text("from toy.sub.leaf import x\n")
    graph = import_graph(pkg, "toy")
    assert graph["toy.low"] == {"toy.sub.leaf": ("toy.sub.leaf", "toy/low.py", 1), "toy.sub": ("toy.sub", "toy/low.py", 1)}
    assert set(graph["toy.sub.leaf"]) == {"toy.sub.sibling"}  # its own package is already being imported
    assert find_cycle(graph) == ["toy.low", "toy.sub", "toy.low"]
    (pkg / "sub" / "__init__.py").write_text("")
    assert find_cycle(import_graph(pkg, "toy")) is None


# FedSAP's own vocabulary: its tri-state roles and their masks, its pseudo-groups, its DGA and statistics
FEDSAP_NAMES = {"GLOBAL", "PRIVATE", "DROPPED", "tristate_param_masks", "active_channel_masks", "pseudo_group",
                "FedSAPState", "FedSAPOptions", "ChannelStats", "probe_gradient", "dga_param_names"}
FEDSAP_PACKAGE = f"{PACKAGE}.algorithms.fedsap"


def _fedsap_mentions(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every identifier or string constant of FEDSAP_NAMES in code (docstrings and comments,
    which may cite the paper, are not code)."""
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings else None)
        if name in FEDSAP_NAMES:
            out.append((name, node.lineno))
    return out


def test_fedsap_lives_in_its_own_package() -> None:
    """No module outside algorithms/fedsap/ uses a FedSAP concept or imports from it, except the one
    registration import in algorithms/__init__.py; and the check itself sees the concepts where they are."""
    offenders, seen_inside = [], 0
    for module, (path, is_pkg) in module_files().items():
        tree = ast.parse(path.read_text())
        inside = module == FEDSAP_PACKAGE or module.startswith(FEDSAP_PACKAGE + ".")
        if inside:
            seen_inside += len(_fedsap_mentions(tree))
            continue
        offenders += [f"{path.relative_to(ROOT.parent)}:{line} {name}" for name, line in _fedsap_mentions(tree)]
        for target, line in _imports(module, is_pkg, tree):
            if (target == FEDSAP_PACKAGE or target.startswith(FEDSAP_PACKAGE + ".")) and \
                    module != f"{PACKAGE}.algorithms":
                offenders.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert seen_inside > 20, "the vocabulary no longer matches FedSAP's own code: update FEDSAP_NAMES"
    assert not offenders, "FedSAP concepts outside algorithms/fedsap/:\n" + "\n".join(offenders)


def private_imports(root: Path = ROOT, package: str = PACKAGE) -> list[str]:
    """``file:line: module.name`` of every import of a private name (``_x``, not a dunder) from another
    module of the package: a helper two modules share is public API and belongs in a shared module
    under a public name (issue 43: ``data.digits._check_labels`` was imported by other loaders)."""
    mods = module_files(root, package)
    hits = []
    for mod, (path, _) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package) and node.module != mod:
                hits += [f"{path.relative_to(root.parent).as_posix()}:{node.lineno}: {node.module}.{a.name}"
                         for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return hits


def test_no_module_imports_another_modules_private_helper() -> None:
    hits = private_imports()
    assert not hits, "private names imported across modules (make them public in a shared module):\n" + "\n".join(hits)


def test_the_private_import_check_finds_one(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _helper():\n    pass\n")
    (pkg / "b.py").write_text("from pkg.a import _helper\nfrom pkg.a import __doc__\n")
    assert private_imports(pkg, "pkg") == ["pkg/b.py:1: pkg.a._helper"]


# ----------------------------------------------------------------------------- the folder rules
ROOT_MODULES = ("__init__", "__main__", "cli", "experiment")  # the entry points; everything else is in a folder
RAY_FOLDER, DEV_FOLDER = "runtime", "dev"


def folder_of(module: str, package: str, folders: set[str]) -> str:
    """The folder a module is in, or ``""`` for a module at the package root (and the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in folders else ""


def layout_breaks(root: Path = ROOT, package: str = PACKAGE, root_modules: tuple[str, ...] = ROOT_MODULES) -> list[str]:
    """Every way the package breaks its layout rules (see the module docstring), one line each naming the file and
    line: a folder without its job or ``May import:`` line (or naming a folder that does not exist), an import a
    folder's line does not allow, an import of ``dev/`` from the library or of a root module from a folder but
    ``dev/``, Ray imported outside ``runtime/``, a module at the root that is not an entry point."""
    rules = folder_rules(root)
    folders = set(rules)
    breaks = []
    for name, rule in rules.items():
        if not rule.job or rule.may_import is None:
            breaks.append(f"{package}/{name}/__init__.py: the docstring needs its job (first line) and a 'May import:' line")
        breaks += [f"{package}/{name}/__init__.py: 'May import:' names {d!r}, not a folder of {package}"
                   for d in may_import_list(rule) if d not in folders]
    allowed = {n: folders - {DEV_FOLDER} if r.may_import == "everything" and n != DEV_FOLDER
               else folders if r.may_import == "everything" else set(may_import_list(r)) for n, r in rules.items()}
    mods = module_files(root, package)
    breaks += [f"{path.relative_to(root.parent).as_posix()}: {module} is not an entry point: move it into its folder"
               for module, (path, _) in mods.items()
               if module != package and not folder_of(module, package, folders) and module.split(".")[-1] not in root_modules]
    for module, edges in import_graph(root, package).items():
        here = folder_of(module, package, folders)
        for target, (_, where, line) in edges.items():
            there = folder_of(target, package, folders)
            if target == package or there == here or here == DEV_FOLDER:
                continue
            if there == DEV_FOLDER:
                breaks.append(f"{where}:{line}: {module} imports {target}: nothing in the library imports {DEV_FOLDER}/")
            elif not there:
                breaks.append(f"{where}:{line}: {module} imports the root module {target}: only {DEV_FOLDER}/ may")
            elif here and there not in allowed[here]:
                breaks.append(f"{where}:{line}: {module} imports {target}: {here}/ may import "
                              f"{', '.join(sorted(allowed[here])) or 'nothing'}, not {there}/")
    for module, (path, is_pkg) in mods.items():
        if folder_of(module, package, folders) != RAY_FOLDER:
            breaks += [f"{path.relative_to(root.parent).as_posix()}:{line}: {module} imports {name}: only {RAY_FOLDER}/ "
                       f"imports Ray" for name, line in _imports(module, is_pkg, ast.parse(path.read_text(encoding="utf-8")))
                       if name == "ray" or name.startswith("ray.")]
    return breaks


def test_the_package_keeps_its_layout() -> None:
    """Every folder says its job and what it may import, and every import of the package keeps to it."""
    rules = folder_rules()
    assert {"common", "config", "engine", "run", "runtime", "dev"} <= set(rules), f"the rule reader lost its way: {rules}"
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(ROOT_MODULES)
    breaks = layout_breaks()
    assert not breaks, "the package breaks its layout rules (docs/architecture.md#layout):\n" + "\n".join(breaks)


def _toy(tmp_path: Path) -> Path:
    pkg = tmp_path / "toy"
    for folder, doc in (("low", "The bottom.\n\nMay import: nothing.\n"), ("high", "The top.\n\nMay import: low.\n"),
                        ("dev", "Tools.\n\nMay import: everything.\n")):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text(f'"""{doc}"""\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text("from toy.high import b\n")
    (pkg / "high" / "b.py").write_text("from toy.low import a\n")
    (pkg / "low" / "a.py").write_text("")
    (pkg / "dev" / "t.py").write_text("from toy import main\nfrom toy.high import b\n")
    return pkg


def test_a_planted_upward_import_breaks_the_layout(tmp_path: Path) -> None:
    """On a made-up package that keeps its rules, each kind of break planted in turn is found, and named."""
    pkg = _toy(tmp_path)

    def breaks() -> list[str]:
        return layout_breaks(pkg, "toy", ("__init__", "main"))

    assert breaks() == []
    (pkg / "low" / "a.py").write_text("def f():\n    from toy.high import b\n")  # upward, and deferred
    assert breaks() == [
        "toy/low/a.py:2: toy.low.a imports toy.high.b: low/ may import nothing, not high/",
        "toy/low/a.py:2: toy.low.a imports toy.high: low/ may import nothing, not high/"]
    (pkg / "low" / "a.py").write_text("import ray\nfrom toy.dev import t\nfrom toy import main\n")
    assert breaks() == [
        "toy/low/a.py:2: toy.low.a imports toy.dev.t: nothing in the library imports dev/",
        "toy/low/a.py:2: toy.low.a imports toy.dev: nothing in the library imports dev/",
        "toy/low/a.py:3: toy.low.a imports the root module toy.main: only dev/ may",
        "toy/low/a.py:1: toy.low.a imports ray: only runtime/ imports Ray"]
    (pkg / "low" / "a.py").write_text("")
    (pkg / "stray.py").write_text("")
    (pkg / "high" / "__init__.py").write_text('"""The top, without its rule."""\n')
    assert breaks() == [
        "toy/high/__init__.py: the docstring needs its job (first line) and a 'May import:' line",
        "toy/stray.py: toy.stray is not an entry point: move it into its folder",
        "toy/high/b.py:1: toy.high.b imports toy.low.a: high/ may import nothing, not low/",
        "toy/high/b.py:1: toy.high.b imports toy.low: high/ may import nothing, not low/"]


def test_every_integration_module_exists() -> None:
    """tests/conftest.py names the integration tier's modules by path: a module moved without its entry would
    silently join the fast tier (and its 5-minute budget)."""
    missing = sorted(m for m in INTEGRATION_MODULES if not (REPO / m).is_file())
    assert not missing, f"INTEGRATION_MODULES names files that do not exist (moved?): {missing}"
