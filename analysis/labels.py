"""What a run ran, read from its resolved options: the one run label and the protocol keys.

Every analysis names a run with :func:`label`, computed from the runs table's flattened
``config.<section>.<field>`` columns (:func:`fedsap_ray.results.with_config_columns`), never from
``config_json`` text or the run id: the algorithm's registry name plus the method-variant options
(:data:`VARIANT_OPTIONS`) the run set away from the strategy's defaults, e.g. ``fedprox`` or
``hasfl (coverage=False)``. A study that prints the paper's row names maps these labels to them
with a dictionary of its own (``comparison.TABLE1_ROWS``, ``confound.tables.ROWS``), so two
studies can name one configuration differently but can never disagree about which configuration
a run has.
"""
from __future__ import annotations

import dataclasses
import json
import math
from functools import cache
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from fedsap_ray.results import CONFIG_PREFIX

ALGORITHM = CONFIG_PREFIX + "algorithm.name"
OPTIONS = CONFIG_PREFIX + "algorithm.options."  # prefix of the options a run set
OPT = "opt_"  # prefix of the resolved-option columns :func:`analysis.runs.annotate_runs` adds
# Options that make a different method rather than tune one (a hyperparameter such as FedProx's mu is the
# study's protocol and never part of a label): the width a full-model method trains at, FedDrop's channel
# selection, DapperFL's first epoch, HAS-FL's / Random-budget's coverage guarantee.
VARIANT_OPTIONS = ("width", "selection", "full_first_epoch", "coverage")
# Config keys that never change what a run computes (where it ran, its labels, the file paths), and the
# seed, which a table averages over: runs that differ in anything else must not share a table row.
NOT_PROTOCOL = ("seed", "study", "preset", "resources", "data.root", "data.download")


# ----------------------------------------------------------------------------- options

@cache
def _resolved(name: str, options_json: str) -> tuple[tuple[str, Any], ...]:
    from fedsap_ray.algorithms.registry import parse_options
    from fedsap_ray.common.errors import ConfigError

    options = json.loads(options_json)
    try:
        return tuple(dataclasses.asdict(parse_options(name, options)).items())
    except ConfigError:  # an option (or algorithm) this version does not accept: keep what was stored
        pass
    try:
        defaults = dataclasses.asdict(parse_options(name, {}))
    except ConfigError:
        defaults = {}
    return tuple({**defaults, **options}.items())


def resolved_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every option of algorithm ``name`` as the run used it: ``options`` over the strategy's defaults
    (the stored config holds only what the user and the preset set)."""
    return dict(_resolved(name, json.dumps(dict(options or {}), sort_keys=True, default=str)))


def _missing(v: Any) -> bool:
    """A leaf the run lacks: NaN in a ``config.*`` column (an explicit null stays None)."""
    return isinstance(v, (float, np.floating)) and math.isnan(v)


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def algorithm_of(run: Mapping[str, Any]) -> str:
    """The registry name of a run's algorithm (``config.algorithm.name``, else the ``algorithm`` column)."""
    name = run.get(ALGORITHM)
    if not isinstance(name, str) or not name:
        name = run.get("algorithm")
    return name if isinstance(name, str) else ""


def set_options(run: Mapping[str, Any]) -> dict[str, Any]:
    """The algorithm options a run set, from its ``config.algorithm.options.*`` columns (nested keys
    rebuilt from their dotted names)."""
    out: dict[str, Any] = {}
    for col, v in run.items():
        if not isinstance(col, str) or not col.startswith(OPTIONS) or _missing(v):
            continue
        *path, leaf = col[len(OPTIONS):].split(".")
        d = out
        for k in path:
            d = d.setdefault(k, {})
        d[leaf] = _plain(v)
    return out


