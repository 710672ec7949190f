"""Assembling an experiment config: defaults <- preset <- file <- ``--set`` overrides <- ``--seed``.

The config is one frozen dataclass tree, the single source of truth for a run; its types and
field checks are :mod:`fedsap_ray.config.schema` (re-exported here). This module loads it from YAML/JSON
and from ``--set a.b=value`` overrides and validates it *before any work*: every error is a
:class:`ConfigError` whose message names the field, the offending value and what is allowed, so
the CLI can print one line and exit with code 2.

Presets (``smoke``, ``laptop``, ``paper``, ...) are plain nested dicts applied on top of the
defaults; algorithm-specific options (e.g. FedProx ``mu``) live in ``algorithm.options`` and are
turned into the strategy's own options dataclass, once, when the schema builds ``AlgorithmConfig``
(it finds the strategy through :mod:`fedsap_ray.config.registry`, which imports no strategy).
docs/reference/config.md is generated from both modules.
"""
from __future__ import annotations

import hashlib
import json
import re
import typing
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import yaml

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.schema import (BACKENDS, CAPACITY_SCHEMES, DEVICES, INT64_MAX, PARTITIONS, SEED_ALLOWED, SEED_MAX,
                               SUBMODELS, AlgorithmConfig, CapacityConfig, DataConfig, ExperimentConfig, ModelConfig,
                               ResourcesConfig, TrainingConfig, fail, clip, construct, path_text, short)

__all__ = [  # the schema's names stay importable from here, where they were defined before fedsap_ray.config.schema
    "BACKENDS", "CAPACITY_SCHEMES", "DEVICES", "INT64_MAX", "PARTITIONS", "SEED_ALLOWED",
    "SEED_MAX", "SUBMODELS", "AlgorithmConfig", "CapacityConfig", "ConfigError", "DataConfig", "ExperimentConfig", "ModelConfig",
    "ResourcesConfig", "TrainingConfig", "PRESETS", "PRESET_NOTES", "DEFAULT_PRESET", "build_config", "from_dict",
    "load_file", "parse_override", "deep_merge", "apply_algorithm_defaults",
]


