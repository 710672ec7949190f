"""The config's field checks and what they allow: one-line refusals naming the field, the value and the allowed values.

Every config section, every strategy's options and the run's resource checks use these, so a refusal reads the
same wherever it comes from (:class:`~fedsap_ray.common.errors.ConfigError`, exit code 2); the short forms of an
offending value (:func:`short`, :func:`clip`) keep an error one line whatever the input was.
"""
from __future__ import annotations

import math
import numbers
import re
import reprlib
import typing
from typing import Any

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config import registry


SHORT_VALUE = 80  # characters of an offending value an error line quotes, at most


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    # a few levels and items of a container, a prefix of a long string or number: never the whole value
    # (a YAML alias bomb or a megabyte of --set text must not become a gigabyte error line)
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset, r.maxfrozenset, r.maxdeque, r.maxarray = 3, 6, 12, 12, 6, 6, 6, 6
    r.maxstring, r.maxlong, r.maxother = SHORT_VALUE, SHORT_VALUE, SHORT_VALUE
    return r


_SHORT = _short_repr()


def short(value: Any, limit: int = SHORT_VALUE) -> str:
    """``repr(value)`` for an error line, cut to at most ``limit`` characters without ever building the
    whole repr of a huge or deeply nested value (:mod:`reprlib`); what was cut ends in ``...``."""
    try:
        text = _SHORT.repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit for str(); a pathological object
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())  # one line, whatever the value holds
    return text if len(text) <= limit else text[:limit - 3] + "..."


def clip(text: str, limit: int = SHORT_VALUE) -> str:
    """``text`` unquoted on one line, cut to at most ``limit`` characters (ending in ``...`` when cut)."""
    text = " ".join(text[:limit * 4].split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def path_text(path: Any) -> str:
    """A file path as an error line quotes it: whole (a user must find the file; temporary and cluster paths
    are long), only cut past 1,024 characters, on one line."""
    text = repr(str(path)[:2048])
    return " ".join(text.split()) if len(text) <= 1024 else text[:1021] + "..."


def key_text(k: Any) -> str:
    """A mapping key as an error names it: as written when it is a plain word, else quoted (and short)."""
    return k if isinstance(k, str) and re.fullmatch(r"[A-Za-z0-9_]{1,60}", k) else short(k, 60)


# ----------------------------------------------------------------------------- checks
# The one place for the checks behind every "invalid FIELD=VALUE: ALLOWED" line: the sections below and
# every strategy's ``Options`` (fedsap_ray/algorithms) use them, so one kind of value is refused in one
# wording. ``name`` is the field as the user writes it (``training.lr``, ``algorithm.mu``).

def fail(name: str, value: Any, allowed: str) -> typing.NoReturn:
    """Raise the one-line :class:`ConfigError` naming the field, the offending value (quoted short) and what
    is allowed: the message every check here sends and docgen quotes in the reference pages."""
    raise ConfigError(f"invalid {name}={short(value)}: {allowed}")


def is_number(v: Any) -> bool:
    """An int or float that is not a bool (YAML's ``true`` is no number) and not NaN."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v)  # numbers: numpy's too


def check_ratio(name: str, v: float, *, low_open: bool = False) -> None:
    """``v`` in [0, 1] (or (0, 1] with ``low_open``): a share or probability of the config's sections."""
    if not isinstance(v, (int, float)) or math.isnan(v) or v > 1 or v < 0 or (low_open and v == 0):
        fail(name, v, "must be a number in " + ("(0, 1]" if low_open else "[0, 1]"))


def check_positive(name: str, v: Any, *, allow_zero: bool = False) -> None:
    """``v`` finite and > 0 (>= 0 with ``allow_zero``): a rate, size or resource of the config's sections."""
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (v >= 0 if allow_zero else v > 0))  # isfinite first: comparisons are never true for NaN
    if not ok:
        fail(name, v, "must be " + ("a non-negative finite number" if allow_zero else "a positive finite number"))


def check_choice(name: str, v: Any, choices: typing.Iterable[Any]) -> None:
    """``v`` one of ``choices`` (the message lists them in their order)."""
    choices = list(choices)
    if v not in choices:
        fail(name, v, "allowed values are " + ", ".join(map(str, choices)))


