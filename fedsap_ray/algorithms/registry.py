"""Strategy registry: ``@register("name")`` on each strategy class (docs/architecture.md#design-rules).

Each strategy declares an ``Options`` frozen dataclass; ``algorithm.options`` (set with
``--set algorithm.<key>=value``) is validated against it before any work starts.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fedsap_ray.algorithms.base import Strategy
from fedsap_ray.errors import ConfigError
from fedsap_ray.schema import coerce

_REGISTRY: dict[str, type[Strategy]] = {}
S = TypeVar("S", bound=type[Strategy])


def register(name: str) -> Callable[[S], S]:
    def deco(cls: S) -> S:
        if name in _REGISTRY:
            raise ValueError(f"algorithm {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def _ensure_loaded() -> None:
    import fedsap_ray.algorithms  # noqa: F401  (registers every strategy module)


def names() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def get(name: str) -> type[Strategy]:
    _ensure_loaded()
    if name not in _REGISTRY:
        raise ConfigError(f"invalid algorithm.name={name!r}: allowed values are {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def parse_options(name: str, options: Mapping[str, Any]) -> Any:
    """Build the strategy's Options dataclass, naming any bad key or value."""
    cls = get(name)
    opt_cls = cls.Options
    fields = {f.name: f for f in dataclasses.fields(opt_cls)}
    for k in options:
        if k not in fields:
            allowed = ", ".join(fields) or "(none)"
            raise ConfigError(f"invalid algorithm.{k}={options[k]!r}: unknown option for algorithm {name!r}; allowed options are {allowed}")
    hints = typing.get_type_hints(opt_cls)
    kwargs = {k: coerce(hints[k], v, f"algorithm.{k}") for k, v in options.items()}
    return opt_cls(**kwargs)


def validate(name: str, options: Mapping[str, Any]) -> None:
    parse_options(name, options)
