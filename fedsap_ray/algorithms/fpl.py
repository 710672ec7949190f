"""FPL (Huang, Ye, Shi, Li, Du, CVPR 2023, "Rethinking Federated Learning with Domain Shift:
A Prototype View"), full model, FedAvg aggregation (papers/000 Table 1, Appendix A).

One round:

- client i trains the whole model on
      L = L_CE + L_CPCL + L_UPCR                                   (FPL's total loss, equal weights)
  where, for a sample with representation z = f_enc(x) of class y,
      L_CPCL(z) = -log( sum_{c in C_y} exp(s(z, c)/tau) / sum_{c in C} exp(s(z, c)/tau) )   (FPL Eqs. 7-8)
      L_UPCR(z) = (1/d) ||z - u_y||_2^2                                                      (FPL Eq. 10)
  C = the cluster prototypes of every class sent by the server, C_y those of class y, s the
  cosine similarity, tau the temperature and u_y the unbiased prototype of class y (d = feature
  dimension: FPL's code uses ``nn.MSELoss`` between z and u_y). Both terms are averaged over
  the mini-batch; a sample whose class has no prototype yet contributes 0 to them (FPL's code
  divides their sum by the batch size too). Round 1 (no prototypes yet) is plain CE.
- the client also returns its local class prototypes p_i^k = mean of f_enc(x) over its
  samples of class k (FPL's local prototype) and how many samples went into each
  (``ClientResult.stats`` ``fpl_protos`` [C, d], ``fpl_counts`` [C]). As in FPL's reference code (models/fpl.py,
  ``agg_protos_label`` filled during ``iter == local_epoch - 1``) they are the representations
  the forward passes of the LAST local epoch computed, with the model as it trains through that
  epoch, in train-mode BatchNorm, i.e. exactly the representations the losses above act on; no
  extra forward pass. The step at which that epoch begins is computed by the server from the
  client's sample count (:func:`last_epoch_start`, the client loop's batching rule) and sent in
  the plan.
- the server averages the models (FedAvg, sample-weighted, :mod:`fedsap_ray.algorithms.aggregation`)
  and, per class k, clusters the participating clients' prototypes with FINCH (Sarfraz et al.
  2019, :func:`finch`), cosine distance, keeping the coarsest partition FINCH returns (FPL's
  code takes ``c[:, -1]``); each cluster's mean is a "cluster prototype" and the class's
  "unbiased prototype" is the unweighted mean of its cluster prototypes (the reference code's
  ``proto_aggregation`` and the ``mean_f`` it builds in ``_train_net``).
  A class only one client holds gets that prototype as its single cluster. The next round's
  plans carry them (the ``fpl`` hook's payload; counted in ``side_bytes_down``).

Equation numbers (Eqs. 7-8: the similarity and InfoNCE term, Eq. 10: the MSE term) follow
FPL as annotated in public re-implementations of its code; the paper text itself was not
available to us, so the other steps cite the authors' code instead of equation numbers.

Hyperparameters:

- ``tau`` (``algorithm.tau``) = 0.02: the ``--infoNCET`` default of the authors' code
  (github.com/WenkeHuang/RethinkFL, main.py at commit edac25f; another stored version of
  that file, a52a765, has 0.1) and of several public code bases derived from it;
  ``utils/best_args.py`` does not override it for FPL on Digits or Office-Caltech. The
  paper's own value could not be checked here.
- optimiser, rounds, epochs, batch size: the run's ``training`` section (the FedSAP
  protocol every Table 1 method shares; FPL's own code uses SGD lr 0.01, momentum 0.9,
  weight decay 1e-5, batch 64, 10 local epochs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from scipy.sparse.csgraph import connected_components

from fedsap_ray.algorithms.grouping import canonical_labels
from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_number
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState

HOOK = "fpl"
PROTO_KEYS = ("fpl_cluster_protos", "fpl_cluster_labels", "fpl_unbiased", "fpl_has_proto")


# --------------------------------------------------------------------------------------------------
# FINCH (Sarfraz, Sharma, Stiefelhagen, CVPR 2019) with cosine distance
# --------------------------------------------------------------------------------------------------

def first_neighbours(x: np.ndarray) -> np.ndarray:
    """Index of each row's first neighbour: the most cosine-similar other row (ties: lowest index)."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    u = x / np.maximum(norms, 1e-12)  # a zero row has similarity 0 to everything (as sklearn's cosine)
    sim = u @ u.T
    np.fill_diagonal(sim, -np.inf)
    return np.argmax(sim, axis=1)


def first_neighbour_partition(x: np.ndarray) -> np.ndarray:
    """FINCH's clustering equation (Sarfraz et al. 2019, Eq. 1): i and j share a cluster when
    j is i's first neighbour, i is j's, or both have the same first neighbour, i.e. the connected
    components of the symmetrised first-neighbour graph. Labels 0..K-1 in order of first appearance."""
    n = len(x)
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    nn_idx = first_neighbours(x)
    graph = sp.csr_matrix((np.ones(n), (np.arange(n), nn_idx)), shape=(n, n))
    _, labels = connected_components(graph, directed=True, connection="weak")
    return canonical_labels(labels)


