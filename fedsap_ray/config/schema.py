"""The experiment config's schema: one frozen, validated dataclass tree, and the strict coercion that
builds it (and every strategy's options) from plain mappings.

This is the bottom of the config layer: data, models, algorithms and backends import their config
types from here. Assembling a config (presets, YAML, ``--set`` overrides) is
:mod:`fedsap_ray.config`; every name here is also importable from there. Names that are registered
(``data.name``, ``model.name``, ``algorithm.name``) are checked against their registry
(:mod:`fedsap_ray.config.registry`, which imports nothing heavy and loads the registering package on first
use), and ``algorithm.options`` becomes the strategy's typed ``Options`` here, once. Every error is a
:class:`~fedsap_ray.common.errors.ConfigError` whose message names the field, the offending value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import numbers
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

from fedsap_ray.config import registry
from fedsap_ray.common.errors import ConfigError


SHORT_VALUE = 80  # characters of an offending value an error line quotes, at most


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    # a few levels and items of a container, a prefix of a long string or number: never the whole value
    # (a YAML alias bomb or a megabyte of --set text must not become a gigabyte error line)
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset, r.maxfrozenset, r.maxdeque, r.maxarray = 3, 6, 12, 12, 6, 6, 6, 6
    r.maxstring, r.maxlong, r.maxother = SHORT_VALUE, SHORT_VALUE, SHORT_VALUE
    return r


_SHORT = _short_repr()


def short(value: Any, limit: int = SHORT_VALUE) -> str:
    """``repr(value)`` for an error line, cut to at most ``limit`` characters without ever building the
    whole repr of a huge or deeply nested value (:mod:`reprlib`); what was cut ends in ``...``."""
    try:
        text = _SHORT.repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit for str(); a pathological object
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())  # one line, whatever the value holds
    return text if len(text) <= limit else text[:limit - 3] + "..."


def clip(text: str, limit: int = SHORT_VALUE) -> str:
    """``text`` unquoted on one line, cut to at most ``limit`` characters (ending in ``...`` when cut)."""
    text = " ".join(text[:limit * 4].split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def path_text(path: Any) -> str:
    """A file path as an error line quotes it: whole (a user must find the file; temporary and cluster paths
    are long), only cut past 1,024 characters, on one line."""
    text = repr(str(path)[:2048])
    return " ".join(text.split()) if len(text) <= 1024 else text[:1021] + "..."


def key_text(k: Any) -> str:
    """A mapping key as an error names it: as written when it is a plain word, else quoted (and short)."""
    return k if isinstance(k, str) and re.fullmatch(r"[A-Za-z0-9_]{1,60}", k) else short(k, 60)


# ----------------------------------------------------------------------------- checks
# The one place for the checks behind every "invalid FIELD=VALUE: ALLOWED" line: the sections below and
# every strategy's ``Options`` (fedsap_ray/algorithms) use them, so one kind of value is refused in one
# wording. ``name`` is the field as the user writes it (``training.lr``, ``algorithm.mu``).

def fail(name: str, value: Any, allowed: str) -> typing.NoReturn:
    """Raise the one-line :class:`ConfigError` naming the field, the offending value (quoted short) and what
    is allowed: the message every check here sends and docgen quotes in the reference pages."""
    raise ConfigError(f"invalid {name}={short(value)}: {allowed}")


def is_number(v: Any) -> bool:
    """An int or float that is not a bool (YAML's ``true`` is no number) and not NaN."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v)  # numbers: numpy's too


def check_ratio(name: str, v: float, *, low_open: bool = False) -> None:
    """``v`` in [0, 1] (or (0, 1] with ``low_open``): a share or probability of the config's sections."""
    if not isinstance(v, (int, float)) or math.isnan(v) or v > 1 or v < 0 or (low_open and v == 0):
        fail(name, v, "must be a number in " + ("(0, 1]" if low_open else "[0, 1]"))


def check_positive(name: str, v: Any, *, allow_zero: bool = False) -> None:
    """``v`` finite and > 0 (>= 0 with ``allow_zero``): a rate, size or resource of the config's sections."""
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (v >= 0 if allow_zero else v > 0))  # isfinite first: comparisons are never true for NaN
    if not ok:
        fail(name, v, "must be " + ("a non-negative finite number" if allow_zero else "a positive finite number"))


