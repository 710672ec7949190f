"""The strategy contract (fedsap_ray/algorithms/contract.py): every registered strategy implements it, declares
what it declares with the declared types, and the engine asks a strategy for nothing else; the contract itself
stays one screen, its helpers in their own named modules."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Mapping
from types import ModuleType

import pytest

from conftest import federation_fixture, make_strategy, tiny_overrides
from fedsap_ray import algorithms
from fedsap_ray.engine import asyncmode, server
from fedsap_ray.run import session
from fedsap_ray.algorithms import contract
from fedsap_ray.algorithms.compute import Compute
from fedsap_ray.algorithms.memo import Memo
from fedsap_ray.algorithms.sampling import Sampler
from fedsap_ray.common.columns import Column
from fedsap_ray.config import build_config
from fedsap_ray.results import CORE_TABLES
from fedsap_ray.results import kept

Strategy = contract.Strategy
NAMES = algorithms.names()
MUST = ("configure_round", "aggregate")
HELD = {"memo": Memo, "compute": Compute, "sampler": Sampler}  # the helpers every strategy holds (Strategy.__init__)
# what Strategy.__init__ keeps besides its helpers: the run as a strategy sees it, the config, the options
KEPT = ("ctx", "cfg", "opts")
# the names that left the contract for a helper (issue 54): a class that still defines one is dead code
LEFT = ("spent", "client_records", "output", "state_tree", "state_from_tree", "mask_macs", "encoder_macs",
        "sample_clients", "devices", "lr_at", "plan_kwargs", "declared_columns", "writes_under")
ENGINE: tuple[ModuleType, ...] = (server, asyncmode, session, kept)  # what drives a strategy through a run
SCREEN = 120  # lines: the contract class, its docstrings and comments included


def contract_names() -> set[str]:
    """Everything the contract declares or defines: class attributes, methods, and what ``__init__`` keeps."""
    own = {n for n in vars(Strategy) if not n.startswith("_")} | set(Strategy.__annotations__)
    return own | set(KEPT) | set(HELD)


def public_methods(cls: type) -> set[str]:
    """The public methods ``cls`` defines itself (class methods included; a nested class is not a method)."""
    return {n for n, v in vars(cls).items() if not n.startswith("_")
            and (inspect.isfunction(v) or isinstance(v, (classmethod, staticmethod)))}


# ----------------------------------------------------------------------------- the contract itself

def test_the_contract_reads_in_one_screen_and_names_only_the_two_methods_a_method_must_write():
    lines = inspect.getsource(Strategy).splitlines()
    assert len(lines) <= SCREEN, f"Strategy is {len(lines)} lines; the contract must read in one screen ({SCREEN})"
    assert Strategy.__abstractmethods__ == frozenset(MUST)
    for name in public_methods(Strategy):
        doc = inspect.getdoc(getattr(Strategy, name))
        assert doc and len(doc.splitlines()) <= 2, f"Strategy.{name}: a one-line docstring (two at most)"


def test_no_strategy_defines_a_name_that_left_the_contract():
    """A method the engine or records no longer call (``spent``, ``mask_macs``, ...) would be dead code in a
    strategy that still overrides it; so would a helper's name reused for something else."""
    for name in NAMES:
        for klass in algorithms.get(name).__mro__:
            clash = sorted(set(vars(klass)) & {*LEFT, *HELD})
            assert not clash, f"{klass.__qualname__} ({name}) defines {clash}, which are no longer the contract's"


# ----------------------------------------------------------------------------- every registered strategy

@pytest.mark.parametrize("name", NAMES)
def test_every_registered_strategy_implements_the_contract(name):
    cls = algorithms.get(name)
    assert issubclass(cls, Strategy) and not inspect.isabstract(cls), f"{name}: abstract {cls.__abstractmethods__}"
    for must in MUST:
        assert getattr(cls, must) is not getattr(Strategy, must), f"{name}: {must} is not implemented"