def cluster_means(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Unweighted mean of each cluster's rows (float64), clusters in label order."""
    x = np.asarray(x, dtype=np.float64)
    k = int(labels.max()) + 1
    sums = np.zeros((k, x.shape[1]))
    np.add.at(sums, labels, x)
    return sums / np.bincount(labels, minlength=k)[:, None]


def finch(x: np.ndarray) -> list[np.ndarray]:
    """FINCH's hierarchy of partitions of the rows of ``x`` (finest first).

    Partition 0 is :func:`first_neighbour_partition` of the points; each next one applies it to
    the previous partition's cluster means. Like the reference implementation (and FPL, which
    calls it with ``ensure_early_exit=False``), the recursion stops, and the candidate is
    discarded, when it would merge everything into one cluster or no longer reduces the count.
    """
    labels = first_neighbour_partition(x)
    parts = [labels]
    while True:
        k = int(labels.max()) + 1
        if k == 1:
            break
        merged = first_neighbour_partition(cluster_means(x, labels))[labels]
        k_new = int(merged.max()) + 1
        if k_new == 1 or k_new >= k:
            break
        labels = canonical_labels(merged)
        parts.append(labels)
    return parts


def class_prototypes(protos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cluster prototypes [K, d], unbiased prototype [d]) of one class from the clients' prototypes.

    FPL's choice of level: the last (coarsest) FINCH partition (its code's ``c[:, -1]``); the unbiased
    prototype is the mean of the cluster prototypes. A single client's prototype is its own cluster.
    """
    protos = np.asarray(protos, dtype=np.float64)
    if len(protos) == 1:
        clusters = protos.copy()
    else:
        clusters = cluster_means(protos, finch(protos)[-1])
    return clusters.astype(np.float32), clusters.mean(axis=0).astype(np.float32)


def server_prototypes(results: list[ClientResult], num_classes: int) -> dict[str, np.ndarray]:
    """The plan payload built from this round's client prototypes (client-id order)."""
    results = sorted(results, key=lambda r: r.client_id)
    dim = next((int(r.stats["fpl_protos"].shape[1]) for r in results if "fpl_protos" in r.stats), 0)
    cl_protos, cl_labels = [], []
    unbiased = np.zeros((num_classes, dim), dtype=np.float32)
    has = np.zeros(num_classes, dtype=bool)
    for k in range(num_classes):
        held = [r.stats["fpl_protos"][k] for r in results
                if "fpl_counts" in r.stats and int(r.stats["fpl_counts"][k]) > 0]
        if not held:
            continue
        clusters, unbiased[k] = class_prototypes(np.stack(held))
        has[k] = True
        cl_protos.append(clusters)
        cl_labels.append(np.full(len(clusters), k, dtype=np.int64))
    return {
        "fpl_cluster_protos": (np.concatenate(cl_protos) if cl_protos else np.zeros((0, dim))).astype(np.float32),
        "fpl_cluster_labels": np.concatenate(cl_labels) if cl_labels else np.zeros(0, dtype=np.int64),
        "fpl_unbiased": unbiased, "fpl_has_proto": has,
    }


# --------------------------------------------------------------------------------------------------
# Client-side losses
# --------------------------------------------------------------------------------------------------

def cpcl_loss(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, proto_labels: torch.Tensor,
              tau: float) -> torch.Tensor:
    """Per-sample cluster prototype contrastive loss (FPL Eq. 8), for samples whose class has a prototype.

    -log(sum_{pos} exp(cos/tau) / sum_{all} exp(cos/tau)), evaluated as a difference of
    log-sum-exps (the same value, without overflow at tau = 0.02).
    """
    sim = F.cosine_similarity(z[:, None, :], protos[None, :, :], dim=2) / tau  # [B, K]
    pos = proto_labels[None, :] == y[:, None]
    log_pos = torch.logsumexp(sim.masked_fill(~pos, float("-inf")), dim=1)
    return torch.logsumexp(sim, dim=1) - log_pos