def check_choice(name: str, v: Any, choices: typing.Iterable[Any]) -> None:
    """``v`` one of ``choices`` (the message lists them in their order)."""
    choices = list(choices)
    if v not in choices:
        fail(name, v, "allowed values are " + ", ".join(map(str, choices)))


def check_number(name: str, v: Any, low: float, high: float | None = None, *, low_open: bool = False,
                 high_open: bool = False, nullable: bool = False, note: str = "") -> None:
    """``v`` a number >= ``low`` (> with ``low_open``) and, with ``high``, <= ``high`` (< with ``high_open``), or
    None when ``nullable``: "must be a number >= 0", "must be null or a number in (0, 1]", ... and ``note`` (why
    the range) after it."""
    if nullable and v is None:
        return
    ok = is_number(v) and (v > low if low_open else v >= low)
    if high is None:
        bounds = f"{'>' if low_open else '>='} {low:g}"
    else:
        ok = ok and (v < high if high_open else v <= high)
        bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if not ok:
        fail(name, v, f"must be {'null or ' if nullable else ''}a number {bounds}{note}")


def check_int(name: str, v: Any, low: int) -> None:
    """``v`` an integer (not a bool) >= ``low``: a count of rounds, samples or steps."""
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < low:
        fail(name, v, f"must be an integer >= {low}")


def check_bool(name: str, v: Any) -> None:
    """``v`` a bool (YAML's true/false), not a truthy number or string."""
    if not isinstance(v, bool):
        fail(name, v, "must be true or false")


SEED_MAX = 2**32 - 1  # the seed range every numpy/torch seeding API accepts
SEED_ALLOWED = f"must be an integer in [0, {SEED_MAX}] (0 <= seed < 2**32)"

PARTITIONS = ("domain", "dirichlet", "natural", "iid", "explicit")
CAPACITY_SCHEMES = ("cyclic", "tiers", "full", "explicit")
BACKENDS = ("local", "ray")
DEVICES = ("auto", "cpu", "cuda")
SUBMODELS = ("sliced", "masked")
# training.keep_model: which global models a run keeps under OUT/models/<run_id>/ (fedsap_ray.results.kept)
KEEP_MODELS = ("none", "final", "best", "final+best")
DEVICE_POLICIES = ("wait_all", "deadline", "over_select")
DEVICE_MODES = ("sync", "async")  # devices.mode: synchronous rounds, or asynchronous server steps (fedsap_ray.asyncmode)
STALENESS_RULES = ("constant", "polynomial", "hinge")  # asynchronous.staleness (fedsap_ray.staleness)
# [low, high] of the device model's numbers (and of a trace's columns): with train_macs and bytes up to
# 1e15 and any lognormal draw, (1 + backward_factor) * macs / (speed * factor) + bytes / bandwidth is then a
# finite float64 > 0 (a speed or bandwidth of 1e-300 or a backward_factor of 1e308 gave infinite times,
# a jitter of 1000 a factor of 0 and a division by zero)
DEVICE_RANGES: dict[str, tuple[float, float]] = {
    "speed_full": (1.0, 1e18), "down_bytes_s": (1.0, 1e15), "up_bytes_s": (1.0, 1e15),
    "backward_factor": (0.0, 1e3), "jitter": (0.0, 4.0), "over_select": (0.0, 1e3)}
DEVICE_RANGE_WHY = "so that every simulated time is finite and > 0"
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])"
_RAY_ADDRESS = re.compile(rf"(?:ray://)?{_HOST}:(\d{{1,5}})")
RAY_ADDRESS_ALLOWED = "must be auto, local, HOST:PORT or ray://HOST:PORT (a host name or IP address, a port 1-65535)"


def check_ray_address(field_name: str, v: Any) -> None:
    """A Ray address the way ``ray.init`` takes it; anything else is refused here, before Ray starts
    (ray.init would fail later, after the run was set up, with a message that does not name the option)."""
    if v is None or v in ("auto", "local"):
        return
    m = _RAY_ADDRESS.fullmatch(v) if isinstance(v, str) else None
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        fail(field_name, v, RAY_ADDRESS_ALLOWED)


