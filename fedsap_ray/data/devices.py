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

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.checks import DEVICE_RANGES, clip, path_text, short
from fedsap_ray.config.device_config import DevicesConfig
from fedsap_ray.config.schema import ExperimentConfig
from fedsap_ray.common.seeding import rng_for

TRACE_COLUMNS = ("client_id", "speed")  # required
TRACE_OPTIONAL = ("down_bytes_s", "up_bytes_s", "availability")  # optional; no other column is accepted
# the range of each numeric column: those of the config's constants (checks.DEVICE_RANGES), availability in (0, 1]
TRACE_RANGES: dict[str, tuple[float, float]] = {
    "speed": DEVICE_RANGES["speed_full"], "down_bytes_s": DEVICE_RANGES["down_bytes_s"],
    "up_bytes_s": DEVICE_RANGES["up_bytes_s"]}
MIN_SPEED = DEVICE_RANGES["speed_full"][0]  # MACs/s: a device's speed (speed_full x capacity, or a trace's) at least


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
    traced = read_trace(d, len(capacities)) if d.trace is not None else {}
    for cid, dev in traced.items():
        out[cid] = dev
    for cid, dev in enumerate(out):
        if cid not in traced and not dev.speed >= MIN_SPEED:  # a capacity so small the time would not be finite
            raise ConfigError(f"invalid devices.speed_full={d.speed_full:g}: client {cid} has capacity "
                              f"{capacities[cid]:g}, a speed of {dev.speed:g} MACs/s; every device needs at least "
                              f"{MIN_SPEED:g} MACs/s (raise devices.speed_full or the capacity, or give a trace)")
    return out


def read_trace(d: DevicesConfig, n_clients: int) -> Mapping[int, Device]:
    """``devices.trace`` read and checked strictly; with ``devices.trace_sha256`` recorded, the file must
    still hold the bytes that hash was made from (the run's identity: fedsap_ray.config.trace_sha256)."""
    assert d.trace is not None
    return _read_trace(d.trace, d, n_clients)


def _bad(path: str, what: str) -> ConfigError:
    return ConfigError(f"invalid devices.trace={path_text(path)}: {what}")


def _number(v: object) -> float | None:
    """A trace cell as a float, or None when it is no number (a string, a bool, a missing cell)."""
    import numpy as np

    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        return None
    f = float(v)
    return f if not math.isnan(f) else None


def _read_trace(path: str, d: DevicesConfig, n_clients: int) -> Mapping[int, Device]:
    """The trace's devices by client id; every refusal is a ConfigError naming devices.trace, the file,
    and the row (1-based, after the header) and column at fault. Strict: only the known columns;
    ``client_id`` an integer (a float column's 2.0 is client 2; 1.7 is refused) in [0, n_clients), each id
    once; every speed and bandwidth a number in the config's range (finite, > 0); availability in (0, 1]."""
    import io

    import pandas as pd

    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise _bad(path, "no such file") from None
    except OSError as e:
        raise _bad(path, f"cannot be read ({e.strerror or e})") from None
    if d.trace_sha256 is not None:
        import hashlib

        now = hashlib.sha256(raw).hexdigest()
        if now != d.trace_sha256:
            raise _bad(path, f"the file changed since the run's config was made (sha256 {d.trace_sha256[:12]}... "
                             f"recorded in devices.trace_sha256, now {now[:12]}...): a run's times come from the "
                             "trace it started with; restore that file, or start a new run")
    try:
        df = pd.read_parquet(io.BytesIO(raw)) if p.suffix == ".parquet" else pd.read_csv(io.BytesIO(raw))
    except Exception as e:  # a file pandas cannot parse
        raise _bad(path, f"cannot be read ({e.__class__.__name__}: {clip(str(e), 120)})") from None
    known = (*TRACE_COLUMNS, *TRACE_OPTIONAL)
    for c in df.columns:
        if c not in known:
            raise _bad(path, f"unknown column {short(c, 40)}; the columns are {', '.join(TRACE_COLUMNS)} (required) "
                             f"and {', '.join(TRACE_OPTIONAL)} (optional)")
    missing = [c for c in TRACE_COLUMNS if c not in df.columns]
    if missing:
        raise _bad(path, f"needs the columns {', '.join(TRACE_COLUMNS)} (missing {', '.join(missing)}); "
                         f"optional: {', '.join(TRACE_OPTIONAL)}")
    if len(df) == 0:
        raise _bad(path, "has no rows; list at least one client, or leave devices.trace null")
    defaults = {"down_bytes_s": d.down_bytes_s, "up_bytes_s": d.up_bytes_s, "availability": d.availability}
    out: dict[int, Device] = {}
    rows: dict[int, int] = {}
    for i, row in enumerate(df.to_dict("records"), start=1):
        cid_f = _number(row["client_id"])
        if cid_f is None or not math.isfinite(cid_f) or not cid_f.is_integer():
            raise _bad(path, f"row {i}: client_id {short(row['client_id'], 40)} is not an integer")
        cid = int(cid_f)
        if not 0 <= cid < n_clients:
            raise _bad(path, f"row {i}: client_id {cid} is not one of the {n_clients} clients (0..{n_clients - 1})")
        if cid in rows:
            raise _bad(path, f"row {i}: client_id {cid} again (first in row {rows[cid]}); each client at most once")
        vals: dict[str, float] = {}
        for col in ("speed", *TRACE_OPTIONAL):
            if col not in row:
                vals[col] = float(defaults[col])
                continue
            v = _number(row[col])
            if col == "availability":
                ok, allowed = v is not None and 0 < v <= 1, "a number in (0, 1]"
            else:
                low, high = TRACE_RANGES[col]
                ok, allowed = v is not None and low <= v <= high, f"a number in [{low:g}, {high:g}]"
            if not ok:
                raise _bad(path, f"row {i} (client {cid}): {col} {short(row[col], 40)} must be {allowed}")
            vals[col] = float(v)  # type: ignore[arg-type]  # ok: v is a number here
        rows[cid] = i
        out[cid] = Device(vals["speed"], vals["down_bytes_s"], vals["up_bytes_s"], vals["availability"])
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
        self.devices = list(devices)  # devices_for's list (the strategy's, Sampler.devices)
        self.k = round_size(cfg, len(self.devices))  # the clients a round aggregates under over_select

    def round(self, t: int, costs: Mapping[int, tuple[int, int, int]]) -> SimRound:
        """``costs``: client -> (train_macs, bytes_down, bytes_up) of each client that trained in round ``t``."""
        times = {c: client_time(self.cfg, self.devices[c], t, c, *cost) for c, cost in costs.items()}
        kept, round_s = admit(self.cfg, times, self.k)
        return SimRound(times, frozenset(set(times) - kept), round_s)


def empty_round(cfg: ExperimentConfig, devices: Sequence[Device], rounds: range) -> int | None:
    """The first round of ``rounds`` in which no client is available (:func:`available`), or None.

    Checked before a run trains anything (:class:`fedsap_ray.run.session.RunSession`), so a low availability
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
