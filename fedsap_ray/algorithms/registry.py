"""Strategy registry: ``@register("name")`` on each strategy class (docs/architecture.md#design-rules).

The table is :data:`fedsap_ray.config.registry.STRATEGIES` (the one generic registry); this module keeps
the names the rest of the code uses. Each strategy declares an ``Options`` frozen dataclass;
``algorithm.options`` (set with ``--set algorithm.<key>=value``) is turned into it once, when the
config is validated (:func:`fedsap_ray.config.schema.parse_options`), and that object is what the
strategy receives (``cfg.algorithm.opts``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.config.registry import STRATEGIES
from fedsap_ray.config.schema import parse_options as _parse_options

_REGISTRY: dict[str, type[Strategy]] = STRATEGIES.entries  # the table itself (tests register and pop)
S = TypeVar("S", bound=type[Strategy])


def register(name: str) -> Callable[[S], S]:
    return STRATEGIES.register(name)


def names() -> list[str]:
    return STRATEGIES.names()


def get(name: str) -> type[Strategy]:
    return STRATEGIES.get(name)


def parse_options(name: str, options: Mapping[str, Any]) -> Any:
    """Build the strategy's Options dataclass, naming any bad key or value."""
    return _parse_options(name, options)


def validate(name: str, options: Mapping[str, Any]) -> None:
    parse_options(name, options)
