"""A trial at Tune's boundary: the flat dict Tune hands a trainable <-> typed, validated configs.

Tune hands the trainable a flat dict of dotted config keys (``{"algorithm.g_target": 0.8,
"seed": 0, ...}``) plus sweep metadata under ``_``-prefixed keys (``_study``, ``_preset``,
``_out``, ``_variant``, ``_seeds``, ``_workers``, ``_server_cpus``); :func:`to_configs` turns it
into :class:`~fedsap_ray.config.ExperimentConfig` objects and deterministic run ids
(``<variant>-s<seed>``, or a config hash for sampled trials), so each trial owns exactly one
set of rows.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ray import tune

from fedsap_ray.config import ExperimentConfig, build_config, parse_override

METRIC = "best_global_accuracy"  # what the live line, Optuna and the schedulers rank trials by


def flat_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["algorithm.sgp=false", ...]`` -> ``{"algorithm.sgp": False, ...}`` (values parsed as the CLI does)."""
    out: dict[str, Any] = {}
    for text in overrides:
        path, value = parse_override(text)
        out[".".join(path)] = value
    return out


def flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    """A grid trial arrives as ``{"trial": {...}}``, a sampled one flat: one flat dict either way."""
    return {**config.get("trial", {}), **{k: v for k, v in config.items() if k != "trial"}}


def to_configs(flat: Mapping[str, Any]) -> tuple[list[ExperimentConfig], list[str]]:
    """The trial's typed configs (one per seed in ``_seeds``, else ``seed``) and their run ids."""
    keys = {k: v for k, v in flat.items() if not k.startswith("_") and k != "seed"}
    overrides = [f"{k}={json.dumps(v)}" for k, v in sorted(keys.items())]
    overrides.append(f"study={json.dumps(flat['_study'])}")
    seeds = list(flat.get("_seeds") or [flat.get("seed", 0)])
    cfgs = [build_config(preset=flat["_preset"], overrides=overrides, seed=int(s)) for s in seeds]
    variant = flat.get("_variant") or "t" + hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:10]
    return cfgs, [f"{variant}-s{c.seed}" for c in cfgs]


def trial_resources(flat: Mapping[str, Any]) -> tune.PlacementGroupFactory:
    """One bundle for the server (the trainable: round logic, aggregation, evaluation, Parquet writer)
    and one per client worker of every run of the trial; the trial's ``ClientWorker`` actors are
    captured into this placement group."""
    cfgs, _ = to_configs(flat)
    r = cfgs[0].resources
    worker = {"CPU": r.cpus_per_worker, **({"GPU": r.gpus_per_worker} if r.gpus_per_worker > 0 else {})}
    n = int(flat.get("_workers", 1)) * len(cfgs)
    return tune.PlacementGroupFactory([{"CPU": float(flat.get("_server_cpus", 1.0))}] + [dict(worker)] * n,
                                      strategy="PACK")


def trial_name(config: Mapping[str, Any]) -> str:
    """The trial's run ids, comma-separated (an invalid sampled config: its keys)."""
    flat = flatten(config)
    try:
        return ",".join(to_configs(flat)[1])
    except Exception:
        return json.dumps({k: v for k, v in flat.items() if not k.startswith("_")}, default=str)[:200]
