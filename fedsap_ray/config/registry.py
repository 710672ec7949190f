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

A registry may also take plugins: ``DATASETS`` reads the entry point group ``fedsap_ray.datasets``
(:mod:`importlib.metadata`) the first time it is asked for a name it does not hold, loads the entry
point of that name (only that one: a broken plugin of another name never stops a run) and hands what it
loaded to its ``registrar`` (a ``module:function`` path, imported then), which registers it. A plugin that
fails to load, or loads something the registrar refuses, is one :class:`ConfigError` line naming the entry
point and its distribution, never a traceback (docs/guides/own-data.md).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from fedsap_ray.common.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")


class Registry(Generic[T]):
    """Names -> registered objects for one config field (``field``, e.g. ``data.name``).

    ``loader`` is the module whose import registers every entry (imported on first lookup);
    ``name_attr``, when set, is the attribute the decorator sets on what it registers to its name;
    ``sort_allowed``: the error on an unknown name lists the allowed names sorted, else in the order
    they were registered (the package's import order: how ``data.name`` and ``model.name`` always listed them).
    """

    def __init__(self, field: str, what: str, loader: str, name_attr: str | None = None, sort_allowed: bool = True,
                 plugins: str | None = None, registrar: str | None = None) -> None:
        self.field, self.what, self.loader, self.name_attr = field, what, loader, name_attr
        self.sort_allowed = sort_allowed
        self.entries: dict[str, T] = {}  # the table itself (tests may patch it)
        # the entry point group a name this table lacks is looked up in, and the ``module:function`` that
        # registers what such an entry point loads (called as registrar(name, loaded_object, entry_point))
        self.plugins, self.registrar = plugins, registrar
        self.plugin_errors: dict[str, str] = {}  # name -> why its plugin did not load (refused again, not re-imported)

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
        """Forget ``name`` (for tests that register something of their own), and why its plugin failed, if it did."""
        self.entries.pop(name, None)
        self.plugin_errors.pop(name, None)

    def load(self) -> None:
        """Import the module that registers every entry (a no-op once imported)."""
        importlib.import_module(self.loader)

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self.load()
        return sorted(self.entries)

    def get(self, name: Any) -> T:
        """The entry ``name`` (from its plugin when the table lacks it); a ConfigError naming the field, the
        value and the allowed names (the plugins' among them) otherwise."""
        self.load()
        if isinstance(name, str) and name not in self.entries:
            self.load_plugin(name)
        if not isinstance(name, str) or name not in self.entries:
            allowed = sorted(self.entries) if self.sort_allowed else list(self.entries)
            allowed += sorted(set(self.plugin_names()) - set(allowed))
            raise ConfigError(f"invalid {self.field}={name!r}: allowed values are {', '.join(allowed)}")
        return self.entries[name]

    def __contains__(self, name: object) -> bool:
        self.load()
        if isinstance(name, str) and name not in self.entries:
            try:
                self.load_plugin(name)
            except ConfigError:
                return False
        return name in self.entries

    # --- plugins ----------------------------------------------------------------------------------------
    def plugin_entry_points(self) -> list[Any]:
        """The installed entry points of :attr:`plugins` (:mod:`importlib.metadata`; nothing is imported)."""
        if self.plugins is None:
            return []
        from importlib.metadata import entry_points

        return list(entry_points(group=self.plugins))

    def plugin_names(self) -> list[str]:
        """The names the installed plugins offer (their entry points' names; nothing is imported)."""
        return sorted({ep.name for ep in self.plugin_entry_points()})

    def load_plugin(self, name: str) -> bool:
        """Load and register the plugin entry point ``name`` of :attr:`plugins`, once; False when there is none.

        Why one line: a plugin is someone else's code, so whatever it raises (an ImportError, a syntax error,
        its own exception) is reported as :class:`ConfigError` naming the entry point, its value and its
        distribution, and remembered, so the next lookup gives the same line without importing it again."""
        if name in self.entries:
            return True
        if name in self.plugin_errors:
            raise ConfigError(self.plugin_errors[name])
        found = [ep for ep in self.plugin_entry_points() if ep.name == name]
        if not found:
            return False
        where = ", ".join(describe_entry_point(ep) for ep in found)
        if len(found) > 1:
            self.plugin_errors[name] = (f"invalid {self.field}={name!r}: {len(found)} plugins of the entry point group "
                                        f"{self.plugins} offer it ({where}); uninstall all but one")
            raise ConfigError(self.plugin_errors[name])
        ep = found[0]
        try:
            obj = ep.load()
            module, _, func = (self.registrar or "").partition(":")
            getattr(importlib.import_module(module), func)(name, obj, ep)
            if name not in self.entries:
                raise TypeError("it registered nothing under its name")
        except Exception as e:  # someone else's code: one line naming it, never a traceback
            first = (str(e).splitlines() or [""])[0]
            self.entries.pop(name, None)
            self.plugin_errors[name] = (f"invalid {self.field}={name!r}: the plugin {where} (entry point group "
                                        f"{self.plugins}) failed to load: {e.__class__.__name__}: {first}; fix the "
                                        "plugin or uninstall its distribution")
            raise ConfigError(self.plugin_errors[name]) from e
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


STRATEGIES: Registry[Any] = Registry("algorithm.name", "algorithm", "fedsap_ray.algorithms", name_attr="name")
HOOKS: Registry[Any] = Registry("client hook", "client hook", "fedsap_ray.algorithms", name_attr="name")
DATASETS: Registry[Any] = Registry("data.name", "dataset", "fedsap_ray.data", name_attr="name", sort_allowed=False,
                                   plugins="fedsap_ray.datasets", registrar="fedsap_ray.data.own:register_plugin")
MODELS: Registry[Any] = Registry("model.name", "model", "fedsap_ray.models", sort_allowed=False)

register_model = MODELS.register  # @register_model("name") on a factory(num_classes=, input_shape=, width_mult=, channels=[, vocab_size=])


def describe_entry_point(ep: Any) -> str:
    """``name = module:object`` of an entry point, with the distribution that installed it when known."""
    dist = getattr(ep, "dist", None)
    by = f" (distribution {dist.name} {dist.version})" if dist is not None else ""
    return f"{ep.name} = {ep.value}{by}"
