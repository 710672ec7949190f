"""Held-out evaluation: per-domain top-1 accuracy and mean cross-entropy (the ``rounds`` table,
docs/reference/results.md#rounds), for the server's models and for the model each client deploys.

The ``deployed`` eval mode judges what a device would actually run: client i's own model at
its own mask (:meth:`fedsap_ray.algorithms.contract.Strategy.deployed_model`), on its own domain's
test split. It is run as the device would run it, at the device's cost (issue 27): when a channel
set describes the mask, as the dense sliced sub-network (:func:`fedsap_ray.models.sliced.sliced_model`, the
same one the client trains; ``training.submodel=sliced``, the default), else, and with
``training.submodel=masked``, as the masked full-size model with the uncovered coordinates zeroed,
which computes the sliced sub-model's outputs to float rounding (a dropped channel's weights, BN
scale and shift are zero, so its activation is zero; tests/engine/test_deployed_eval.py checks both against
a sub-model it builds by hand). At the laptop preset's mean capacity of 0.6 the sliced network
costs about half the masked one's multiply-accumulates.

Nothing is evaluated twice: clients that would run identical parameters on one domain are evaluated
once (with their own BN statistics only when the model has BatchNorm: without it the client's data
cannot change the model), and so are the server's eval modes that evaluate the same parameters on
a domain (FedSAP's ``group`` and ``global_only`` during warm-up; :func:`evaluate_modes`).

BatchNorm (``training.deployed_bn``, docs/readings.md#deployed-evaluation): by default (``client``) a
deployed model's BN running statistics are recomputed on the client's own training data with its own
sub-model before it is evaluated, as a device running that sub-model would hold them (HeteroFL's static
BN queries local data the same way, Diao et al. 2021 section 3). The aggregated running statistics
(``aggregated``) average over clients whose wider models feed each channel from more inputs, so they do
not fit a narrow sub-model: after 6 laptop rounds of HeteroFL a keep-0.2 client scored 9.0% with them
and 71.8% with its own (``python benchmarks/deployed_bn.py``; docs/readings.md#deployed-evaluation).

Reading (docs/readings.md#deployed-evaluation): where the federation has one domain only (a
label-skew partition of one dataset), "its own held-out share" is the domain's test split
reweighted to the client's training label distribution: sum_k pi_ik acc_k, with acc_k the
accuracy on test class k, i.e. the expected accuracy on test data drawn like the client's own.
"""
from __future__ import annotations

import copy
import hashlib
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar
from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from fedsap_ray.data.base import DomainData, as_input
from fedsap_ray.engine.compiled import eval_forward
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.models.sliced import sliced_model

K = TypeVar("K")
V = TypeVar("V")


#: Test images per forward pass. Evaluation is a forward pass per image, so the batch only changes how
#: the work is cut: on the CPU smaller batches stay in cache and run faster (``benchmarks/eval_speed.py``;
#: docs/guides/performance.md has the figures). Figures change by float rounding only (the summation
#: order of the loss and the kernels' blocking), never an accuracy (golden-number check).
INFER_BATCH = 128


def inference_module(model: nn.Module, device: torch.device) -> tuple[nn.Module, torch.memory_format]:
    """``model`` (parameters loaded, in eval mode) as evaluation runs its forward pass, and the memory format of
    its inputs. Two changes, neither of which changes what is computed beyond float rounding:

    - each (convolution, BatchNorm) pair the model lists (``MaskableModel.conv_bn_pairs``) is folded into one
      convolution (:func:`torch.nn.utils.fusion.fuse_conv_bn_eval`: W' = W g / sqrt(v + eps),
      b' = (b - m) g / sqrt(v + eps) + beta, the eval-mode BN's affine map with running mean m and variance v),
      on a copy, so the scratch model is untouched: no BatchNorm pass at evaluation (faster per batch, the
      largest difference in the logits 1e-8; in the default job's whole evaluation it did not show: the figures
      are in docs/guides/performance.md);
    - a network with a 2-d convolution runs channels-last (the layout oneDNN and cuDNN convolve in without a
      reorder per layer), others contiguous.
    """
    pairs = model.conv_bn_pairs() if isinstance(model, MaskableModel) and not model.training else []
    net = copy.deepcopy(model) if pairs else model
    for conv_name, bn_name in pairs:
        conv, bn = net.get_submodule(conv_name), net.get_submodule(bn_name)
        assert isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d), (conv_name, bn_name)
        net.set_submodule(conv_name, fuse_conv_bn_eval(conv, bn))
        net.set_submodule(bn_name, nn.Identity())
    net.to(device)
    if any(isinstance(m, nn.Conv2d) for m in net.modules()):
        net.to(memory_format=torch.channels_last)
        return net, torch.channels_last
    return net, torch.contiguous_format