@dataclass(frozen=True)
class DataConfig:
    """Which dataset, where its files are, and how it is split over clients (docs/guides/data.md)."""

    name: str = "embedded_digits"  # registered dataset (docs/reference/datasets.md)
    root: str | None = None  # None: the dataset's default location (cache dir or ../shared/data)
    download: bool = False  # let torchvision fetch missing files (clusters); off: a missing file is an error
    partition: str = "domain"  # domain (Digits/Office protocol) | dirichlet | natural | iid | explicit (partition_file)
    num_clients: int = 10  # clients in the federation
    client_fraction: float = 0.01  # share of its domain's training set each client gets (domain protocol)
    alpha: float = 0.3  # Dirichlet concentration (dirichlet partition)
    min_samples: int = 10  # every client keeps at least this many samples (dirichlet partition)
    max_test_per_domain: int | None = None  # cap on held-out samples per domain (None: full test set)
    max_train_per_domain: int | None = None  # cap on the training pool per domain before partitioning
    # JSON file naming every client's samples, domain and optionally capacity (data.partition=explicit;
    # docs/guides/own-data.md#an-explicit-partition); what it holds is recorded as runs.partition_hash
    partition_file: str | None = None

    def __post_init__(self) -> None:
        registry.DATASETS.get(self.name)  # a registered dataset (fedsap_ray.config.registry)
        check_choice("data.partition", self.partition, PARTITIONS)
        if self.partition == "explicit":
            if self.partition_file is None:
                fail("data.partition", self.partition, "needs data.partition_file, the JSON file naming every client's "
                                                       "samples (docs/guides/own-data.md)")
            if self.max_train_per_domain is not None:
                fail("data.max_train_per_domain", self.max_train_per_domain,
                     "is not read with data.partition=explicit (the partition file names each client's samples in the "
                     "dataset's own training split): leave it null")
        if self.partition_file is not None:
            try:
                kind = "file" if Path(self.partition_file).expanduser().is_file() else None
            except (TypeError, ValueError, RuntimeError, OSError):  # a NUL byte, ~unknown_user, a name too long
                kind = None
            if kind is None:
                fail("data.partition_file", self.partition_file, "no such file (a JSON file naming every client's "
                                                                 "samples, read with data.partition=explicit)")
            if self.partition != "explicit":
                fail("data.partition_file", self.partition_file, f"is read only with data.partition=explicit (the "
                                                                 f"partition is {self.partition}): set "
                                                                 "data.partition=explicit or leave it null")
        if not isinstance(self.num_clients, int) or isinstance(self.num_clients, bool) or self.num_clients < 1:
            fail("data.num_clients", self.num_clients, "must be an integer >= 1")
        check_ratio("data.client_fraction", self.client_fraction, low_open=True)
        check_positive("data.alpha", self.alpha)
        if not isinstance(self.min_samples, int) or self.min_samples < 1:
            fail("data.min_samples", self.min_samples, "must be an integer >= 1")
        for f in ("max_test_per_domain", "max_train_per_domain"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or v < 1):
                fail(f"data.{f}", v, "must be null or an integer >= 1")
        if self.root is not None:
            if isinstance(self.root, str) and not self.root.strip():  # '' would mean the working directory
                fail("data.root", self.root, "must name a folder (leave it null for the dataset's default location)")
            try:
                root = Path(self.root).expanduser()
                kind = "folder" if root.is_dir() else "file" if root.exists() else None
            except (ValueError, RuntimeError, OSError):  # a NUL byte, ~unknown_user, a name too long
                kind = None
            if kind is None:
                fail("data.root", self.root, "the directory does not exist (point it at the dataset files, or leave it null)")
            if kind == "file":
                fail("data.root", self.root, "it is a file; data.root is the folder that holds the dataset's files")


