"""The one registry: a name -> object table filled by a ``@register(name)`` decorator where each thing is defined.

Four registries serve the package, all defined here (docs/architecture.md#registries):

================  =========================  ===============================================  =======================
registry          what it holds              registered with                                  filled by importing
================  =========================  ===============================================  =======================
``STRATEGIES``    strategy classes           ``@register("name")`` (algorithms.registry)      ``fedsap_ray.algorithms``
``HOOKS``         client hook classes        ``@register_hook("name")`` (algorithms.hooks)    ``fedsap_ray.algorithms``
``DATASETS``      dataset source classes     ``@register_dataset("name")`` (data.registry)    ``fedsap_ray.data``
``MODELS``        model factories            ``@register_model("name")`` (this module)        ``fedsap_ray.models``
================  =========================  ===============================================  =======================

A registry loads the package that fills it the first time it is asked for a name (by module name,
through :mod:`importlib`), so this module imports nothing of the package and anything can ask it,
the config schema included (``data.name``, ``model.name`` and ``algorithm.name`` are checked
against these tables). ``get`` on an unknown name raises the config's error for the field the
registry serves: ``invalid data.name='x': allowed values are ...`` (exit code 2 on the CLI).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from fedsap_ray.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")


class Registry(Generic[T]):
    """Names -> registered objects for one config field (``field``, e.g. ``data.name``).

    ``loader`` is the module whose import registers every entry (imported on first lookup);
    ``name_attr``, when set, is the attribute the decorator sets on what it registers to its name;
    ``sort_allowed``: the error on an unknown name lists the allowed names sorted, else in the order
    they were registered (the package's import order: how ``data.name`` and ``model.name`` always listed them).
    """

    def __init__(self, field: str, what: str, loader: str, name_attr: str | None = None, sort_allowed: bool = True) -> None:
        self.field, self.what, self.loader, self.name_attr = field, what, loader, name_attr
        self.sort_allowed = sort_allowed
        self.entries: dict[str, T] = {}  # the table itself (tests may patch it)

    def register(self, name: str) -> Callable[[R], R]:
        """Decorator: register the decorated class or function under ``name`` (a second one is an error)."""
        def deco(obj: R) -> R:
            if name in self.entries:
                raise ValueError(f"{self.what} {name!r} registered twice")
            if self.name_attr is not None:
                setattr(obj, self.name_attr, name)
            self.entries[name] = obj  # type: ignore[assignment]  # R is the registered T
            return obj
        return deco

    def unregister(self, name: str) -> None:
        """Forget ``name`` (for tests that register something of their own)."""
        self.entries.pop(name, None)

    def load(self) -> None:
        """Import the module that registers every entry (a no-op once imported)."""
        importlib.import_module(self.loader)

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self.load()
        return sorted(self.entries)

    def get(self, name: Any) -> T:
        """The entry ``name``; a ConfigError naming the field, the value and the allowed names otherwise."""
        self.load()
        if not isinstance(name, str) or name not in self.entries:
            allowed = sorted(self.entries) if self.sort_allowed else list(self.entries)
            raise ConfigError(f"invalid {self.field}={name!r}: allowed values are {', '.join(allowed)}")
        return self.entries[name]

    def __contains__(self, name: object) -> bool:
        self.load()
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


STRATEGIES: Registry[Any] = Registry("algorithm.name", "algorithm", "fedsap_ray.algorithms", name_attr="name")
HOOKS: Registry[Any] = Registry("client hook", "client hook", "fedsap_ray.algorithms", name_attr="name")
DATASETS: Registry[Any] = Registry("data.name", "dataset", "fedsap_ray.data", name_attr="name", sort_allowed=False)
MODELS: Registry[Any] = Registry("model.name", "model", "fedsap_ray.models", sort_allowed=False)

register_model = MODELS.register  # @register_model("name") on a factory(num_classes=, input_shape=, width_mult=, channels=[, vocab_size=])
