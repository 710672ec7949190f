"""The experiment config's schema: one frozen, validated dataclass tree, section by section, and its hash.

This is the bottom of the config layer: data, models, algorithms and backends import their config
types from here. The sections of simulated device time are :mod:`fedsap_ray.config.device_config`, the field
checks :mod:`fedsap_ray.config.checks`, the strict coercion from plain mappings :mod:`fedsap_ray.config.coerce`;
assembling a config (presets, YAML, ``--set`` overrides) is :mod:`fedsap_ray.config.build`, and every public
name of the folder is importable from :mod:`fedsap_ray.config`. Names that are registered
(``data.name``, ``model.name``, ``algorithm.name``) are checked against their registry
(:mod:`fedsap_ray.config.registry`, which imports nothing heavy and loads the registering package on first
use), and ``algorithm.options`` becomes the strategy's typed ``Options`` here, once. Every error is a
:class:`~fedsap_ray.common.errors.ConfigError` whose message names the field, the offending value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from fedsap_ray.config import registry
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.checks import (BACKENDS, CAPACITY_SCHEMES, COMPILE_MODES, DEVICES, KEEP_MODELS, PARTITIONS, SEED_ALLOWED, SEED_MAX,
                                      check_supported,
                                      SUBMODELS, check_choice, check_positive, check_ratio, check_ray_address, fail, key_text,
                                      short)
from fedsap_ray.config.coerce import coerce
from fedsap_ray.config.device_config import AsyncConfig, DevicesConfig
from fedsap_ray.config.privacy_config import PrivacyConfig, check_privacy

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
    # How a client trains a sub-model (fedsap_ray/engine/client.py). sliced: a dense smaller network holding only
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
    and ``compile`` can change a number (see their comments), and the runs row's ``config_json`` records both."""

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
    # off: the plain eager loop; train: torch.compile the forward (and so the backward) of the client's training
    # step, once per model shape per process (fedsap_ray.engine.compiled); train+eval: the evaluation's forward too.
    # Like torch_threads it changes numbers only by float reordering (Inductor fuses and reorders reductions),
    # so, like it, it is left out of the hash: the same experiment, computed another way; each mode is
    # deterministic on its own (docs/guides/performance.md).
    compile: str = "off"

    def __post_init__(self) -> None:
        check_choice("resources.backend", self.backend, BACKENDS)
        check_choice("resources.compile", self.compile, COMPILE_MODES)
        check_choice("resources.device", self.device, DEVICES)
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 1):
            fail("resources.num_workers", self.num_workers, "must be null or an integer >= 1")
        check_positive("resources.cpus_per_worker", self.cpus_per_worker)
        check_positive("resources.gpus_per_worker", self.gpus_per_worker, allow_zero=True)
        if not isinstance(self.torch_threads, int) or self.torch_threads < 1:
            fail("resources.torch_threads", self.torch_threads, "must be an integer >= 1")
        check_ray_address("resources.address", self.address)



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
    check_supported(cfg.algorithm.name, cfg.algorithm.opts, "async_support", "devices.mode=async")


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
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

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
        check_privacy(self)

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
        if d.get("privacy") == _to_plain(dataclasses.asdict(PrivacyConfig())):
            d.pop("privacy")  # non-private runs keep the hash they had before the privacy section existed
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

