"""The one cache a strategy keeps (:class:`Memo`): values that are pure functions of the run's fixed model and
federation, so caching them can never change a number."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class Memo:
    """Per-strategy tables of computed values (MAC counts, sub-model masks and geometry, the run's devices), each
    looked up by a key; called as ``self.memo(table, key, compute)``, it reads as "memoise"."""

    def __init__(self) -> None:
        self._tables: dict[str, OrderedDict[Hashable, Any]] = {}

    def __call__(self, table: str, key: Hashable, compute: Callable[[], T], *, maxsize: int | None = None) -> T:
        """``compute()``, computed once per ``(table, key)`` and kept. ``maxsize``: keep at most that many entries
        of ``table`` (large values such as parameter masks), least recently used dropped first."""
        entries = self._tables.setdefault(table, OrderedDict())
        if key in entries:
            entries.move_to_end(key)
            return entries[key]
        value = entries[key] = compute()
        if maxsize is not None and len(entries) > maxsize:
            entries.popitem(last=False)
        return value
