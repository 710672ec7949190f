"""Assembling an experiment config: defaults <- preset <- file <- ``--set`` overrides <- ``--seed``.

The config is one frozen dataclass tree, the single source of truth for a run; its types and
field checks are :mod:`fedsap_ray.config.schema` and :mod:`fedsap_ray.config.checks` (every public name is
re-exported by :mod:`fedsap_ray.config`). This module loads it from YAML/JSON
and from ``--set a.b=value`` overrides and validates it *before any work*: every error is a
:class:`ConfigError` whose message names the field, the offending value and what is allowed, so
the CLI can print one line and exit with code 2.

Presets (``smoke``, ``laptop``, ``paper``, ...: :mod:`fedsap_ray.config.presets`) are plain nested dicts applied
on top of the defaults; algorithm-specific options (e.g. FedProx ``mu``) live in ``algorithm.options`` and are
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
from fedsap_ray.config.checks import clip, fail, path_text, short
from fedsap_ray.config.coerce import construct
from fedsap_ray.config.presets import DEFAULT_PRESET, PRESETS, deep_merge
from fedsap_ray.config.schema import AlgorithmConfig, ExperimentConfig

__all__ = ["MAX_YAML_NODES", "apply_algorithm_defaults", "build_config", "from_dict", "load_file", "parse_override",
           "preset_option_defaults", "trace_sha256"]


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
        # recorded hash from the stored config and the run start compares it with the file (fedsap_ray.runtime.limits)
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
    """A config node (any section) from a plain mapping (:func:`fedsap_ray.config.coerce.construct`; kept for callers)."""
    return construct(cls, d, prefix)