@dataclass(frozen=True)
class CapacityConfig:
    """Client device capacities: FedSAP's cyclic pruning ratios or HAS-FL's p_max tiers."""

    scheme: str = "cyclic"  # cyclic | tiers | full | explicit
    pruning_ratios: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8)  # FedSAP: rho_i = ratios[i % 5]
    tiers: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)  # HAS-FL p_max values
    # relative counts; 7/7/3/3 of 20 is our reading (papers/003 gives only the mean p_max 0.525)
    tier_shares: tuple[float, ...] = (7.0, 7.0, 3.0, 3.0)
    keep_ratios: tuple[float, ...] | None = None  # explicit per-client keep ratio / p_max

    def __post_init__(self) -> None:
        check_choice("capacity.scheme", self.scheme, CAPACITY_SCHEMES)
        if not self.pruning_ratios:
            fail("capacity.pruning_ratios", self.pruning_ratios, "must be a non-empty list")
        for r in self.pruning_ratios:
            if not isinstance(r, (int, float)) or not 0 <= r < 1:
                fail("capacity.pruning_ratios", list(self.pruning_ratios), "every ratio must be in [0, 1)")
        for p in self.tiers:
            check_ratio("capacity.tiers", p, low_open=True)
        if len(self.tiers) != len(self.tier_shares) or not self.tiers:
            fail("capacity.tier_shares", list(self.tier_shares), f"must have one entry per tier ({len(self.tiers)} tiers)")
        for s in self.tier_shares:
            check_positive("capacity.tier_shares", s, allow_zero=True)
        if not 0 < sum(float(s) for s in self.tier_shares) < math.inf:
            fail("capacity.tier_shares", [float(s) for s in self.tier_shares],
                  "the shares (relative client counts per tier) must have a finite sum > 0")
        if self.keep_ratios is not None:
            for p in self.keep_ratios:
                check_ratio("capacity.keep_ratios", p, low_open=True)
            if self.scheme != "explicit":  # ignored by every other scheme, yet part of the config hash
                fail("capacity.keep_ratios", list(self.keep_ratios),
                      f"used only by capacity.scheme=explicit (the scheme is {self.scheme}); set capacity.scheme=explicit "
                      "or leave keep_ratios null")
        if self.scheme == "explicit" and self.keep_ratios is None:
            fail("capacity.keep_ratios", None, "capacity.scheme=explicit needs a list with one keep ratio per client")


@dataclass(frozen=True)
class ModelConfig:
    """Which network every client trains (the maskable models of ``fedsap_ray/models``)."""

    name: str = "resnet10"  # resnet10/resnet18 (FedSAP), cnn_cifar/cnn_emnist/char_lstm (papers/003), cnn_small, mlp
    width_mult: float = 1.0  # scales every layer's channel count (tests and laptops use < 1)

    def __post_init__(self) -> None:
        registry.MODELS.get(self.name)  # a registered model (fedsap_ray.config.registry)
        check_positive("model.width_mult", self.width_mult)
        if self.width_mult > 4:
            fail("model.width_mult", self.width_mult, "must be in (0, 4]")