def _batch(x: torch.Tensor, device: torch.device, fmt: torch.memory_format) -> torch.Tensor:
    """A batch of stored inputs as the model takes them: float, on ``device``, in ``fmt`` when 4-d."""
    x = as_input(x).to(device)
    return x.contiguous(memory_format=fmt) if x.dim() == 4 else x


@torch.no_grad()
def evaluate(model: nn.Module, layout: ParamLayout, params: np.ndarray, data: DomainData,
             device: torch.device, batch_size: int | None = None, compile: str = "off") -> tuple[float, float]:
    """(accuracy, loss) of ``params`` on ``data``; BatchNorm uses the aggregated running statistics
    (``batch_size``: images per forward pass, default :data:`INFER_BATCH`; ``compile``: ``resources.compile``,
    :func:`fedsap_ray.engine.compiled.eval_forward`)."""
    batch_size = batch_size or INFER_BATCH
    model.to(device)
    layout.load_into(model, params)
    model.eval()
    net, fmt = inference_module(model, device)
    forward = eval_forward(net, compile)
    correct, loss_sum, n = 0, 0.0, len(data)
    for i in range(0, n, batch_size):
        x = _batch(data.x[i:i + batch_size], device, fmt)
        y = data.y[i:i + batch_size].to(device)
        out = forward(x)
        loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
    return correct / max(n, 1), loss_sum / max(n, 1)