def upcr_loss(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample unbiased prototype consistency (FPL Eq. 10): mean over features of (z - u_y)^2."""
    return (z - target).pow(2).mean(dim=1)


def fpl_regulariser(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, proto_labels: torch.Tensor,
                    unbiased: torch.Tensor, has_proto: torch.Tensor, tau: float) -> torch.Tensor:
    """(1/|B|) sum over samples whose class has prototypes of L_CPCL + L_UPCR (0 for the others)."""
    valid = has_proto[y]
    if not bool(valid.any()):
        return z.sum() * 0.0
    zv, yv = z[valid], y[valid]
    per = cpcl_loss(zv, yv, protos, proto_labels, tau) + upcr_loss(zv, unbiased[yv])
    return per.sum() / len(y)


def last_epoch_start(n: int, batch_size: int, local_epochs: int, max_steps_per_epoch: int | None) -> int:
    """Optimizer steps before the last local epoch under :mod:`fedsap_ray.engine.client`'s batching:
    full batches plus a last batch of >= 2 samples (one sample only when the client has one),
    at most ``max_steps_per_epoch`` per epoch."""
    per = n // batch_size + (1 if n % batch_size >= 2 else 0) if n >= 2 else n
    if max_steps_per_epoch is not None:
        per = min(per, max_steps_per_epoch)
    return (local_epochs - 1) * per


@dataclass(frozen=True)
class FPLPayload:
    tau: float  # InfoNCE temperature (algorithm.tau)
    num_classes: int
    collect_from: int  # the loss call (step) at which the last local epoch begins (last_epoch_start)
    # last round's server prototypes (server_prototypes; None before the first aggregation)
    cluster_protos: np.ndarray | None = None
    cluster_labels: np.ndarray | None = None
    unbiased: np.ndarray | None = None
    has_proto: np.ndarray | None = None


@register_hook(HOOK)
class FPLObjective(ClientHook):
    """CE (+ L_CPCL + L_UPCR once prototypes exist); sums last-epoch representations per class."""

    Payload: ClassVar[type] = FPLPayload
    payload: FPLPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device) -> None:
        super().__init__(plan, model, layout, device)
        ex = self.payload
        self.tau = ex.tau
        self.num_classes = int(ex.num_classes)
        self.collect_from = int(ex.collect_from)
        self.calls = 0
        self.sums = torch.zeros(self.num_classes, int(model.feature_dim), dtype=torch.float64, device=device)
        self.counts = torch.zeros(self.num_classes, dtype=torch.float64, device=device)
        self.protos = None
        if ex.cluster_protos is not None and ex.cluster_labels is not None and len(ex.cluster_labels) > 0:
            self.protos = torch.from_numpy(np.asarray(ex.cluster_protos, dtype=np.float32)).to(device)
            self.proto_labels = torch.from_numpy(np.asarray(ex.cluster_labels, dtype=np.int64)).to(device)
            self.unbiased = torch.from_numpy(np.asarray(ex.unbiased, dtype=np.float32)).to(device)
            self.has_proto = torch.from_numpy(np.asarray(ex.has_proto, dtype=bool)).to(device)

    def loss(self, model: MaskableModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = model.forward_features(x)
        loss = F.cross_entropy(getattr(model, model.classifier)(z), y)
        if self.protos is not None:
            loss = loss + fpl_regulariser(z, y, self.protos, self.proto_labels, self.unbiased, self.has_proto, self.tau)
        if self.calls >= self.collect_from:  # the last local epoch (FPL's agg_protos_label)
            onehot = F.one_hot(y, self.num_classes).to(torch.float64)
            self.sums += onehot.T @ z.detach().to(torch.float64)
            self.counts += onehot.sum(dim=0)
        self.calls += 1
        return loss

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        counts = self.counts.cpu().numpy()
        protos = self.sums.cpu().numpy() / np.maximum(counts, 1.0)[:, None]
        return {"fpl_protos": protos.astype(np.float32), "fpl_counts": counts.astype(np.int64)}


# --------------------------------------------------------------------------------------------------
# Strategy
# --------------------------------------------------------------------------------------------------

@register("fpl")
class FPL(FedAvg):
    summary = "full model, FedAvg + FINCH cluster-prototype contrastive and unbiased-prototype consistency losses"
    # the prototypes of the last round, from the first round on (none before any client sent one)
    state_keys = PROTO_KEYS

    @dataclass(frozen=True)
    class Options:
        tau: float = 0.02  # InfoNCE temperature (RethinkFL main.py --infoNCET)

        def __post_init__(self) -> None:
            check_number("algorithm.tau", self.tau, 0, low_open=True)

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict[str, Any]:
        tr = self.cfg.training
        n = self.ctx.federation.clients[client_id].n_samples
        protos: dict[str, Any] = {}
        side = 0
        if all(k in state.strategy_state for k in PROTO_KEYS):
            for k in PROTO_KEYS:
                protos[k.removeprefix("fpl_")] = state.strategy_state[k]  # shared read-only arrays
                side += int(state.strategy_state[k].nbytes)
        hook = call(FPLObjective, tau=float(self.opts.tau), num_classes=int(self.ctx.federation.num_classes),
                    collect_from=last_epoch_start(n, tr.batch_size, tr.local_epochs, tr.max_steps_per_epoch), **protos)
        return {"hooks": (hook,), "side_bytes_down": side}

    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> dict[str, Any]:
        """Cluster and unbiased prototypes of this round's clients (they replace the previous round's)."""
        extra = dict(state.strategy_state)
        extra.update(server_prototypes(results, int(self.ctx.federation.num_classes)))
        return extra