# ---------------------------------------------------------------------------------
# Presets: nested dicts applied over the defaults.
# ---------------------------------------------------------------------------------
PRESETS: dict[str, dict[str, Any]] = {
    # seconds: a tiny federation on the embedded dataset, every code path exercised
    "smoke": {
        "data": {"name": "embedded_digits", "num_clients": 10, "client_fraction": 0.02,
                 "max_test_per_domain": 200},
        "model": {"name": "resnet10", "width_mult": 0.125},
        "training": {"rounds": 4, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
    },
    # minutes on 2 CPU cores: the embedded four-domain benchmark, Digits protocol
    "laptop": {
        "data": {"name": "embedded_digits", "num_clients": 10, "client_fraction": 0.1,
                 "max_test_per_domain": 500},
        "model": {"name": "resnet10", "width_mult": 0.25},
        # deployed models every 5th round and the last: the final deployed figures and every paper figure
        # (best-so-far global accuracy, evaluated every round) are unchanged; docs/guides/performance.md
        "training": {"rounds": 25, "local_epochs": 2, "batch_size": 32, "lr": 0.05, "deployed_every": 5},
    },
    # the published Digits protocol (papers/000 Appendix C, Table 4); other datasets via --set
    "paper": {
        "data": {"name": "digits", "num_clients": 10, "client_fraction": 0.01, "partition": "domain"},
        "model": {"name": "resnet10", "width_mult": 1.0},
        "training": {"rounds": 100, "local_epochs": 10, "batch_size": 64, "lr": 0.01,
                     "momentum": 0.9, "weight_decay": 5e-4},
    },
}
DEFAULT_PRESET = "laptop"


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k != "options":
            out[k] = deep_merge(dict(out[k]), v)
        elif isinstance(v, Mapping) and k == "options" and isinstance(out.get(k), Mapping):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


# papers/003 section 4.1: 20 clients, Dirichlet(0.3) (natural roles for Shakespeare), p_max tiers
# {0.25, 0.5, 0.75, 1.0} with mean 0.525 ("resource-constrained devices more prevalent"; the split is not
# given: 7 x 0.25 / 7 x 0.5 / 3 x 0.75 / 3 x 1.0 is our reading, docs/readings.md), 10 clients per round, 200 rounds, lr 0.01 decayed by
# 0.995 per round, SGD momentum 0.9, weight decay 1e-4, clipping at 10, K = 5 (CIFAR-10) or 1
# local epochs. The batch size is not stated in the paper: 64. HAS-FL's p_min 0.4, gamma 0.25,
# beta 0.9, T_adapt 5, warm-up 10, T_norm 20 are the hasfl strategy's defaults.
_CONFOUND: dict[str, Any] = {
    "data": {"partition": "dirichlet", "alpha": 0.3, "num_clients": 20},
    "capacity": {"scheme": "tiers", "tiers": [0.25, 0.5, 0.75, 1.0], "tier_shares": [7, 7, 3, 3]},
    "training": {"rounds": 200, "local_epochs": 5, "batch_size": 64, "lr": 0.01, "lr_decay": 0.995,
                 "momentum": 0.9, "weight_decay": 1e-4, "grad_clip": 10.0, "participation": 0.5},
}
PRESETS["paper_cifar10"] = deep_merge(_CONFOUND, {"data": {"name": "cifar10"}, "model": {"name": "cnn_cifar"}})
PRESETS["paper_emnist"] = deep_merge(_CONFOUND, {"data": {"name": "emnist"}, "model": {"name": "cnn_emnist"},
                                                 "training": {"local_epochs": 1}})
# Shakespeare: the 20 roles with the most dialogue, K = 1, lr 0.1, clipping at 5 (section 4.1)
PRESETS["paper_shakespeare"] = deep_merge(_CONFOUND, {
    "data": {"name": "shakespeare", "partition": "natural"}, "model": {"name": "char_lstm"},
    "training": {"local_epochs": 1, "lr": 0.1, "grad_clip": 5.0}})
# the same protocol at laptop scale on real MNIST (../shared/data/mnist): 20,000 training images over
# 20 clients, the small CNN at half width, 50 rounds of one local epoch (HAS-FL keeps warm-up 10,
# T_adapt 5, T_norm 20: 8 adaptation steps, 2 normalisations). The deployed models are evaluated every
# 10th round and the last, as in the other confound presets: every round, the 20 deployed evaluations
# (BN calibration + 2,000 test images each) took about 7.5 s of a 9.0 s round (cProfile and
# benchmarks/submodel_speed.py); trained numbers do not depend on it
PRESETS["confound_laptop"] = deep_merge(_CONFOUND, {
    "data": {"name": "mnist", "max_train_per_domain": 20000, "max_test_per_domain": 2000},
    "model": {"name": "cnn_small", "width_mult": 0.5},
    "training": {"rounds": 50, "local_epochs": 1, "batch_size": 32, "deployed_every": 10}})
# CIFAR-10 at laptop scale: the paper_cifar10 protocol shrunk (issue 14 names this reading): 3,000 training
# images (150 a client), 1,000 test images, the CIFAR-10 CNN at half width, 30 rounds of two local epochs
# (the paper's K = 5 would triple the cost; 30 rounds keep HAS-FL's warm-up 10, T_adapt 5, T_norm 20:
# 4 adaptation steps, one normalisation). The deployed models (each as costly to evaluate as a few rounds of
# training here) are evaluated every 10th round for a seeded half of the clients.
PRESETS["confound_cifar10"] = deep_merge(PRESETS["paper_cifar10"], {
    "data": {"max_train_per_domain": 3000, "max_test_per_domain": 1000}, "model": {"width_mult": 0.5},
    "training": {"rounds": 30, "local_epochs": 2, "deployed_every": 10, "eval_clients": 10}})
# Shakespeare at laptop scale: the 20 roles with the most lines (chosen on the full split), 20,000 of
# their training windows (stride 8) and 2,000 of their held-out windows, the LSTM at half width (128
# hidden units), 20 rounds of two local epochs at batch 16 (the paper's lr 0.1, clipping 5, K = 1 and
# batch 64 give ~6 steps a client per round: 30 such rounds never left the most-frequent-character
# baseline, issue 14). HAS-FL keeps warm-up 10, T_adapt 5, T_norm 20: 3 adaptation steps. Deployed models
# as in confound_cifar10 (every 10th round, 10 clients): one evaluation costs about a round's training.
PRESETS["confound_shakespeare"] = deep_merge(PRESETS["paper_shakespeare"], {
    "data": {"max_train_per_domain": 20000, "max_test_per_domain": 2000},
    "model": {"width_mult": 0.5}, "training": {"rounds": 20, "local_epochs": 2, "batch_size": 16,
                                               "deployed_every": 10, "eval_clients": 10}})

# What each preset is for, one line each (the generated docs/reference/config.md lists them; a
# preset without a line here fails the docs check).
PRESET_NOTES: dict[str, str] = {
    "smoke": "seconds: a tiny federation on the embedded data in which every mechanism runs (FedSAP warm-up 1 "
             "and a DGA regrouping every round; HAS-FL and Random-budget warm-up 2, adaptation every round)",
    "laptop": "the default: minutes on 2 CPU cores, the embedded four-domain digits under the Digits protocol "
              "(FedSAP warm-up 5, regrouping every 5 rounds), deployed models evaluated every 5th round",
    "paper": "the published Digits protocol (papers/000 Appendix C, Table 4): real Digits, 10 clients with 1% "
             "of their domain each, ResNet10, 100 rounds of 10 local epochs",
    "paper_cifar10": "papers/003 section 4.1 on CIFAR-10: 20 clients, Dirichlet(0.3), p_max tiers (mean 0.525 as in the "
                     "paper; our split, the paper gives none) 7x0.25 / "
                     "7x0.5 / 3x0.75 / 3x1.0, 10 clients a round, 200 rounds of 5 local epochs, the CIFAR-10 CNN",
    "paper_emnist": "the same protocol on EMNIST ByClass with the EMNIST CNN and one local epoch",
    "paper_shakespeare": "the same protocol on Shakespeare: the 20 roles with the most lines, the character "
                         "LSTM, one local epoch, lr 0.1, clipping at 5",
    "confound_laptop": "the papers/003 protocol at laptop scale on real MNIST from ../shared/data: 20,000 "
                       "training images, cnn_small at half width, 50 rounds of one local epoch, deployed models evaluated every 10th round",
    "confound_cifar10": "the paper_cifar10 protocol shrunk to laptop scale on the shared CIFAR-10 files: 3,000 "
                        "training and 1,000 test images, the CIFAR-10 CNN at half width, 30 rounds of two local "
                        "epochs, deployed models of a seeded half of the clients evaluated every 10th round",
    "confound_shakespeare": "the papers/003 Shakespeare protocol at laptop scale on the shared LEAF files: the 20 "
                            "roles with the most lines, 20,000 of their training windows and 2,000 of their held-out "
                            "windows, char_lstm at half width, 20 rounds of two local epochs at batch 16",
}


MAX_YAML_NODES = 100_000  # nodes a YAML document may hold once its aliases are expanded (a config has < 1,000)


class _Refused(Exception):
    """A document the loaders refuse (a duplicate key, an alias bomb); the message says where."""


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-4`` (no dot) as a string; researchers write weight decays that way.

    Before a document is built it is checked as a tree (:meth:`construct_document`): a mapping may not
    hold a key twice, at any depth (YAML lets the last one win silently: a second ``training:`` section
    would drop the first one's keys), an alias may not refer to the node that holds it, and the
    document expanded (every alias counted as a copy of its anchor) may hold at most
    :data:`MAX_YAML_NODES` nodes, so a small file whose aliases expand to billions of values (a
    "billion laughs") is refused at once."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_tree(node)
        return super().construct_document(node)

    def _check_tree(self, root: yaml.Node) -> None:
        sizes: dict[int, int] = {}  # expanded node count of each node seen, memoised: aliases share nodes
        checked: set[int] = set()

        def size(node: yaml.Node, path: tuple[str, ...], open_: set[int]) -> int:
            if id(node) in sizes:
                return sizes[id(node)]
            if id(node) in open_:
                raise _Refused(f"{_where(path, node)}: an alias refers to the node that holds it (a recursive value)")
            open_.add(id(node))
            total = 1
            if isinstance(node, yaml.MappingNode):
                if id(node) not in checked:
                    checked.add(id(node))
                    self._check_keys(node, path)
                for k, v in node.value:
                    total += size(k, path, open_) + size(v, (*path, _key_text(k)), open_)
                    if total > MAX_YAML_NODES:
                        break
            elif isinstance(node, yaml.SequenceNode):
                for i, v in enumerate(node.value):
                    total += size(v, (*path, str(i)), open_)
                    if total > MAX_YAML_NODES:
                        break
            open_.discard(id(node))
            if total > MAX_YAML_NODES:
                raise _Refused(f"{_where(path, node)}: the document expands to more than {MAX_YAML_NODES:,} values "
                               "(aliases repeating aliases); a config needs a few hundred")
            sizes[id(node)] = total
            return total

        size(root, (), set())

    def _check_keys(self, node: yaml.MappingNode, path: tuple[str, ...]) -> None:
        seen: dict[Any, yaml.Node] = {}
        for k, _ in node.value:
            if k.tag == "tag:yaml.org,2002:merge":
                continue  # '<<: *base' merges a mapping; keys written next to it override it, as YAML says
            try:
                key = self.construct_object(k, deep=True)
                hash(key)
            except (TypeError, yaml.YAMLError):
                continue  # an unhashable or bad key: the constructor reports it
            key = (type(key) if isinstance(key, (bool, int, float)) else str, key)  # 1 and true are distinct keys
            if key in seen:
                first = seen[key].start_mark.line + 1
                raise _Refused(f"duplicate key {'.'.join((*path, _key_text(k)))} at line {k.start_mark.line + 1} "
                               f"(first at line {first}); a key may appear once in a mapping")
            seen[key] = k


def _yaml_int(loader: _YamlLoader, node: yaml.ScalarNode) -> int:
    """YAML integers, with one past Python's digit limit for int() (4,300 digits) refused in one line."""
    try:
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:
        raise _Refused(f"an integer of {len(str(node.value)):,} characters at line {node.start_mark.line + 1}; "
                       "numbers in a config are far shorter") from None


_YamlLoader.add_constructor("tag:yaml.org,2002:int", _yaml_int)


def _key_text(node: yaml.Node) -> str:
    return clip(node.value, 40) if isinstance(node, yaml.ScalarNode) else f"<{node.id}>"


def _where(path: tuple[str, ...], node: yaml.Node) -> str:
    return f"at {'.'.join(path) or 'the top level'} (line {node.start_mark.line + 1})"


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of the JSON loader: a duplicate key is marked here and reported with its path
    by :func:`_json_duplicate` (the hook does not know where its object is)."""
    out = _JsonObject()
    for k, v in pairs:
        if k in out and out.duplicate is None:
            out.duplicate = k
        out[k] = v
    return out


class _JsonObject(dict):
    duplicate: str | None = None


def _json_duplicate(x: Any, path: tuple[str, ...] = ()) -> str | None:
    """The dotted path of the first duplicate key in a parsed JSON document, or None."""
    if isinstance(x, _JsonObject) and x.duplicate is not None:
        return ".".join((*path, clip(x.duplicate, 40)))
    children = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in children:
        found = _json_duplicate(v, (*path, clip(str(k), 40)))
        if found:
            return found
    return None


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|"
               r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$|"
               r"^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value) with the value parsed as YAML (ints, floats, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"invalid --set {short(text)}: expected KEY=VALUE, e.g. training.rounds=20")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"invalid --set {short(text)}: the key must be dotted, e.g. training.rounds")
    try:
        value = yaml.load(raw, Loader=_YamlLoader) if raw.strip() != "" else ""
    except _Refused as e:
        raise ConfigError(f"invalid --set {short(text)}: {e}") from None
    except (yaml.YAMLError, RecursionError):
        value = raw
    return key.split("."), value


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    d: Any = value
    for p in reversed(path):
        d = {p: d}
    return d


def load_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    name = path_text(path)
    if not p.is_file():
        raise ConfigError(f"invalid --config={name}: " + ("it is a folder, not a file" if p.is_dir()
                                                            else "file does not exist"))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"invalid --config={name}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); save the file as UTF-8") from e
    except OSError as e:
        raise ConfigError(f"invalid --config={name}: cannot read it ({e.strerror or e})") from e
    try:
        data = (json.loads(text, object_pairs_hook=_json_pairs) if p.suffix == ".json"
                else yaml.load(text, Loader=_YamlLoader))
    except _Refused as e:
        raise ConfigError(f"invalid --config={name}: {e}") from None
    except (json.JSONDecodeError, yaml.YAMLError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"invalid --config={name}: cannot parse ({e.__class__.__name__}: {clip(first, 200)})") from e
    if p.suffix == ".json":
        try:
            dup = _json_duplicate(data)
        except RecursionError:
            dup = None  # nested past Python's limit: the schema refuses such a value anyway
        if dup is not None:
            raise ConfigError(f"invalid --config={name}: duplicate key {dup}; a key may appear once in an object")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid --config={name}: the top level must be a mapping")
    return data


# The config's sections (and algorithm.options): a mapping each, refused where given as anything else. One
# given as null (``training:`` with nothing under it in YAML, ``--set training=null``) would replace the whole
# section with the defaults when merged over the preset; one given as another value (``--set training=[]``)
# would too, once a later ``--set training.rounds=2`` merged into it (a sweep's overrides always come after
# the user's: ``training=[]`` took the smoke preset's batch size back to the default, silently). So both are
# refused where they appear, before any merge. An empty mapping (``training: {}``) is accepted: merged over
# the preset it changes nothing, which is what it says.
SECTION_PATHS = (("data",), ("capacity",), ("model",), ("training",), ("algorithm",), ("resources",),
                 ("devices",), ("asynchronous",), ("algorithm", "options"))


def _check_sections(tree: Mapping[str, Any], where: str) -> None:
    """Refuse a section given as null or as anything but a mapping anywhere in ``tree`` (a config file, or one
    override nested). ``algorithm`` given as a string keeps its own hint (the method's name goes in
    ``algorithm.name``: :func:`apply_algorithm_defaults`)."""
    for path in SECTION_PATHS:
        node: Any = tree
        for p in path[:-1]:
            node = node.get(p) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping) or path[-1] not in node:
            continue
        value, dotted = node[path[-1]], ".".join(path)
        if value is None:
            raise ConfigError(f"invalid {dotted}=null{where}: a section cannot be null (merged over the preset it "
                              f"would silently replace all of {dotted} with the defaults); give its fields, "
                              f"e.g. {dotted}: {{...}}, or leave it out")
        if isinstance(value, str) and path == ("algorithm",):
            fail("algorithm", value, f"must be a mapping; the method is chosen with algorithm.name={value}")
        if not isinstance(value, Mapping):
            field = "algorithm" if path == ("algorithm", "options") else dotted
            raise ConfigError(f"invalid {dotted}={short(value, 60)}{where}: must be a mapping of the section's fields; "
                              f"set one with --set {field}.FIELD=VALUE")


def trace_sha256(path: str) -> str:
    """SHA-256 of a device trace file's bytes (``devices.trace_sha256``); ConfigError naming devices.trace."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        raise ConfigError(f"invalid devices.trace={path_text(path)}: no such file") from None
    except OSError as e:
        raise ConfigError(f"invalid devices.trace={path_text(path)}: cannot be read ({e.strerror or e})") from None


def build_config(
    preset: str | None = None,
    file_data: Mapping[str, Any] | None = None,
    overrides: typing.Sequence[str] = (),
    seed: int | None = None,
) -> ExperimentConfig:
    """Defaults <- preset <- config file <- ``--set`` overrides <- ``--seed``; then validate."""
    allowed = "allowed values are " + ", ".join([*PRESETS, "custom"])
    in_file = (file_data or {}).get("preset")
    if in_file is not None and (not isinstance(in_file, str) or in_file not in PRESETS and in_file != "custom"):
        fail("preset", in_file, allowed + " (the preset key of a config file chooses the preset)")
    if preset is not None and in_file is not None and in_file != preset:
        fail("preset", in_file, f"the config file asks for preset {in_file} but --preset {preset} was given; "
                                 "drop one of them")
    preset = preset or in_file or DEFAULT_PRESET
    if preset not in PRESETS and preset != "custom":
        fail("preset", preset, allowed)
    merged: dict[str, Any] = deep_merge({}, PRESETS.get(preset, {}))
    merged["preset"] = preset
    if file_data:
        _check_sections(file_data, "")
        merged = deep_merge(merged, file_data)
    for text in overrides:
        path, value = parse_override(text)
        _check_sections(_nest(path, value), f" (--set {clip(text, 60)})")
        if path[0] == "preset":  # the recorded preset must be the one the config was built from
            fail("--set preset", value, "the preset is chosen with --preset NAME (or preset: NAME in a config file), "
                                         "before the overrides; " + allowed)
        if path[0] == "algorithm" and len(path) >= 2 and path[1] not in ("name", "options"):
            path = ["algorithm", "options", *path[1:]]  # --set algorithm.mu=0.01 is an option
        merged = deep_merge(merged, _nest(path, value))
    if seed is not None:
        merged["seed"] = seed
    cfg = from_dict(apply_algorithm_defaults(merged))
    if cfg.devices.trace is not None and cfg.devices.trace_sha256 is None:
        # the trace's content is part of the run's identity (the config hash): a resume re-reads the
        # recorded hash from the stored config and the run start compares it with the file (fedsap_ray.limits)
        import dataclasses

        cfg = dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices,
                                                                   trace_sha256=trace_sha256(cfg.devices.trace)))
    return cfg