@pytest.mark.parametrize("name", NAMES)
def test_every_declaration_has_its_declared_type(name):
    cls = algorithms.get(name)
    assert cls.name == name and isinstance(cls.summary, str) and cls.summary.strip()
    assert dataclasses.is_dataclass(cls.Options) and cls.Options.__dataclass_params__.frozen  # type: ignore[attr-defined]
    cls.Options()  # its defaults are a valid setting
    assert isinstance(cls.columns, Mapping) and set(cls.columns) <= set(CORE_TABLES)
    for table, cols in cls.columns.items():
        assert isinstance(cols, tuple) and all(isinstance(c, Column) for c in cols), f"{name}.columns[{table!r}]"
    assert isinstance(cls.writes_with, Mapping) and set(cls.writes_with) <= set(CORE_TABLES)
    assert all(isinstance(v, Mapping) for v in cls.writes_with.values())
    assert cls.State is None or dataclasses.is_dataclass(cls.State)
    for field in ("state_keys", "state_vectors"):
        value = getattr(cls, field)
        assert isinstance(value, tuple) and all(isinstance(v, str) for v in value), f"{name}.{field}"
    assert isinstance(cls.preset_options, Mapping) and all(isinstance(v, Mapping) for v in cls.preset_options.values())
    assert isinstance(cls.supports_async, bool)
    assert all(isinstance(v, tuple) and all(isinstance(o, str) for o in v) for v in cls.confound_variants.values())


fed = federation_fixture(tiny_overrides("fedavg"))


@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_holds_the_helpers_the_contract_names(fed, name):
    """Built, each strategy holds its own helpers, sharing one memo (so a value is computed once per run)."""
    _, strat = make_strategy(build_config(preset="smoke", overrides=tiny_overrides(name)), fed)
    for attr, kind in HELD.items():
        assert isinstance(getattr(strat, attr), kind), f"{name}.{attr}"
    assert strat.compute.memo is strat.memo and strat.sampler.memo is strat.memo
    assert strat.train_macs.__self__ is strat and all(hasattr(strat, k) for k in KEPT)


# ----------------------------------------------------------------------------- what the engine asks

def strategy_uses(source: str) -> set[str]:
    """Every ``name`` the code reads on a strategy (``strategy.name``, ``self.strategy.name``, ``self.astrategy.name``,
    or a local alias of one), and ``helper.method`` where it reads through a held helper
    (``strategy.sampler.devices``)."""
    tree = ast.parse(textwrap.dedent(source))
    aliases = {"strategy", "astrategy"}
    for node in ast.walk(tree):  # s = self.astrategy
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and is_strategy(node.value, aliases):
            aliases.add(node.targets[0].id)
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_strategy(node.value, aliases):
            used.add(node.attr)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr in HELD \
                and is_strategy(node.value.value, aliases):
            used.add(f"{node.value.attr}.{node.attr}")
    return used


def is_strategy(node: ast.AST, aliases: set[str]) -> bool:
    """``strategy``, an alias, or ``self.strategy`` / ``self.astrategy``."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr in ("strategy", "astrategy") and isinstance(node.value, ast.Name)


def test_the_engine_asks_a_strategy_only_for_the_contract():
    """The round engine, the asynchronous engine, the session and the kept models read on a strategy only what the
    contract declares (or, asynchronously, FedAvg's extension points: ``asyncmode.AsyncStrategy``), and call its
    helpers' public methods; records and checkpoints go through ``records.py`` and ``statetree.py``, which take the
    strategy as an argument."""
    allowed = contract_names() | public_methods(asyncmode.AsyncStrategy)
    allowed |= {f"{h}.{m}" for h, kind in HELD.items() for m in public_methods(kind)}
    for module in ENGINE:
        used = strategy_uses(inspect.getsource(module))
        assert used, f"the reader found no strategy use in {module.__name__}: it lost its way"
        assert used <= allowed, f"{module.__name__} asks a strategy for {sorted(used - allowed)}, outside the contract"


def test_the_check_sees_a_call_outside_the_contract():
    planted = """
        def round(self, plans, results):
            s = self.astrategy
            rows = {r.client_id: self.strategy.spent(plans[r.client_id], r) for r in results}
            return s.lr_at(1), strategy.sampler.devices(), strategy.memo._tables
    """
    assert strategy_uses(planted) >= {"spent", "lr_at", "sampler", "sampler.devices", "memo"}
    assert "memo._tables" in strategy_uses(planted)
