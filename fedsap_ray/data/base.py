"""Data containers shared by every dataset, partitioner and backend.

Images are stored as uint8 NCHW (3 channels) and turned into normalised float32 only
per client batch (:func:`as_input`), so a whole real dataset fits in memory and in the
Ray object store once. Feature datasets are float32 [N, F]; text datasets int64 [N, T].
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from fedsap_ray.common.errors import DatasetUnreadable

InputKind = Literal["image", "features", "text"]


@dataclass(frozen=True)
class DomainData:
    """One domain's samples: ``x`` (uint8 images / float32 features / int64 tokens) and int64 labels ``y``."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"DomainData: x has {len(self.x)} samples but y has {len(self.y)}")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray | torch.Tensor) -> DomainData:
        idx_t = torch.as_tensor(np.asarray(idx), dtype=torch.long)
        return DomainData(self.x[idx_t], self.y[idx_t])


def check_labels(dataset: str, domain: str, labels: np.ndarray | torch.Tensor, num_classes: int,
                 files: Iterable[Path] = ()) -> None:
    """Every loader's check of the labels it read: a label outside 0..num_classes-1 means a damaged file or
    another dataset, so it is bad input (:class:`~fedsap_ray.common.errors.DatasetUnreadable`, exit 2) naming the
    ``files`` read, never a run that fails later on an index error."""
    y = np.asarray(labels)
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        names = [str(p) for p in files]
        where = f" in {', '.join(names)}" if names else ""
        raise DatasetUnreadable(f"{dataset}: domain {domain!r} has labels outside 0..{num_classes - 1} (min {y.min()}, "
                                f"max {y.max()}){where}; the file is damaged or holds another dataset: fetch it again")


# How each kind of input reaches the model: the one statement of the transform every batch goes through
# (:func:`as_input`, on the client and in evaluation alike), which the datasets reference and docs/guides/data.md
# quote per dataset (a dataset declares its kinds: ``register_dataset(inputs=...)``). Nothing else is applied:
# no per-channel mean or standard deviation, no augmentation.
INPUT_SCALING: dict[str, str] = {
    "image": "uint8 [0, 255] -> float32 [-1, 1]: x * 2/255 - 1 (as_input)",
    "features": "float32 as stored, unchanged",
    "text": "int64 token ids as stored, unchanged (the model embeds them)",
}


