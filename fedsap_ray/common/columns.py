"""A results column a strategy declares: name, Arrow type, one-line doc (docs/guides/development.md#adding-a-metric).

Kept in its own dependency-free module so both the strategies (which declare columns) and
:mod:`fedsap_ray.results` (which builds each table's schema from the core columns plus every
registered strategy's declarations) can import it without importing each other.
"""
from __future__ import annotations

from typing import NamedTuple

import pyarrow as pa

RECORDED_TABLES = ("rounds", "clients", "layers", "allocations")  # the per-round tables a strategy can extend


class Column(NamedTuple):
    """One column of a results table; a tuple, so ``for name, type, doc in columns`` reads it."""

    name: str
    type: pa.DataType
    doc: str


__all__ = ["Column", "RECORDED_TABLES"]
