"""Plans and results as checkpoint trees (:mod:`fedsap_ray.persist.treecodec`): what the asynchronous engine's clients
in flight hold (:mod:`fedsap_ray.engine.asyncmode`), stored so a resumed run applies exactly the updates it would have.

A :class:`~fedsap_ray.common.messages.ClientPlan` or :class:`~fedsap_ray.common.messages.ClientResult` is stored by its
dataclass fields, each value as it is (an ``int`` stays an ``int``, an ``np.float64`` learning rate one), so a
restored message compares equal field by field. Three things need more than that:

- a plan's ``params`` is the full-size vector its client downloaded, shared by every plan started on the same
  model version: it is left out when it is that version's vector (``base``), which the caller stores once per
  version, and set back to that very object on load;
- masks are shared objects (the clients of one width share theirs; a result holds its plan's mask object):
  the codec stores an array reached twice once and gives back one object, so whatever was shared within one
  checkpoint is shared again, and :func:`fedsap_ray.common.messages.check_results`'s ``r.mask is plan.mask`` still holds;
- hook payloads (:class:`~fedsap_ray.common.messages.HookCall`) are frozen dataclasses of the hook's ``Payload`` type:
  stored as (hook name, payload fields) and rebuilt through the hook registry, so nothing in the file names a
  class to import (reading a checkpoint runs no code). A payload field the codec does not store stops the save
  naming its key (:class:`~fedsap_ray.persist.treecodec.TreeTypeError`).

Anything malformed on load raises :class:`ValueError` or :class:`TypeError` with the field's name; the caller
turns it into the one-line refusal of a resume (:mod:`fedsap_ray.persist.statecheck`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedsap_ray.common.messages import ClientPlan, ClientResult, HookCall, StartOverlay
from fedsap_ray.config.registry import HOOKS

__all__ = ["plan_from_tree", "plan_tree", "result_from_tree", "result_tree"]

BASE = "base"  # a plan's params that are the version's vector the caller stores once


def _fields(obj: Any) -> dict[str, Any]:
    """``obj``'s dataclass fields by name, values as they are (``dataclasses.asdict`` would copy and recurse)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def plan_tree(plan: ClientPlan, base: np.ndarray) -> dict[str, Any]:
    """``plan`` as a tree; ``params`` is the marker :data:`BASE` when it is the object ``base``."""
    tree = _fields(plan)
    if plan.params is base:
        tree["params"] = BASE
    tree["hooks"] = [[c.name, _fields(c.payload)] for c in plan.hooks]
    tree["overlay"] = None if plan.overlay is None else _fields(plan.overlay)
    return tree


def plan_from_tree(tree: Mapping[str, Any], base: np.ndarray) -> ClientPlan:
    """The plan :func:`plan_tree` stored (``base``: the version's vector it named); checked as it is built."""
    kw = _known(tree, ClientPlan, "plan")
    if isinstance(kw.get("params"), str):
        if kw["params"] != BASE:
            raise ValueError(f"plan.params is {kw['params']!r}; an array or {BASE!r}")
        kw["params"] = base
    kw["hooks"] = tuple(_hook(i, h) for i, h in enumerate(_list(kw.get("hooks", []), "plan.hooks")))
    _arrays(kw, ("params", "mask"), "plan")
    if kw.get("overlay") is not None:
        o = _known(kw["overlay"], StartOverlay, "plan.overlay")
        _arrays(o, ("values", "where"), "plan.overlay")
        kw["overlay"] = StartOverlay(**o)
    return ClientPlan(**kw)


def result_tree(result: ClientResult) -> dict[str, Any]:
    """``result`` as a tree (its ``stats`` dict of arrays, its ``mask`` object, kept as they are)."""
    return _fields(result)


def result_from_tree(tree: Mapping[str, Any]) -> ClientResult:
    """The result :func:`result_tree` stored; checked as it is built."""
    kw = _known(tree, ClientResult, "result")
    _arrays(kw, ("values", "mask"), "result")
    stats = kw.get("stats", {})
    if type(stats) is not dict or not all(type(k) is str and isinstance(v, np.ndarray) for k, v in stats.items()):
        raise TypeError("result.stats is not a dict of named arrays")
    return ClientResult(**kw)


def _known(tree: Any, cls: type, what: str) -> dict[str, Any]:
    """``tree``'s entries, each a field of ``cls`` and every required field present."""
    if type(tree) is not dict:
        raise TypeError(f"{what} is {type(tree).__name__}; a dict of its fields")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in tree if k not in fields]
    if unknown:
        raise ValueError(f"{what}.{unknown[0]} is not a field of {cls.__name__}")
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING and n not in tree]
    if required:
        raise ValueError(f"{what}.{required[0]} is missing")
    return dict(tree)


def _arrays(kw: dict[str, Any], names: tuple[str, ...], what: str) -> None:
    for n in names:
        v = kw.get(n)
        if v is not None and not isinstance(v, np.ndarray):
            raise TypeError(f"{what}.{n} is {type(v).__name__}; an array")


def _list(v: Any, what: str) -> list[Any]:
    if type(v) not in (list, tuple):
        raise TypeError(f"{what} is {type(v).__name__}; a list")
    return list(v)


def _hook(i: int, h: Any) -> HookCall:
    """One stored hook call: [registered name, payload fields] -> HookCall(name, its Payload(**fields))."""
    if type(h) not in (list, tuple) or len(h) != 2 or type(h[0]) is not str or type(h[1]) is not dict:
        raise TypeError(f"plan.hooks[{i}] is not [hook name, payload fields]")
    name, fields = h
    if name not in HOOKS:
        raise ValueError(f"plan.hooks[{i}] names the client hook {name!r}, which is not registered")
    try:
        return HookCall(name, HOOKS.get(name).Payload(**fields))
    except TypeError as e:  # a field the payload does not have, or one it needs
        raise ValueError(f"plan.hooks[{i}] ({name}): {e}") from e
