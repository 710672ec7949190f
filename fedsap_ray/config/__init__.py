"""The experiment config: one frozen, validated dataclass tree, its presets, files and overrides, and the registries its names come from.

May import: common.

Everything a user imports from ``fedsap_ray.config`` (the config's types, ``build_config``, the presets, the
file reader) is re-exported here, so scripts and notebooks need not know which module of the folder holds
it; inside the package a module imports the precise module.
"""
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.build import (MAX_YAML_NODES, apply_algorithm_defaults, build_config, from_dict, load_file,
                                     parse_override)
from fedsap_ray.config.checks import BACKENDS, CAPACITY_SCHEMES, COMPILE_MODES, DEVICES, PARTITIONS, SEED_ALLOWED, SEED_MAX, SUBMODELS
from fedsap_ray.config.coerce import INT64_MAX
from fedsap_ray.config.presets import DEFAULT_PRESET, PRESET_NOTES, PRESETS, deep_merge
from fedsap_ray.config.schema import (AlgorithmConfig, CapacityConfig, DataConfig, ExperimentConfig, ModelConfig,
                                      ResourcesConfig, TrainingConfig)

__all__ = [
    "BACKENDS", "CAPACITY_SCHEMES", "COMPILE_MODES", "DEVICES", "INT64_MAX", "PARTITIONS", "SEED_ALLOWED",
    "SEED_MAX", "SUBMODELS", "AlgorithmConfig", "CapacityConfig", "ConfigError", "DataConfig", "ExperimentConfig", "ModelConfig",
    "ResourcesConfig", "TrainingConfig", "PRESETS", "PRESET_NOTES", "DEFAULT_PRESET", "build_config", "from_dict",
    "load_file", "parse_override", "deep_merge", "apply_algorithm_defaults", "MAX_YAML_NODES",
]