def as_input(x: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float32 in [-1, 1] (x * 2/255 - 1); other kinds pass through unchanged (:data:`INPUT_SCALING`)."""
    if x.dtype == torch.uint8:
        return x.float().mul_(2.0 / 255.0).sub_(1.0)
    return x


def input_transform(dataset: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """What every model of this project is fed, given a registered dataset's stored samples: :func:`as_input`
    (uint8 images (N, C, H, W) -> float32 in [-1, 1]; float features and int64 token ids as stored). Nothing
    is attached to a kept model (:func:`fedsap_ray.results.load_model`): whoever feeds one applies this to
    raw samples first (docs/guides/models.md#inputs). An unknown ``dataset`` is refused, naming the valid ones."""
    from fedsap_ray.config.registry import DATASETS

    DATASETS.get(dataset)  # ConfigError naming data.name and the registered datasets
    return as_input


@dataclass(slots=True)
class ClientSpec:
    """One virtual client: where its data is, its true domain and its device capacity."""

    client_id: int
    domain: str  # true domain (ground truth: strategies see ClientInfo, which has none)
    indices: np.ndarray  # int64 indices into Federation.train[domain]
    pruning_ratio: float  # FedSAP rho_i (0 under the tiers scheme)
    capacity: float  # what the device can train: kappa_i = 1 - rho_i, or HAS-FL's p_max
    tv_distance: float  # TV(client label distribution, global label distribution)
    label_counts: np.ndarray  # int64 [num_classes]

    @property
    def n_samples(self) -> int:
        return int(len(self.indices))


@dataclass
class Federation:
    """Everything a run needs about data: per-domain train pools and test sets, and the clients."""

    dataset: str  # honest name, e.g. "embedded_digits" or "digits_offline"
    domains: list[str]
    train: dict[str, DomainData]
    test: dict[str, DomainData]
    clients: list[ClientSpec]
    num_classes: int
    input_kind: InputKind
    input_shape: tuple[int, ...]  # per-sample shape, e.g. (3, 32, 32), (800,), (80,)
    vocab_size: int | None = None  # text datasets
    notes: str = ""  # provenance shown to users (what is real, what is rendered)
    domain_notes: dict[str, str] = field(default_factory=dict)
    # where the clients' split came from (runs.partition_source): builtin:<data.partition>, file:<path>,
    # flower:<partitioner>, object (an ExplicitPartition built in Python), or given: a Federation built by hand
    partition_source: str = "given"
    data_digest: str | None = None  # DomainSplits.digest of own data (fedsap_ray.data.own), covered by partition_hash

    def __getstate__(self) -> dict:
        """Pickled (to the Ray server actor and workers) with the clients as columns: one array per field
        instead of N objects of two small arrays each, 21.6 MiB pickled and 199 MiB unpickled at 100,000
        clients before (benchmarks/federation_scale.py); unpickled, each client's arrays view the columns."""
        state = {k: v for k, v in ((f, getattr(self, f)) for f in self.__dataclass_fields__) if k != "clients"}
        state["clients"] = _pack_clients(self.clients, self.num_classes)
        return state

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, _unpack_clients(v) if k == "clients" else v)

    def client_data(self, client_id: int) -> DomainData:
        c = self.clients[client_id]
        return self.train[c.domain].subset(c.indices)

    def server_view(self) -> FederationView:
        """What a real server could know about this federation: no data, no true domain, no label distribution."""
        return FederationView(
            dataset=self.dataset,
            clients=tuple(ClientInfo(c.client_id, c.n_samples, c.pruning_ratio, c.capacity) for c in self.clients),
            num_classes=self.num_classes, input_kind=self.input_kind, input_shape=tuple(self.input_shape),
            vocab_size=self.vocab_size)

    def eval_domains(self) -> EvalDomains:
        """The domain structure evaluation needs (test domains, clients per domain); ground truth."""
        return EvalDomains(names=tuple(self.domains),
                           members={d: tuple(c.client_id for c in self.clients if c.domain == d) for d in self.domains})


def _pack_clients(clients: list[ClientSpec], num_classes: int) -> dict[str, object]:
    names = sorted({c.domain for c in clients})
    code = {d: i for i, d in enumerate(names)}
    sizes = np.array([len(c.indices) for c in clients], dtype=np.int64)
    flat = np.concatenate([np.asarray(c.indices, dtype=np.int64) for c in clients]) if clients else np.zeros(0, np.int64)
    counts = (np.stack([np.asarray(c.label_counts, dtype=np.int64) for c in clients]) if clients
              else np.zeros((0, num_classes), np.int64))
    return {"ids": np.array([c.client_id for c in clients], dtype=np.int64), "domains": names,
            "domain": np.array([code[c.domain] for c in clients], dtype=np.int32),
            "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), "indices": flat,
            "pruning_ratio": np.array([c.pruning_ratio for c in clients], dtype=np.float64),
            "capacity": np.array([c.capacity for c in clients], dtype=np.float64),
            "tv_distance": np.array([c.tv_distance for c in clients], dtype=np.float64), "label_counts": counts}


def _unpack_clients(p: dict) -> list[ClientSpec]:
    off, flat, names = p["offsets"], p["indices"], p["domains"]
    return [ClientSpec(client_id=int(p["ids"][i]), domain=names[int(p["domain"][i])], indices=flat[off[i]:off[i + 1]],
                       pruning_ratio=float(p["pruning_ratio"][i]), capacity=float(p["capacity"][i]),
                       tv_distance=float(p["tv_distance"][i]), label_counts=p["label_counts"][i])
            for i in range(len(p["ids"]))]


@dataclass(frozen=True)
class ClientInfo:
    """One client as a real server knows it: its id, how much data it has and what its device can run.

    Its true domain and label distribution (:class:`ClientSpec`) are ground truth and are not here."""

    client_id: int
    n_samples: int
    pruning_ratio: float  # FedSAP rho_i (0 under the tiers scheme)
    capacity: float  # what the device can train: kappa_i = 1 - rho_i, or HAS-FL's p_max


@dataclass(frozen=True)
class FederationView:
    """The federation as a strategy sees it (:class:`fedsap_ray.algorithms.context.StrategyContext`)."""

    dataset: str
    clients: tuple[ClientInfo, ...]
    num_classes: int
    input_kind: InputKind
    input_shape: tuple[int, ...]
    vocab_size: int | None = None


@dataclass(frozen=True)
class EvalDomains:
    """Evaluation-only ground truth: the test domains and, per domain, the clients whose training data
    came from it. Passed to :meth:`Strategy.eval_models` / ``eval_sets`` to build one model per test
    domain (e.g. FedSAP's group model of a domain's clients); a strategy must not train with it."""

    names: tuple[str, ...]
    members: dict[str, tuple[int, ...]]