def check_number(name: str, v: Any, low: float, high: float | None = None, *, low_open: bool = False,
                 high_open: bool = False, nullable: bool = False, note: str = "") -> None:
    """``v`` a number >= ``low`` (> with ``low_open``) and, with ``high``, <= ``high`` (< with ``high_open``), or
    None when ``nullable``: "must be a number >= 0", "must be null or a number in (0, 1]", ... and ``note`` (why
    the range) after it."""
    if nullable and v is None:
        return
    ok = is_number(v) and (v > low if low_open else v >= low)
    if high is None:
        bounds = f"{'>' if low_open else '>='} {low:g}"
    else:
        ok = ok and (v < high if high_open else v <= high)
        bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if not ok:
        fail(name, v, f"must be {'null or ' if nullable else ''}a number {bounds}{note}")


def check_int(name: str, v: Any, low: int) -> None:
    """``v`` an integer (not a bool) >= ``low``: a count of rounds, samples or steps."""
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < low:
        fail(name, v, f"must be an integer >= {low}")


def check_bool(name: str, v: Any) -> None:
    """``v`` a bool (YAML's true/false), not a truthy number or string."""
    if not isinstance(v, bool):
        fail(name, v, "must be true or false")


SEED_MAX = 2**32 - 1  # the seed range every numpy/torch seeding API accepts
SEED_ALLOWED = f"must be an integer in [0, {SEED_MAX}] (0 <= seed < 2**32)"

PARTITIONS = ("domain", "dirichlet", "natural", "iid", "explicit")
CAPACITY_SCHEMES = ("cyclic", "tiers", "full", "explicit")
BACKENDS = ("local", "ray")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("off", "train", "train+eval")  # resources.compile (fedsap_ray.engine.compiled)
OFF_IS_FALSE = frozenset({"resources.compile", "privacy.mode"})  # string fields whose "off" YAML reads as false: coerce maps it back
SUBMODELS = ("sliced", "masked")
# training.keep_model: which global models a run keeps under OUT/models/<run_id>/ (fedsap_ray.results.kept)
KEEP_MODELS = ("none", "final", "best", "final+best")
DEVICE_POLICIES = ("wait_all", "deadline", "over_select")
DEVICE_MODES = ("sync", "async")  # devices.mode: synchronous rounds, or asynchronous server steps (fedsap_ray.engine.asyncmode)
STALENESS_RULES = ("constant", "polynomial", "hinge")  # asynchronous.staleness (fedsap_ray.algorithms.staleness)
# [low, high] of the device model's numbers (and of a trace's columns): with train_macs and bytes up to
# 1e15 and any lognormal draw, (1 + backward_factor) * macs / (speed * factor) + bytes / bandwidth is then a
# finite float64 > 0 (a speed or bandwidth of 1e-300 or a backward_factor of 1e308 gave infinite times,
# a jitter of 1000 a factor of 0 and a division by zero)
DEVICE_RANGES: dict[str, tuple[float, float]] = {
    "speed_full": (1.0, 1e18), "down_bytes_s": (1.0, 1e15), "up_bytes_s": (1.0, 1e15),
    "backward_factor": (0.0, 1e3), "jitter": (0.0, 4.0), "over_select": (0.0, 1e3)}
DEVICE_RANGE_WHY = "so that every simulated time is finite and > 0"
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])"
_RAY_ADDRESS = re.compile(rf"(?:ray://)?{_HOST}:(\d{{1,5}})")
RAY_ADDRESS_ALLOWED = "must be auto, local, HOST:PORT or ray://HOST:PORT (a host name or IP address, a port 1-65535)"


def check_ray_address(field_name: str, v: Any) -> None:
    """A Ray address the way ``ray.init`` takes it; anything else is refused here, before Ray starts
    (ray.init would fail later, after the run was set up, with a message that does not name the option)."""
    if v is None or v in ("auto", "local"):
        return
    m = _RAY_ADDRESS.fullmatch(v) if isinstance(v, str) else None
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        fail(field_name, v, RAY_ADDRESS_ALLOWED)


def check_supported(name: str, options: Any, declaration: str, mode: str) -> None:
    """``algorithm.name`` refused by name, with every method that is supported, when its strategy's ``declaration``
    (a classmethod answering None, or why not, for given options: ``async_support``, ``privacy_support``) refuses
    ``mode`` (the setting that asked, e.g. ``devices.mode=async``)."""
    refusal = getattr(registry.STRATEGIES.get(name), declaration)(options)
    if refusal is not None:
        supported = [m for m in registry.STRATEGIES.names()
                     if getattr(registry.STRATEGIES.get(m), declaration)(registry.STRATEGIES.get(m).Options()) is None]
        fail("algorithm.name", name, f"{mode} does not support {name}: {refusal}; supported: {', '.join(supported)}")
