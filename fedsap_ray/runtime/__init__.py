"""Where clients train and a session is hosted: ``local`` (in-process threads) or ``ray`` (actors); resource limits.

May import: common, config, models, data, algorithms, engine, run.

Only this package (and ``sweeps/``) may import Ray (:mod:`fedsap_ray.runtime.ray`), and only when the Ray backend
is used; ``limits`` checks resources and traces against the machine and the federation before any work.
"""
from __future__ import annotations

from fedsap_ray.config.schema import ExperimentConfig


def make_backend(cfg: ExperimentConfig):
    """The client backend for ``cfg`` (for Ray this is the pool the ServerActor drives)."""
    r = cfg.resources
    if r.backend == "ray":
        from fedsap_ray.runtime.ray import RayWorkerPool

        return RayWorkerPool(cfg)
    from fedsap_ray.runtime.local import LocalBackend

    return LocalBackend(device=r.device, num_workers=r.num_workers, torch_threads=r.torch_threads, compile=r.compile)