def options_of(run: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of a run's algorithm as it ran (:func:`set_options` over the strategy's defaults)."""
    name = algorithm_of(run)
    return resolved_options(name, set_options(run)) if name else {}


def same_value(a: Any, b: Any) -> bool:
    """Option equality: numbers (bools included) up to rounding, everything else by ==, null == null."""
    if _null(a) or _null(b):
        return _null(a) and _null(b)
    if isinstance(a, (int, float, np.number)) and isinstance(b, (int, float, np.number)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return bool(a == b)


def _null(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _shown(v: Any) -> str:
    """An option value in a label; a boolean stored as text prints as the boolean it means."""
    if isinstance(v, str) and v.strip().lower() in ("false", "true", "0", "1", "no", "yes", "off", "on"):
        return str(v.strip().lower() in ("true", "1", "yes", "on"))
    return str(v)


# ----------------------------------------------------------------------------- the label

def label(run: Mapping[str, Any]) -> str:
    """The run's label: registry name plus the :data:`VARIANT_OPTIONS` it set away from the strategy's
    defaults, e.g. ``fedavg (width=capacity)``; ``run`` is a row of the runs table (``config.*`` columns)."""
    name = algorithm_of(run)
    defaults = resolved_options(name) if name else {}
    used = options_of(run)
    changed = [f"{k}={_shown(used[k])}" for k in VARIANT_OPTIONS
               if k in used and k in defaults and not same_value(_bool_of(used[k], defaults[k]), defaults[k])]
    return f"{name} ({', '.join(changed)})" if changed else name


def _bool_of(v: Any, default: Any) -> Any:
    """``v`` as a bool when the default is one and ``v`` is boolean text (an option this version could not parse)."""
    if isinstance(default, bool) and isinstance(v, str):
        return _shown(v) == "True"
    return v


def labels(runs: pd.DataFrame) -> pd.Series:
    """:func:`label` of every row of a runs table (index kept)."""
    return pd.Series([label(r) for _, r in runs.iterrows()], index=runs.index, dtype=object)


def config_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run row (``config.*`` keys) from a config dict, to label a config that is not in a results folder."""
    from fedsap_ray.results import with_config_columns

    return dict(with_config_columns(pd.DataFrame({"config_json": [json.dumps(config)]})).iloc[0])


# ----------------------------------------------------------------------------- protocol

def protocol(run: Mapping[str, Any], algorithm: bool = True) -> dict[str, Any]:
    """A run's resolved configuration as flat ``section.field`` keys (from its ``config.*`` columns),
    without :data:`NOT_PROTOCOL`; the algorithm's options are resolved against the strategy's defaults
    (``algorithm.options.<name>``). ``algorithm=False`` leaves the whole algorithm section out (to pair
    runs of different strategies)."""
    flat: dict[str, Any] = {}
    for col, v in run.items():
        if not isinstance(col, str) or not col.startswith(CONFIG_PREFIX) or _missing(v):
            continue
        key = col[len(CONFIG_PREFIX):]
        if key == "algorithm" or key.startswith("algorithm."):
            continue
        if not any(key == n or key.startswith(n + ".") for n in NOT_PROTOCOL):
            flat[key] = _plain(v)
    name = algorithm_of(run)
    if algorithm and name:
        flat["algorithm.name"] = name
        for k, v in options_of(run).items():
            flat[f"algorithm.options.{k}"] = v
    return dict(sorted(flat.items()))


def _same_json(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return same_value(a, b)


def differing_keys(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The keys on which some of ``configs`` (e.g. :func:`protocol` dicts) disagree, sorted."""
    keys = sorted(set().union(*configs)) if configs else []
    return [k for k in keys if any(not _same_json(c.get(k), configs[0].get(k)) for c in configs[1:])]


def split_configs(df: pd.DataFrame, by: Sequence[str], algorithm: bool = True) -> tuple[pd.Series, dict[tuple, list[str]]]:
    """A ``config`` label per row of ``df`` (rows with ``config.*`` columns) for grouping tables, so no
    group pools runs whose resolved configurations differ beyond the seed (issue 14): within each ``by``
    group whose runs differ, the label lists the differing keys' values (e.g. ``model.width_mult=0.5,
    training.rounds=30``); "" where the group is uniform. Also returns {group: differing keys} for the warnings."""
    labels_ = pd.Series("", index=df.index, dtype=object)
    mixed: dict[tuple, list[str]] = {}
    if df.empty or not any(str(c).startswith(CONFIG_PREFIX) for c in df.columns):
        return labels_, mixed
    protos = {i: protocol(r, algorithm) for i, r in df.iterrows()}
    for key, part in df.groupby(list(by), sort=False, dropna=False):
        diff = differing_keys([protos[i] for i in part.index])
        if diff:
            key = key if isinstance(key, tuple) else (key,)
            mixed[key] = diff
            for i in part.index:
                labels_[i] = ", ".join(f"{k}={json.dumps(protos[i].get(k), default=str)}" for k in diff)
    return labels_, mixed


def mixed_warning(mixed: Mapping[tuple, Sequence[str]], what: str = "runs") -> str:
    """One line naming the groups whose runs differ beyond the seed and the keys they differ in."""
    parts = [f"{' / '.join(str(k) for k in key)}: {', '.join(keys)}" for key, keys in mixed.items()]
    return (f"{what} of one group differ beyond the seed (split into one row per configuration, column "
            f"'config'): " + "; ".join(parts))
