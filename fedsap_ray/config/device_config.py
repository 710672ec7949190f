"""The config sections of simulated device time: each client's device (``devices``) and the asynchronous engine
(``asynchronous``). The checks across sections that the asynchronous mode needs read the whole config
(:func:`fedsap_ray.config.schema.check_async`).

Apart from the sections every run reads (:mod:`fedsap_ray.config.schema`), because only device-time runs read
most of these fields, and their defaults leave a run's hash as it was before they existed.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from fedsap_ray.config.checks import (DEVICE_MODES, DEVICE_POLICIES, DEVICE_RANGE_WHY, DEVICE_RANGES, STALENESS_RULES,
                                      check_choice, check_positive, check_ratio, fail, is_number)


@dataclass(frozen=True)
class DevicesConfig:
    """Simulated device time (docs/guides/device-time.md): each client's compute speed and bandwidths, and
    what a round waits for. Only ``policy`` other than ``wait_all`` and ``availability`` below 1 change
    which clients train or are aggregated; the rest only adds the ``sim_*`` columns."""

    # MACs/s of a device of capacity 1 (keep ratio 1); a client's speed is this times its capacity, so a
    # keep-0.2 device takes as long for a 0.2-wide sub-model as a full device for the full model.
    # An assumption (about a mid-range phone CPU on float32 convolutions), not a measurement: set your own.
    # In [1, 1e18] MACs/s (and speed_full x capacity must be >= 1), so every simulated time is finite and > 0.
    speed_full: float = 20e9
    # download bandwidth of every device, bytes/s (20 Mbit/s; an assumption); in [1, 1e15]
    down_bytes_s: float = 2.5e6
    # upload bandwidth of every device, bytes/s (5 Mbit/s; an assumption); in [1, 1e15]
    up_bytes_s: float = 0.625e6
    # backward pass MACs per forward MAC: train_macs counts forward passes only (Strategy.train_macs); in [0, 1000]
    backward_factor: float = 2.0
    # sigma of a seeded lognormal factor on each client-round's speed (0: off); median 1; in [0, 4] (the
    # factor exp(sigma * z) then stays finite and non-zero for every normal draw z)
    jitter: float = 0.0
    # wait_all: a round lasts until its slowest client (today's numbers); deadline: clients slower than
    # deadline_s are stragglers, left out of aggregation (their compute still counted); over_select:
    # ceil(k * (1 + over_select)) clients are sampled and the k that finish first are aggregated
    policy: str = "wait_all"
    deadline_s: float | None = None  # seconds; needed by policy=deadline
    # extra fraction sampled under policy=over_select; in [0, 1000] (the sample is capped at the available clients)
    over_select: float = 0.3
    # probability that a client can be selected in a round (seeded per round and client); 1: always
    availability: float = 1.0
    # CSV or Parquet with client_id, speed (MACs/s) and optionally down_bytes_s, up_bytes_s, availability:
    # replaces the capacity mapping (and the constants above) for the clients it lists. Checked strictly
    # (docs/guides/device-time.md): only those columns, integer client ids of the federation, each once,
    # values in the ranges above
    trace: str | None = None
    # SHA-256 of the trace file's bytes, recorded when the config is built (never set it by hand): part of
    # the config hash, so a run refuses to start or resume on a trace edited since
    trace_sha256: str | None = None
    # sync: synchronous rounds under devices.policy; async: asynchronous training on the simulated clock
    # (FedBuff, Nguyen et al. 2022), a rounds row per server step, settings in the asynchronous section
    # (docs/guides/device-time.md#asynchronous-training)
    mode: str = "sync"

    def __post_init__(self) -> None:
        check_choice("devices.mode", self.mode, DEVICE_MODES)
        for f, (low, high) in DEVICE_RANGES.items():
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high):  # NaN: False
                why = DEVICE_RANGE_WHY if f != "over_select" else "so that the sample ceil(k * (1 + over_select)) is finite"
                fail(f"devices.{f}", v, f"must be a number in [{low:g}, {high:g}] ({why})")
        check_choice("devices.policy", self.policy, DEVICE_POLICIES)
        if self.deadline_s is not None:
            check_positive("devices.deadline_s", self.deadline_s)
        if self.policy == "deadline" and self.deadline_s is None:
            fail("devices.deadline_s", None, "must be a number of seconds > 0 with devices.policy=deadline")
        check_ratio("devices.availability", self.availability, low_open=True)
        if self.trace is not None and not str(self.trace).endswith((".csv", ".parquet")):
            fail("devices.trace", self.trace, "must be a .csv or .parquet file")
        if self.trace_sha256 is not None:
            if not isinstance(self.trace_sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", self.trace_sha256):
                fail("devices.trace_sha256", self.trace_sha256, "must be 64 lowercase hex digits (recorded by the "
                                                                 "config builder from the trace file)")
            if self.trace is None:
                fail("devices.trace_sha256", self.trace_sha256, "is the hash of devices.trace, which is not set")


@dataclass(frozen=True)
class AsyncConfig:
    """Asynchronous training on the simulated device clock (``devices.mode=async``; docs/guides/device-time.md):
    ``concurrency`` clients train at once, each finishing at its simulated time; the server applies the
    buffered updates as deltas every ``buffer_size`` arrivals (FedBuff, Nguyen et al. 2022, Algorithm 1;
    ``buffer_size=1`` is FedAsync, Xie et al. 2019), each weighted by a function of its staleness. One
    ``training.rounds`` is one server step; ``training.eval_every`` counts server steps, unless
    ``eval_every_s`` times the evaluation on the simulated clock. Only read with ``devices.mode=async`` (a
    field set otherwise is refused)."""

    # clients training at once; null: round(training.participation x data.num_clients), a synchronous round's clients
    concurrency: int | None = None
    # arrivals per server step (FedBuff's K); null: concurrency; 1: FedAsync
    buffer_size: int | None = None
    # weight of an update of staleness s: constant 1, polynomial (1 + s)^-a, hinge 1 if s <= b else 1/(a(s - b) + 1)
    # (FedAsync, Xie et al. 2019, section 5.2)
    staleness: str = "constant"
    # a of the polynomial and hinge rules; null: FedAsync's experimental values, 0.5 (polynomial), 10 (hinge)
    staleness_a: float | None = None
    # b of the hinge rule (staleness steps before the weight falls); FedAsync's experiments use 4
    staleness_b: float = 4.0
    # server learning rate eta_g: the step moves the model by eta_g x the weighted mean delta (FedBuff Alg. 1)
    server_lr: float = 1.0
    # updates staler than this many server steps are discarded (clients.straggler); null: none is discarded
    max_staleness: int | None = None
    # evaluate every this many simulated seconds instead of every training.eval_every steps: at the first step
    # whose rounds.sim_elapsed_s reaches each multiple (once, however many multiples the step passes) and at the
    # last step; training.deployed_every then counts these periods. null: by steps (training.eval_every)
    eval_every_s: float | None = None

    def __post_init__(self) -> None:
        for f in ("concurrency", "buffer_size"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                fail(f"asynchronous.{f}", v, "must be null or an integer >= 1")
        check_choice("asynchronous.staleness", self.staleness, STALENESS_RULES)
        if self.staleness_a is not None:
            check_positive("asynchronous.staleness_a", self.staleness_a)
        check_positive("asynchronous.staleness_b", self.staleness_b, allow_zero=True)
        check_positive("asynchronous.server_lr", self.server_lr)
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int)
                                               or isinstance(self.max_staleness, bool) or self.max_staleness < 0):
            fail("asynchronous.max_staleness", self.max_staleness, "must be null or an integer >= 0")
        if self.eval_every_s is not None and not (is_number(self.eval_every_s) and math.isfinite(self.eval_every_s)
                                                  and self.eval_every_s > 0):
            fail("asynchronous.eval_every_s", self.eval_every_s, "must be null or a positive finite number of "
                                                                  "simulated seconds")
