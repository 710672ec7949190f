"""What a strategy class declares, read across its bases: the results columns it writes (every table's schema is
built from them before any run) and the options under which it writes them (what the results reference lists)."""
from __future__ import annotations

from typing import Any

from fedsap_ray.common.columns import Column

# a strategy class (fedsap_ray.algorithms.contract.Strategy or a subclass), typed loosely: the contract imports this
# module for its ``writes`` default, so naming the class here would make an import cycle
StrategyClass = type[Any]


def declared_columns(cls: StrategyClass, table: str) -> list[Column]:
    """The extra ``table`` columns strategy ``cls`` writes: its own ``columns`` and its bases'."""
    out: dict[str, Column] = {}
    for klass in reversed(cls.__mro__):
        for col in vars(klass).get("columns", {}).get(table, ()):
            if col.name in out and out[col.name].type != col.type:
                raise ValueError(f"{cls.__name__}: {table}.{col.name} is declared as {out[col.name].type} by a "
                                 f"base class and as {col.type} by {klass.__name__}")
            out[col.name] = col  # a subclass may re-describe a column it inherits, not retype it
    return list(out.values())


def writes_under(cls: StrategyClass, table: str) -> dict[str, Any] | None:
    """The options under which a run of ``cls`` writes its declared ``table`` columns: ``{}`` (its defaults),
    its ``writes_with`` setting, or None (never: the results reference does not list it there)."""
    if cls.writes(table, cls.Options()):
        return {}
    setting = dict(cls.writes_with.get(table, {}))
    if not setting:
        return None
    try:
        opts = cls.Options(**setting)
    except TypeError:  # its Options lack those fields (a channel-subset method under FedAvg's setting)
        return None
    return setting if cls.writes(table, opts) else None
