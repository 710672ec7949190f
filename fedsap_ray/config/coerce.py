"""Strict coercion of plain mappings (YAML, JSON, ``--set``) into the config's frozen dataclasses.

One rule for the config tree and for every strategy's ``Options``: no "1" for 1, no bool for a number, no NaN,
integers within int64, and a one-line refusal naming the key (:func:`construct`, :func:`coerce`).
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any
from collections.abc import Callable, Mapping

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.checks import OFF_IS_FALSE, SEED_ALLOWED, fail, key_text


Checks = Mapping[type, Callable[[Any], None]]  # extra checks run on each built node of a type


def construct(cls: Any, d: Any, prefix: str, checks: Checks | None = None) -> Any:
    """The dataclass ``cls`` from the plain mapping ``d``, each value coerced to its field's type;
    a one-line ConfigError naming ``prefix + key`` otherwise. ``checks[t](node)`` runs on every node
    of type ``t`` as soon as it is built (how the config layer checks algorithm options, which this
    module cannot know), so errors come in the order of the mapping's keys."""
    if not isinstance(d, Mapping):
        fail(prefix.rstrip(".") or "config", d, "must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in d if k not in fields]
    if unknown:
        k = unknown[0]  # any YAML key (an int, a null, ''), named as written: quoted unless it is a plain word
        key = key_text(k)
        fail(f"{prefix}{key}", d[k], f"unknown key; allowed keys under {prefix.rstrip('.') or 'the top level'} are " + ", ".join(fields))
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in d.items():
        kwargs[k] = coerce(hints[k], v, prefix + k, checks)
    try:
        node = cls(**kwargs)
    except TypeError as e:  # pragma: no cover - defensive
        raise ConfigError(f"invalid {prefix.rstrip('.')}: {e}") from e
    if checks and cls in checks:
        checks[cls](node)
    return node


INT64_MAX = 2**63 - 1  # what the Parquet int64 columns (seed, rounds, num_clients...) can hold
_SCALAR_ERRORS = {
    float: {"finite_number": "must be a finite number (not NaN or infinity)"},
    int: {"greater_than_equal": "must be an integer between -2**63 and 2**63-1",
          "less_than_equal": "must be an integer between -2**63 and 2**63-1"},
}


@functools.cache
def _adapter(tp: type) -> Any:
    """A pydantic validator for one scalar type: strict (no "1" for 1, no bools for numbers),
    no NaN or infinity (a NaN slips through every hand-written ``v <= 0`` check), and
    integers within int64."""
    from pydantic import ConfigDict, Field, TypeAdapter

    if tp is int:
        return TypeAdapter(typing.Annotated[int, Field(strict=True, ge=-INT64_MAX - 1, le=INT64_MAX)])
    return TypeAdapter(tp, config=ConfigDict(strict=True, allow_inf_nan=False))


def _scalar(tp: type, v: Any, name: str) -> Any:
    """``v`` as a ``tp`` (int or float), or a one-line ConfigError naming ``name``."""
    from pydantic import ValidationError

    if isinstance(v, bool):  # a bool is an int to Python, never a number to a config
        fail(name, v, "must be a number" if tp is float else "must be an integer")
    try:
        return _adapter(tp).validate_python(v)
    except ValidationError as e:
        kind = e.errors()[0]["type"]
        if name == "seed" and kind in _SCALAR_ERRORS[int]:
            fail(name, v, SEED_ALLOWED)
        fail(name, v, _SCALAR_ERRORS[tp].get(kind, "must be a number" if tp is float else "must be an integer"))


def coerce(tp: Any, v: Any, name: str, checks: Checks | None = None) -> Any:
    """``v`` as a value of type ``tp`` (dataclass, optional, tuple, mapping, scalar), strictly: one
    rule for the config tree and for every strategy's options (:mod:`fedsap_ray.algorithms.registry`)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return construct(tp, v, name + ".", checks)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(inner[0], v, name, checks)
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            fail(name, v, "must be a list")
        return tuple(coerce(args[0], x, name, checks) for x in v)
    if origin in (Mapping, dict) or tp is Mapping:
        if not isinstance(v, Mapping):
            fail(name, v, "must be a mapping")
        return dict(v)
    if tp is float:
        return _scalar(float, v, name)
    if tp is int:
        if isinstance(v, float) and v.is_integer():  # YAML/JSON may spell an integer 3.0
            v = int(v)
        return _scalar(int, v, name)
    if tp is bool:
        if not isinstance(v, bool):
            fail(name, v, "must be true or false")
        return v
    if tp is str:
        if v is False and name in OFF_IS_FALSE:  # YAML 1.1 reads a bare off as false (a file, or --set)
            return "off"
        if not isinstance(v, str):
            fail(name, v, "must be a string")
        return v
    return v
