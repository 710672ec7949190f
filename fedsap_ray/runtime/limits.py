"""What a run's resource settings and input files may ask of the machine it starts on (issue 40),
checked when the run starts, before any work and before anything is written.

The config itself stays portable (the frozen schema checks only what holds on every machine): the
bounds here depend on where the run starts, so they are checked by :func:`check_resources`, which
:func:`fedsap_ray.experiment.run_experiment` calls next to :func:`fedsap_ray.run.guard.check_device`, and,
for the Ray backend, by :func:`check_cluster_resources` from
:func:`fedsap_ray.runtime.ray.check_cluster` once the cluster is known. Each refusal is a
:class:`~fedsap_ray.common.errors.ConfigError` naming the field, the value and the limit (exit code 2).
No Ray and no torch here.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.schema import ExperimentConfig


def machine_cpus() -> int:
    """The CPU count the local backend plans with (:func:`fedsap_ray.engine.client.default_workers` uses the same)."""
    return os.cpu_count() or 1


def check_resources(cfg: ExperimentConfig) -> None:
    """On the machine the run starts on: the local backend's threads and workers fit its CPUs, and a
    device trace is valid and unchanged since the config was made (:func:`check_trace`)."""
    r = cfg.resources
    if r.backend == "local":
        cpus = machine_cpus()
        # Intra-op threads past the core count only oversubscribe the cores (torch starts them all),
        # and each concurrent client (a thread of this process) holds its own copy of the model:
        # more of them than cores cannot train faster, only exhaust memory (10**6 did).
        if r.torch_threads > cpus:
            raise ConfigError(f"invalid resources.torch_threads={r.torch_threads}: this machine has {cpus} CPUs; "
                              f"use at most {cpus} (1 is the default, and part of the numerics)")
        if r.num_workers is not None and r.num_workers > cpus:
            raise ConfigError(f"invalid resources.num_workers={r.num_workers}: the local backend trains at most one "
                              f"client per CPU at a time, and this machine has {cpus} CPUs; use at most {cpus}, "
                              "or null (CPU count / torch_threads)")
    check_trace(cfg)


def check_cluster_resources(cfg: ExperimentConfig, num_clients: int, cluster: Mapping[str, float]) -> None:
    """On the Ray driver, with the cluster's resources (``ray.cluster_resources()``): explicit workers at
    most one per client (each further one would hold a copy of the data and never train), and the
    intra-op threads of one worker at most the cluster's CPUs. Workers beyond what the cluster has now
    stay legal: an autoscaling cluster adds nodes for them (docs/guides/cluster.md)."""
    r = cfg.resources
    if r.num_workers is not None and r.num_workers > num_clients:
        raise ConfigError(f"invalid resources.num_workers={r.num_workers}: the federation has {num_clients} clients "
                          f"and a worker trains one at a time; use at most {num_clients}, or null")
    cpus = cluster.get("CPU", 0.0)
    if r.torch_threads > max(cpus, 1.0):
        raise ConfigError(f"invalid resources.torch_threads={r.torch_threads}: the Ray cluster has {cpus:g} CPUs; "
                          f"use at most {max(int(cpus), 1)}")


def check_trace(cfg: ExperimentConfig) -> None:
    """``devices.trace`` read and checked strictly against the federation's ``data.num_clients`` clients,
    its bytes against ``devices.trace_sha256`` (refused if the file changed since the config was made)."""
    if cfg.devices.trace is None:
        return
    from fedsap_ray.data.devices import read_trace  # pandas: only when there is a trace

    read_trace(cfg.devices, cfg.data.num_clients)
