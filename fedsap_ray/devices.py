"""Simulated device time (issue 28; docs/guides/device-time.md): what a client-round would take on the
client's device, and which clients a round waits for.

A device has a compute speed (MACs/s) and download/upload bandwidths (bytes/s). By default they come
from the client's capacity (``devices.speed_full * capacity``; the same bandwidths for every device),
or from a trace file (``devices.trace``). A client-round takes

    sim_time_s = (1 + backward_factor) * train_macs / speed + bytes_down / down + bytes_up / up

where ``train_macs`` is the forward multiply-accumulates the client executed (``clients.train_macs``,
:meth:`Strategy.train_macs`; the backward pass is counted as ``backward_factor`` times the forward, 2
by default: the usual estimate of a backward pass, which computes the gradients of both inputs and
weights), and the bytes are those it was sent and sent back (``clients.bytes_down``, ``bytes_up``).
With ``devices.jitter`` > 0 the speed of each client-round is multiplied by a lognormal factor (median
1) seeded by (run seed, round, client), so every time here is a pure function of (config, seed,
round, client) and what the client reported: the same on every backend and across a resume.

Policies (``devices.policy``): ``wait_all`` (a round lasts as long as its slowest client; nothing else
changes), ``deadline`` (a client past ``deadline_s`` is a straggler: left out of aggregation, its compute
still counted; the round lasts ``deadline_s`` if anyone missed it, else its slowest client) and
``over_select`` (``ceil(k * (1 + over_select))`` clients are sampled and the ``k`` that finish first, ties
by client id, are aggregated; the round lasts until the ``k``-th). Availability: a client can be
selected in a round with probability ``availability`` (its trace value, else ``devices.availability``),
seeded by (run seed, round, client).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedsap_ray.errors import ConfigError
from fedsap_ray.schema import DevicesConfig, ExperimentConfig
from fedsap_ray.seeding import rng_for

TRACE_COLUMNS = ("client_id", "speed")  # required; optional: down_bytes_s, up_bytes_s, availability


@dataclass(frozen=True)
class Device:
    speed: float  # MACs/s
    down: float  # bytes/s
    up: float  # bytes/s
    availability: float  # probability of being selectable in a round


def devices_for(cfg: ExperimentConfig, capacities: Sequence[float]) -> list[Device]:
    """Every client's device: from ``devices.trace`` for the clients it lists, else from its capacity."""
    d = cfg.devices
    out = [Device(d.speed_full * float(c), d.down_bytes_s, d.up_bytes_s, d.availability) for c in capacities]
    if d.trace is not None:
        for cid, dev in _read_trace(d.trace, d, len(capacities)).items():
            out[cid] = dev
    return out


def _read_trace(path: str, d: DevicesConfig, n_clients: int) -> Mapping[int, Device]:
    """The trace's devices by client id; bad files and values raise ConfigError naming devices.trace."""
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"invalid devices.trace={path!r}: no such file")
    try:
        df = pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p)
    except Exception as e:  # a file pandas cannot parse
        raise ConfigError(f"invalid devices.trace={path!r}: cannot be read ({e.__class__.__name__}: {e})") from None
    missing = [c for c in TRACE_COLUMNS if c not in df.columns]
    if missing:
        raise ConfigError(f"invalid devices.trace={path!r}: needs the columns {', '.join(TRACE_COLUMNS)} "
                          f"(missing {', '.join(missing)}); optional: down_bytes_s, up_bytes_s, availability")
    out: dict[int, Device] = {}
    for row in df.itertuples(index=False):
        cid = int(row.client_id)
        dev = Device(float(row.speed), float(getattr(row, "down_bytes_s", d.down_bytes_s)),
                     float(getattr(row, "up_bytes_s", d.up_bytes_s)), float(getattr(row, "availability", d.availability)))
        if not 0 <= cid < n_clients:
            raise ConfigError(f"invalid devices.trace={path!r}: client_id {cid} is not one of the "
                              f"{n_clients} clients (0..{n_clients - 1})")
        if not (dev.speed > 0 and dev.down > 0 and dev.up > 0 and math.isfinite(dev.speed + dev.down + dev.up)
                and 0 < dev.availability <= 1):
            raise ConfigError(f"invalid devices.trace={path!r}: client {cid} needs speed, down_bytes_s, up_bytes_s "
                              f"> 0 and availability in (0, 1], got {dev}")
        out[cid] = dev
    return out