@torch.no_grad()
def evaluate_by_class(model: nn.Module, layout: ParamLayout, params: np.ndarray, data: DomainData,
                      device: torch.device, num_classes: int, batch_size: int | None = None,
                      compile: str = "off") -> np.ndarray:
    """Per test class: [n, correct, loss sum] (shape [num_classes, 3], float64) of ``params`` on ``data``
    (``compile`` as in :func:`evaluate`)."""
    batch_size = batch_size or INFER_BATCH
    model.to(device)
    layout.load_into(model, params)
    model.eval()
    net, fmt = inference_module(model, device)
    forward = eval_forward(net, compile)
    out = torch.zeros(num_classes, 3, dtype=torch.float64)
    for i in range(0, len(data), batch_size):
        x = _batch(data.x[i:i + batch_size], device, fmt)
        y = data.y[i:i + batch_size].to(device)
        logits = forward(x)
        loss = F.cross_entropy(logits, y, reduction="none").double().cpu()
        hit = (logits.argmax(1) == y).double().cpu()
        yc = y.cpu()
        out[:, 0].index_add_(0, yc, torch.ones_like(hit))
        out[:, 1].index_add_(0, yc, hit)
        out[:, 2].index_add_(0, yc, loss)
    return out.numpy()


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` holds a BatchNorm layer (whose running statistics a client's data can change)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def digest(vec: np.ndarray) -> bytes:
    """A 128-bit fingerprint of a parameter vector's bytes (identical vectors are evaluated once)."""
    return hashlib.blake2b(np.ascontiguousarray(vec).view(np.uint8).data, digest_size=16).digest()


@torch.no_grad()
def calibrate_bn_(model: nn.Module, data: DomainData, device: torch.device, batch_size: int = 1024) -> bool:
    """Replace ``model``'s BN running statistics by those of ``data`` (cumulative average over batches of
    ``batch_size``, parameters untouched); False when the model has no BatchNorm layer."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return False
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average: every batch counts the same
    # contiguous, as a client trains: train-mode BN's batch statistics computed channels-last differ by
    # up to ~4e-4 relative (measured), enough to move a deployed figure, so calibration keeps the layout
    model.to(device).to(memory_format=torch.contiguous_format)
    model.train()
    try:
        for i in range(0, len(data), batch_size):
            x = _batch(data.x[i:i + batch_size], device, torch.contiguous_format)
            if len(x) > 1:
                model(x)
    finally:
        for m, mom in zip(bns, momenta):
            m.momentum = mom
        model.eval()
    return True


@dataclass(frozen=True)
class DeployedModel:
    """What client ``client_id`` would run: full-size ``params`` restricted to ``mask`` (None: all of it)."""

    client_id: int
    domain: str
    params: np.ndarray
    mask: np.ndarray | None


def masked(params: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The full-size vector of the sub-model ``mask`` covers: uncovered coordinates zeroed."""
    return params if mask is None else np.where(mask, params, np.float32(0.0)).astype(np.float32, copy=False)


def evaluate_deployed(scratch: list[nn.Module], layout: ParamLayout, models: list[DeployedModel],
                      test: dict[str, DomainData], device: torch.device, num_classes: int,
                      label_weights: dict[int, np.ndarray] | None = None,
                      bn_data: dict[int, DomainData] | None = None,
                      sliced: bool = True, compile: str = "off") -> dict[int, tuple[float, float]]:
    """(accuracy, loss) per client of its deployed model on its domain's test split.

    ``label_weights`` (one domain only, module docstring): client id -> its training label counts;
    the client's figures are then the class-wise figures weighted by its label distribution.
    ``bn_data``: client id -> its training data, on which the deployed model's BN statistics are
    recomputed first (``training.deployed_bn=client``); in the masked full-size model the uncovered
    coordinates are zeroed again afterwards, so the result is the sliced sub-model's with its own
    statistics. ``sliced``: run a mask that a channel set describes as the dense sub-network (module
    docstring; False: always the masked full-size model, the reference); ``compile`` as in :func:`evaluate`
    (BN recalibration stays eager: it runs a train-mode forward once per job).
    Identical (domain, parameters[, client when BN statistics are recomputed]) jobs are evaluated once;
    jobs run concurrently on the scratch modules, so the numbers do not depend on how many there are.
    """
    own_bn = bn_data is not None and bool(scratch) and has_batchnorm(scratch[0])
    jobs: dict[tuple, DeployedModel] = {}
    key_of: dict[int, tuple] = {}
    # the same (params, mask) objects give the same vector: masked and hashed once, not once per client
    # (every client of one width deploys the same cached mask of the same global model, and hashing a
    # paper-width model per client showed in the round: issue 42)
    seen: dict[tuple[int, int], tuple[np.ndarray, bytes]] = {}
    for m in models:
        ident = (id(m.params), id(m.mask))
        if ident not in seen:
            v = masked(m.params, m.mask)
            seen[ident] = (v, digest(v))
        vec, fingerprint = seen[ident]
        key: tuple = (m.domain, fingerprint)
        if own_bn:
            key += (m.client_id,)  # statistics of the client's own data: one job per client
        jobs.setdefault(key, DeployedModel(m.client_id, m.domain, vec, m.mask))
        key_of[m.client_id] = key

    def one(mod: nn.Module, key: tuple) -> np.ndarray:
        job = jobs[key]
        net, net_layout, vec = deployed_network(mod, layout, job, device,
                                                bn_data[job.client_id] if own_bn and bn_data is not None else None,
                                                sliced=sliced)
        return evaluate_by_class(net, net_layout, vec, test[job.domain], device, num_classes, compile=compile)

    tables = on_scratch(scratch, list(jobs), one)
    return {m.client_id: client_figures(tables[key_of[m.client_id]],
                                        None if label_weights is None else label_weights[m.client_id])
            for m in models}


def deployed_network(model: nn.Module, layout: ParamLayout, job: DeployedModel, device: torch.device,
                     bn_data: DomainData | None = None, *, sliced: bool = True) -> tuple[nn.Module, ParamLayout, np.ndarray]:
    """(network, its layout, its flat vector) of what ``job``'s client runs, as :func:`evaluate_deployed` evaluates
    it (and :func:`fedsap_ray.results.kept.load_model` rebuilds it, so the two cannot drift apart): the dense
    sliced sub-network when ``sliced`` and a channel set describes ``job.mask``, else ``model`` itself with
    ``job.params`` (uncovered coordinates already zeroed, :func:`masked`); ``bn_data``: the client's training
    data, on which the BN running statistics are recomputed first (:func:`calibrate_bn_`; the masked model's
    uncovered coordinates are zeroed again afterwards). ``model`` is a scratch module (its state is overwritten)."""
    sub = sliced_model(model, layout, job.mask) if sliced and job.mask is not None else None  # type: ignore[arg-type]
    net, net_layout, vec = (model, layout, job.params) if sub is None else (sub.model, sub.layout, sub.gather(job.params))
    if bn_data is not None:
        net.to(device)
        net_layout.load_into(net, vec)
        if calibrate_bn_(net, bn_data, device):
            vec = net_layout.flatten(net)
            if sub is None:
                vec = masked(vec, job.mask)
    return net, net_layout, vec


def client_figures(table: np.ndarray, label_weights: np.ndarray | None = None) -> tuple[float, float]:
    """(accuracy, loss) of one deployed model from its per-class table (:func:`evaluate_by_class`): over every
    test sample, or, with ``label_weights`` (the client's training label counts; one-domain federations, module
    docstring), the class-wise figures weighted by the client's label distribution."""
    n, correct, loss = table[:, 0], table[:, 1], table[:, 2]
    if label_weights is None:
        return float(correct.sum() / max(n.sum(), 1)), float(loss.sum() / max(n.sum(), 1))
    w = np.asarray(label_weights, dtype=np.float64) * (n > 0)
    w = w / w.sum() if w.sum() > 0 else (n > 0) / max(int((n > 0).sum()), 1)
    safe = np.maximum(n, 1)
    return float((w * correct / safe).sum()), float((w * loss / safe).sum())


def evaluate_modes(scratch: list[nn.Module], layout: ParamLayout, sets: Mapping[str, Mapping[str, np.ndarray]],
                   test: dict[str, DomainData], device: torch.device,
                   compile: str = "off") -> dict[str, dict[str, tuple[float, float]]]:
    """(accuracy, loss) per eval mode and test domain of the server's models (``Strategy.eval_sets``).

    Every distinct (domain, parameters) pair is evaluated once, whichever modes share it, one pair per
    scratch module concurrently (threads): a pair's figures depend on the pair only, so they equal a
    serial loop's over modes and domains.
    """
    key_of = {(mode, d): (d, digest(models[d])) for mode, models in sets.items() for d in test}
    params = {key: sets[mode][d] for (mode, d), key in key_of.items()}
    figures = on_scratch(scratch, list(params), lambda m, key: evaluate(m, layout, params[key], test[key[0]], device,
                                                                           compile=compile))
    return {mode: {d: figures[key_of[(mode, d)]] for d in test} for mode in sets}


def on_scratch(scratch: list[nn.Module], keys: list[K], fn: Callable[[nn.Module, K], V]) -> dict[K, V]:
    """``fn(module, key)`` for every key, each call holding one scratch module of its own, as many at once as
    there are modules (threads); every result depends on its key only, so the numbers equal a serial loop's."""
    pool: queue.SimpleQueue = queue.SimpleQueue()
    for m in scratch:
        pool.put(m)

    def one(key: K) -> V:
        m = pool.get()
        try:
            return fn(m, key)
        finally:
            pool.put(m)

    if len(scratch) <= 1 or len(keys) <= 1:
        return {k: one(k) for k in keys}
    with ThreadPoolExecutor(min(len(scratch), len(keys))) as ex:
        return dict(zip(keys, ex.map(one, keys)))


def summarise(per_domain: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Global accuracy = unweighted mean over domains at this round (papers/000 section 5)."""
    accs = np.array([a for a, _ in per_domain.values()])
    losses = np.array([loss for _, loss in per_domain.values()])
    return {"global_accuracy": float(accs.mean()), "loss": float(losses.mean()),
            "worst_domain_accuracy": float(accs.min())}