def preset_option_defaults(preset: Any) -> dict[str, dict[str, Any]]:
    """Per algorithm, the option defaults it declares for ``preset`` (``Strategy.preset_options``: a method
    scales its own schedules, e.g. a warm-up, to a preset's round budget; the config names no method)."""
    from fedsap_ray.config.registry import STRATEGIES  # late: finding the strategies loads them (and torch)

    return {name: dict(STRATEGIES.get(name).preset_options.get(preset, {})) for name in STRATEGIES.names()}


def apply_algorithm_defaults(merged: dict[str, Any]) -> dict[str, Any]:
    """The chosen algorithm's option defaults for the preset (:func:`preset_option_defaults`) go beneath the
    user's options, so they never make the options invalid for another algorithm."""
    merged = dict(merged)
    defaults = preset_option_defaults(merged.get("preset"))
    raw = merged.get("algorithm") or {}
    if isinstance(raw, str):  # --set algorithm=fedprox: the user meant the method's name
        fail("algorithm", raw, f"must be a mapping; the method is chosen with algorithm.name={raw}")
    if not isinstance(raw, Mapping):
        return merged  # a bad value, which the schema names
    algo = dict(raw)
    name = algo.get("name", AlgorithmConfig.name)
    options = algo.get("options") or {}
    if isinstance(name, str) and name in defaults and isinstance(options, Mapping):
        algo["options"] = {**defaults[name], **dict(options)}
        merged["algorithm"] = algo
    return merged


def from_dict(d: Mapping[str, Any]) -> ExperimentConfig:
    """The validated config tree (the algorithm's typed options included: ``cfg.algorithm.opts``)."""
    return construct(ExperimentConfig, d, "")


def _construct(cls: type, d: Any, prefix: str) -> Any:
    """A config node (any section) from a plain mapping (the schema's :func:`construct`; kept for callers)."""
    return construct(cls, d, prefix)
