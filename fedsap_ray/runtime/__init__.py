"""Backends: ``local`` (in-process) and, in :mod:`fedsap_ray.runtime.ray`, Ray actors.

Only this package (and ``sweeps/``) may import Ray.
"""
from __future__ import annotations

from fedsap_ray.config import ConfigError, ExperimentConfig


def make_backend(cfg: ExperimentConfig):
    r = cfg.resources
    if r.backend == "local":
        from fedsap_ray.runtime.local import LocalBackend

        return LocalBackend(device=r.device, num_workers=r.num_workers, torch_threads=r.torch_threads)
    try:
        from fedsap_ray.runtime.ray import RayBackend  # type: ignore[import-not-found]
    except ImportError as e:
        raise ConfigError(f"invalid resources.backend={r.backend!r}: the Ray backend is not available "
                          f"in this version ({e}); allowed values are local") from e
    return RayBackend(cfg)