@dataclass(frozen=True)
class TrainingConfig:
    """Federated protocol and the client optimizer (papers/000 Table 4; papers/003 section 4.1)."""

    rounds: int = 100  # communication rounds
    local_epochs: int = 10  # local epochs per round (E)
    batch_size: int = 64  # local mini-batch size
    lr: float = 0.01  # client SGD learning rate (round 1; see lr_decay)
    momentum: float = 0.9  # client SGD momentum
    weight_decay: float = 5e-4  # client SGD weight decay
    lr_decay: float = 1.0  # multiplicative per round (papers/003: 0.995)
    grad_clip: float | None = None  # max gradient L2 norm (None: off)
    participation: float = 1.0  # fraction of clients sampled per round (papers/003: 0.5)
    eval_every: int = 1  # evaluate every this many rounds (the last round is always evaluated)
    max_steps_per_epoch: int | None = None  # cap on mini-batches per local epoch (None: full pass)
    # also evaluate each client's deployed model (its own sub-model on its own domain; eval_mode 'deployed')
    eval_deployed: bool = True
    # deployed evaluation covers at most this many clients: above it, a seeded sample stratified by domain
    eval_clients: int = 32
    # evaluate the deployed models only at every this-many-th round (and the last): each evaluation
    # recalibrates and evaluates up to eval_clients models, about a round's training on small presets
    deployed_every: int = 1
    # BN statistics of a deployed model: 'client' recomputes them on the client's own training data with its
    # own sub-model (what the device would hold); 'aggregated' keeps the server's averaged running statistics
    deployed_bn: str = "client"
    # How a client trains a sub-model (fedsap_ray/client.py). sliced: a dense smaller network holding only
    # the active channels (pays for the sub-model); masked: the full-size network with the other
    # coordinates zeroed (the reference). They agree to float rounding, not bit for bit, so this is part
    # of the config hash (here, not under resources). Clients whose mask no channel set describes, and
    # client hooks that need the full model, train masked either way.
    submodel: str = "sliced"
    # Which models the run keeps under OUT/models/<run_id>/ (safetensors + JSON; docs/guides/models.md): final
    # (the model after the last round), best (rewritten at each evaluated round where the best-so-far global
    # accuracy of the first eval mode strictly improves, the papers' selection), final+best, or none. With
    # each global model go the deployed models of the clients the run evaluates (training.eval_clients).
    keep_model: str = "final"

    def __post_init__(self) -> None:
        check_choice("training.submodel", self.submodel, SUBMODELS)
        check_choice("training.keep_model", self.keep_model, KEEP_MODELS)
        if not isinstance(self.eval_deployed, bool):
            fail("training.eval_deployed", self.eval_deployed, "must be true or false")
        if self.deployed_bn not in ("client", "aggregated"):
            fail("training.deployed_bn", self.deployed_bn, "allowed values are client, aggregated")
        for f in ("rounds", "local_epochs", "batch_size", "eval_every", "eval_clients", "deployed_every"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                fail(f"training.{f}", v, "must be an integer >= 1")
        check_positive("training.lr", self.lr)
        check_ratio("training.momentum", self.momentum)
        check_positive("training.weight_decay", self.weight_decay, allow_zero=True)
        check_ratio("training.lr_decay", self.lr_decay, low_open=True)
        if self.grad_clip is not None:
            check_positive("training.grad_clip", self.grad_clip)
        check_ratio("training.participation", self.participation, low_open=True)
        if self.max_steps_per_epoch is not None and (not isinstance(self.max_steps_per_epoch, int) or self.max_steps_per_epoch < 1):
            fail("training.max_steps_per_epoch", self.max_steps_per_epoch, "must be null or an integer >= 1")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Strategy name plus its own options (validated by the strategy's options dataclass).

    Building the node checks the name against the strategy registry and turns ``options`` into the
    strategy's typed ``Options`` once (:func:`parse_options`); that object is :attr:`opts`, what the
    strategy is built with. It is not a field: the config's JSON and hash are those of ``options``."""

    name: str = "fedsap"  # registry name (docs/reference/algorithms.md)
    # the algorithm's own options; set as --set algorithm.<option>=VALUE
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            fail("algorithm.name", self.name, "must be a string")
        if not isinstance(self.options, Mapping):
            fail("algorithm.options", self.options, "must be a mapping")
        object.__setattr__(self, "_opts", parse_options(self.name, self.options))

    @property
    def opts(self) -> Any:
        """The strategy's typed ``Options``, built when this config was validated."""
        return self.__dict__["_opts"]


def parse_options(name: str, options: Mapping[str, Any]) -> Any:
    """The strategy ``name``'s ``Options`` dataclass from plain options, naming any bad key or value
    (an unknown name is ``invalid algorithm.name=...``, from the strategy registry)."""
    opt_cls = registry.STRATEGIES.get(name).Options
    fields = {f.name: f for f in dataclasses.fields(opt_cls)}
    for k in options:
        if k not in fields:
            allowed = ", ".join(fields) or "(none)"
            raise ConfigError(f"invalid algorithm.{key_text(k)}={short(options[k])}: unknown option for algorithm {name!r}; "
                              f"allowed options are {allowed}")
    hints = typing.get_type_hints(opt_cls)
    return opt_cls(**{k: coerce(hints[k], v, f"algorithm.{k}") for k, v in options.items()})


@dataclass(frozen=True)
class ResourcesConfig:
    """Where and how clients train. Left out of the config hash; of these fields only ``torch_threads``
    can change a number (see its comment)."""

    backend: str = "local"  # local: clients train in this process; ray: ClientWorker actors
    device: str = "auto"  # auto: CUDA when available, else CPU
    num_workers: int | None = None  # concurrent clients; None: local = CPU count / torch_threads, Ray = from cluster resources
    cpus_per_worker: float = 1.0  # CPUs each Ray ClientWorker reserves
    gpus_per_worker: float = 0.0  # GPU fraction each Ray ClientWorker reserves (e.g. 0.25: four workers per GPU)
    address: str | None = None  # Ray cluster address; None: RAY_ADDRESS or a local Ray on 127.0.0.1
    dashboard: bool = False  # start the Ray dashboard (on 127.0.0.1) when starting a local Ray
    # Intra-op threads of every client's training and of evaluation. Part of the numerics:
    # float reductions differ with the thread count, so it is fixed (not "all cores") to
    # give the same bits on every backend and worker. Parallelism comes from running
    # clients concurrently (num_workers), not from threads inside one client.
    torch_threads: int = 1

    def __post_init__(self) -> None:
        check_choice("resources.backend", self.backend, BACKENDS)
        check_choice("resources.device", self.device, DEVICES)
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 1):
            fail("resources.num_workers", self.num_workers, "must be null or an integer >= 1")
        check_positive("resources.cpus_per_worker", self.cpus_per_worker)
        check_positive("resources.gpus_per_worker", self.gpus_per_worker, allow_zero=True)
        if not isinstance(self.torch_threads, int) or self.torch_threads < 1:
            fail("resources.torch_threads", self.torch_threads, "must be an integer >= 1")
        check_ray_address("resources.address", self.address)


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


def check_async(cfg: ExperimentConfig) -> None:
    """The checks across sections of an asynchronous config (``devices.mode``): the asynchronous fields are
    read only in that mode, the concurrency and buffer fit the federation, the policy is wait_all (no round
    to wait for), and the strategy declares an asynchronous reading (``Strategy.async_support``)."""
    a, n = cfg.asynchronous, cfg.data.num_clients
    if cfg.devices.mode != "async":
        default = AsyncConfig()
        for f in dataclasses.fields(AsyncConfig):
            if getattr(a, f.name) != getattr(default, f.name):
                fail(f"asynchronous.{f.name}", getattr(a, f.name),
                      f"read only with devices.mode=async (the mode is {cfg.devices.mode}); set devices.mode=async "
                      "or leave it out")
        return
    if cfg.devices.policy != "wait_all":
        fail("devices.policy", cfg.devices.policy, "devices.mode=async has no rounds to wait for: use wait_all "
                                                    "(stale updates are bounded by asynchronous.max_staleness)")
    if a.eval_every_s is not None and cfg.training.eval_every != 1:
        fail("training.eval_every", cfg.training.eval_every, f"is not read with asynchronous.eval_every_s="
                                                             f"{a.eval_every_s:g} (the evaluation follows the simulated "
                                                             "clock): leave it out (1)")
    for name in ("concurrency", "buffer_size"):
        v = getattr(a, name)
        if v is not None and v > n:
            fail(f"asynchronous.{name}", v, f"must be at most data.num_clients={n} (a client trains one update at a time)")
    strategy = registry.STRATEGIES.get(cfg.algorithm.name)
    refusal = strategy.async_support(cfg.algorithm.opts)
    if refusal is not None:
        supported = [m for m in registry.STRATEGIES.names()
                     if registry.STRATEGIES.get(m).async_support(registry.STRATEGIES.get(m).Options()) is None]
        fail("algorithm.name", cfg.algorithm.name, f"devices.mode=async does not support {cfg.algorithm.name}: "
                                                    f"{refusal}; supported: {', '.join(supported)}")


@dataclass(frozen=True)
class ExperimentConfig:
    """The whole run. Besides each field's own check: ``capacity.keep_ratios`` needs one entry per
    client (and ``capacity.scheme=explicit``, the only scheme that reads it), ``partition=domain``
    needs a dataset with several domains, ``partition=natural`` exists only for Shakespeare, and
    ``training.participation`` must sample at least one client a round: round(participation *
    num_clients) >= 1 (a fraction that rounds to no client is refused, not raised to one).
    ``preset`` is chosen by ``--preset`` or a config file's ``preset:`` key, never by ``--set``.
    Algorithm options are checked by their strategy (algorithms.md); e.g. random_budget's ``p_low``
    above ``p_min`` is legal (the draws are rescaled to the budget either way)."""

    study: str = "default"  # a label stored with every result (the sweep scripts set it to the study's name)
    seed: int = 0  # seeds every random draw of the run (partition, initialisation, sampling, batches)
    preset: str = "custom"  # the preset the config started from (set by build_config; recorded in the runs table)
    data: DataConfig = field(default_factory=DataConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= SEED_MAX:
            fail("seed", self.seed, SEED_ALLOWED)
        if not isinstance(self.study, str) or not self.study:
            fail("study", self.study, "must be a non-empty string")
        kr = self.capacity.keep_ratios
        if kr is not None and len(kr) != self.data.num_clients:
            fail("capacity.keep_ratios", list(kr), f"needs exactly data.num_clients={self.data.num_clients} entries, got {len(kr)}")
        source = registry.DATASETS.get(self.data.name)  # what the dataset declares where it is registered
        if self.data.partition == "domain" and source.single_domain:
            fail("data.partition", self.data.partition, f"data.name={self.data.name} has one domain: use dirichlet, natural or iid")
        sampled = int(round(self.training.participation * self.data.num_clients))
        if sampled < 1:
            fail("training.participation", self.training.participation,
                  f"with data.num_clients={self.data.num_clients} it samples round({self.training.participation} * "
                  f"{self.data.num_clients}) = 0 clients a round; must be > {0.5 / self.data.num_clients:g} "
                  "(at least one client a round)")
        if self.data.partition == "natural" and not source.natural_partition:
            natural = [n for n in registry.DATASETS.names() if registry.DATASETS.get(n).natural_partition]
            fail("data.partition", self.data.partition,
                  "natural partitions exist only for " + ", ".join(f"data.name={n}" for n in natural))
        check_async(self)

    # --- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def config_hash(self) -> str:
        """Stable 12-hex hash of the resolved config (run-id prefix); ignores where it runs."""
        d = self.to_dict()
        d.pop("resources", None)
        d.pop("preset", None)
        if isinstance(d.get("training"), dict) and d["training"].get("keep_model") == TrainingConfig.keep_model:
            d["training"].pop("keep_model")  # runs that keep the default models keep the hash they had before the field
        if isinstance(d.get("devices"), dict) and d["devices"].get("trace_sha256") is None:
            d["devices"].pop("trace_sha256", None)  # no trace: hashed as before the field existed
        if isinstance(d.get("devices"), dict) and d["devices"].get("mode") == "sync":
            d["devices"].pop("mode")  # synchronous runs keep the hash they had before devices.mode existed
        if d.get("asynchronous") == _to_plain(dataclasses.asdict(AsyncConfig())):
            d.pop("asynchronous")  # ... and before the asynchronous section existed
        if isinstance(d.get("asynchronous"), dict) and d["asynchronous"].get("eval_every_s") is None:
            d["asynchronous"].pop("eval_every_s", None)  # asynchronous runs keep the hash they had before the field
        if d.get("devices") == _without_sha(_to_plain(dataclasses.asdict(DevicesConfig()))):
            d.pop("devices")  # the default device model adds columns only: runs keep the hash they had before it
        if isinstance(d.get("data"), dict) and d["data"].get("partition_file") is None:
            d["data"].pop("partition_file", None)  # runs without a partition file keep the hash they had before it
        algo = d.get("algorithm")
        if isinstance(algo, dict) and isinstance(algo.get("options"), dict):
            algo["options"] = _hashed_options(algo.get("name"), algo["options"])
        return hashlib.sha256(json.dumps(_canonical(d), sort_keys=True).encode()).hexdigest()[:12]


def _hashed_options(name: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The algorithm options the config hash reads: an option its ``Options`` lists in ``unhashed_defaults`` is
    left out at its default, so a run that names the default of an option added later keeps the hash it had
    before the option existed (as with the sections above)."""
    if not isinstance(name, str):
        return options
    opt_cls = registry.STRATEGIES.get(name).Options
    quiet = getattr(opt_cls, "unhashed_defaults", ())
    if not quiet:
        return options
    defaults = {f.name: f.default for f in dataclasses.fields(opt_cls)}
    return {k: v for k, v in options.items() if not (k in quiet and v == defaults.get(k))}


def _without_sha(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in ("trace_sha256", "mode")}


def _canonical(x: Any) -> Any:
    """Numbers as floats, so 7 and 7.0 (same meaning) hash alike."""
    if isinstance(x, dict):
        return {k: _canonical(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_canonical(v) for v in x]
    if isinstance(x, int) and not isinstance(x, bool):
        return float(x)
    return x


def _to_plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_plain(v) for v in x]
    return x


Checks = Mapping[type, Callable[[Any], None]]  # extra checks run on each built node of a type


def construct(cls: Any, d: Any, prefix: str, checks: Checks | None = None) -> Any:
    """The dataclass ``cls`` from the plain mapping ``d``, each value coerced to its field's type;
    a one-line ConfigError naming ``prefix + key`` otherwise. ``checks[t](node)`` runs on every node
    of type ``t`` as soon as it is built (how the config layer checks algorithm options, which this
    module cannot know), so errors come in the order of the mapping's keys."""
    if not isinstance(d, Mapping):
        fail(prefix.rstrip(".") or "config", d, "must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in d if k not in fields]
    if unknown:
        k = unknown[0]  # any YAML key (an int, a null, ''), named as written: quoted unless it is a plain word
        key = key_text(k)
        fail(f"{prefix}{key}", d[k], f"unknown key; allowed keys under {prefix.rstrip('.') or 'the top level'} are " + ", ".join(fields))
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in d.items():
        kwargs[k] = coerce(hints[k], v, prefix + k, checks)
    try:
        node = cls(**kwargs)
    except TypeError as e:  # pragma: no cover - defensive
        raise ConfigError(f"invalid {prefix.rstrip('.')}: {e}") from e
    if checks and cls in checks:
        checks[cls](node)
    return node


INT64_MAX = 2**63 - 1  # what the Parquet int64 columns (seed, rounds, num_clients...) can hold
_SCALAR_ERRORS = {
    float: {"finite_number": "must be a finite number (not NaN or infinity)"},
    int: {"greater_than_equal": "must be an integer between -2**63 and 2**63-1",
          "less_than_equal": "must be an integer between -2**63 and 2**63-1"},
}


@functools.cache
def _adapter(tp: type) -> Any:
    """A pydantic validator for one scalar type: strict (no "1" for 1, no bools for numbers),
    no NaN or infinity (a NaN slips through every hand-written ``v <= 0`` check), and
    integers within int64."""
    from pydantic import ConfigDict, Field, TypeAdapter

    if tp is int:
        return TypeAdapter(typing.Annotated[int, Field(strict=True, ge=-INT64_MAX - 1, le=INT64_MAX)])
    return TypeAdapter(tp, config=ConfigDict(strict=True, allow_inf_nan=False))


def _scalar(tp: type, v: Any, name: str) -> Any:
    """``v`` as a ``tp`` (int or float), or a one-line ConfigError naming ``name``."""
    from pydantic import ValidationError

    if isinstance(v, bool):  # a bool is an int to Python, never a number to a config
        fail(name, v, "must be a number" if tp is float else "must be an integer")
    try:
        return _adapter(tp).validate_python(v)
    except ValidationError as e:
        kind = e.errors()[0]["type"]
        if name == "seed" and kind in _SCALAR_ERRORS[int]:
            fail(name, v, SEED_ALLOWED)
        fail(name, v, _SCALAR_ERRORS[tp].get(kind, "must be a number" if tp is float else "must be an integer"))


def coerce(tp: Any, v: Any, name: str, checks: Checks | None = None) -> Any:
    """``v`` as a value of type ``tp`` (dataclass, optional, tuple, mapping, scalar), strictly: one
    rule for the config tree and for every strategy's options (:mod:`fedsap_ray.algorithms.registry`)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return construct(tp, v, name + ".", checks)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(inner[0], v, name, checks)
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            fail(name, v, "must be a list")
        return tuple(coerce(args[0], x, name, checks) for x in v)
    if origin in (Mapping, dict) or tp is Mapping:
        if not isinstance(v, Mapping):
            fail(name, v, "must be a mapping")
        return dict(v)
    if tp is float:
        return _scalar(float, v, name)
    if tp is int:
        if isinstance(v, float) and v.is_integer():  # YAML/JSON may spell an integer 3.0
            v = int(v)
        return _scalar(int, v, name)
    if tp is bool:
        if not isinstance(v, bool):
            fail(name, v, "must be true or false")
        return v
    if tp is str:
        if not isinstance(v, str):
            fail(name, v, "must be a string")
        return v
    return v
