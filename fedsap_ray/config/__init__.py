"""The experiment config: one frozen, validated dataclass tree, its presets, files and overrides, and the registries its names come from.

May import: common.

Everything a user imports from ``fedsap_ray.config`` (the config's types, ``build_config``, the presets, the
file reader) is re-exported here, so scripts and notebooks need not know which module of the folder holds
it; inside the package a module imports the precise module.
"""
from fedsap_ray.config.build import (BACKENDS, CAPACITY_SCHEMES, DEFAULT_PRESET, DEVICES, INT64_MAX, MAX_YAML_NODES,
                                     PARTITIONS, PRESET_NOTES, PRESETS, SEED_ALLOWED, SEED_MAX, SUBMODELS, AlgorithmConfig,
                                     CapacityConfig, ConfigError, DataConfig, ExperimentConfig, ModelConfig,
                                     ResourcesConfig, TrainingConfig, apply_algorithm_defaults, build_config, deep_merge,
                                     from_dict, load_file, parse_override)

__all__ = [
    "BACKENDS", "CAPACITY_SCHEMES", "DEVICES", "INT64_MAX", "PARTITIONS", "SEED_ALLOWED",
    "SEED_MAX", "SUBMODELS", "AlgorithmConfig", "CapacityConfig", "ConfigError", "DataConfig", "ExperimentConfig", "ModelConfig",
    "ResourcesConfig", "TrainingConfig", "PRESETS", "PRESET_NOTES", "DEFAULT_PRESET", "build_config", "from_dict",
    "load_file", "parse_override", "deep_merge", "apply_algorithm_defaults", "MAX_YAML_NODES",
]