def client_time(cfg: ExperimentConfig, device: Device, t: int, client_id: int, train_macs: int,
                bytes_down: int, bytes_up: int) -> float:
    """Simulated seconds of one client-round (module docstring's formula)."""
    d = cfg.devices
    speed = device.speed
    if d.jitter > 0:
        speed *= float(rng_for(cfg.seed, t, client_id, "device-jitter").lognormal(0.0, d.jitter))
    return (1.0 + d.backward_factor) * train_macs / speed + bytes_down / device.down + bytes_up / device.up


def available(cfg: ExperimentConfig, devices: Sequence[Device], t: int) -> list[int]:
    """The clients selectable in round ``t`` (all of them when every availability is 1)."""
    return [i for i, dev in enumerate(devices) if _available(cfg, dev, t, i)]


def _available(cfg: ExperimentConfig, dev: Device, t: int, i: int) -> bool:
    """Whether client ``i`` can be selected in round ``t`` (one seeded draw against its availability)."""
    return dev.availability >= 1 or rng_for(cfg.seed, t, i, "device-available").random() < dev.availability


def round_size(cfg: ExperimentConfig, n_clients: int) -> int:
    """``k``: the clients a round samples (and, under over_select, aggregates): round(participation * N), >= 1."""
    return max(1, int(round(cfg.training.participation * n_clients)))


def selection_size(cfg: ExperimentConfig, k: int) -> int:
    """Clients to sample when ``k`` are to be aggregated: ``ceil(k * (1 + over_select))`` under over_select."""
    if cfg.devices.policy == "over_select":
        return math.ceil(k * (1.0 + cfg.devices.over_select) - 1e-9)
    return k


def admit(cfg: ExperimentConfig, times: Mapping[int, float], k: int) -> tuple[set[int], float]:
    """(clients aggregated, the round's simulated seconds) under ``devices.policy``, from each trained
    client's simulated time; ``k`` is the number to aggregate under over_select."""
    if not times:
        return set(), 0.0
    policy = cfg.devices.policy
    if policy == "deadline":
        deadline = float(cfg.devices.deadline_s)  # type: ignore[arg-type]  # the schema requires it here
        kept = {c for c, s in times.items() if s <= deadline}
        return kept, deadline if len(kept) < len(times) else max(times.values())
    if policy == "over_select":
        order = sorted(times, key=lambda c: (times[c], c))[:max(1, k)]
        return set(order), times[order[-1]]
    return set(times), max(times.values())


@dataclass(frozen=True)
class SimRound:
    """One round's simulated device time: each trained client's seconds, the stragglers (trained, not
    aggregated) and the round's seconds under the policy."""

    client_s: Mapping[int, float]
    stragglers: frozenset[int]
    round_s: float


class DeviceClock:
    """The run's devices and the policy applied to a round's results (pure: no state across rounds; the
    elapsed time is the recorder's, so it is checkpointed with the other running metrics)."""

    def __init__(self, cfg: ExperimentConfig, devices: Sequence[Device]) -> None:
        self.cfg = cfg
        self.devices = list(devices)  # devices_for's list (the strategy's, Strategy.devices)
        self.k = round_size(cfg, len(self.devices))  # the clients a round aggregates under over_select

    def round(self, t: int, costs: Mapping[int, tuple[int, int, int]]) -> SimRound:
        """``costs``: client -> (train_macs, bytes_down, bytes_up) of each client that trained in round ``t``."""
        times = {c: client_time(self.cfg, self.devices[c], t, c, *cost) for c, cost in costs.items()}
        kept, round_s = admit(self.cfg, times, self.k)
        return SimRound(times, frozenset(set(times) - kept), round_s)


def empty_round(cfg: ExperimentConfig, devices: Sequence[Device], rounds: range) -> int | None:
    """The first round of ``rounds`` in which no client is available (:func:`available`), or None.

    Checked before a run trains anything (:class:`fedsap_ray.session.RunSession`), so a low availability
    fails with exit 2 before round 1 rather than in the round it empties. Cheap: each round stops at its
    first available client (about 1 / availability draws); only an empty round draws for every client.
    """
    if all(dev.availability >= 1 for dev in devices):
        return None
    for t in rounds:
        if not any(_available(cfg, dev, t, i) for i, dev in enumerate(devices)):
            return t
    return None


def no_client_error(cfg: ExperimentConfig, t: int) -> ConfigError:
    """The refusal of a round ``t`` that no client is available in (one line, exit 2)."""
    return ConfigError(f"invalid devices.availability={cfg.devices.availability}: no client is available in round {t}; "
                       "raise the availability (or the trace's) or add clients")
