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
"""
from __future__ import annotations

import ast
from pathlib import Path

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
