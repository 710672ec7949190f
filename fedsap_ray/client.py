"""Local training of one virtual client under a :class:`ClientPlan` (pure; no Ray).

The client holds a full-size model and trains the sub-model by masking: coordinates
outside the plan's mask are set to zero before training and their gradients are zeroed
after every backward pass. Zero weights, zero gradients, zero momentum and weight
decay of a zero weight keep them exactly zero, and because a dropped channel's BN
weight and bias are zero too its activation is exactly zero, so the forward pass equals
that of the physically sliced sub-model (tested in tests/test_masks.py). Only the
covered coordinates are sent back, so BatchNorm running statistics of channels the
client did not train never reach the server (docs/architecture.md#batchnorm: statistics
follow their channel like parameters do).

Local update: mini-batch SGD with momentum and weight decay (papers/000 Appendix C),
optional gradient-norm clipping (papers/003 section 4.1) and the FedProx proximal
term (mu/2)||w - w^t||^2 (Li et al. 2020, Eq. 2) over the covered coordinates, and
FedSAP's representation regulariser (gamma/|B|) sum_x ||f_enc(x)||^2 (papers/000 Eq. 7).

SCAFFOLD control variates (Karimireddy et al. 2020, Algorithm 1 line 10): when
``plan.extra["control"]`` holds the correction c - c_i (float32, one value per
coordinate of the flat :class:`ParamLayout` vector), every step uses
y <- y - lr (g_i(y) + c - c_i). Order after each backward pass: mask the gradients,
clip the raw stochastic gradient's norm (``grad_clip``), THEN add the correction (so
clipping never rescales the control variate), and the optimizer adds weight decay inside
``step``. Only nn.Parameters get a correction (BatchNorm running statistics are not
trained by gradients), and coordinates outside ``plan.mask`` get none. Without a control
the arithmetic is exactly the plain loop's. ``ClientResult.steps`` counts the optimizer
steps taken over all local epochs (SCAFFOLD's K) and ``ClientResult.samples_seen`` the samples in
their batches (skipped size-1 batches and steps beyond ``max_steps_per_epoch`` not counted), from
which the strategy computes the ``train_macs`` column (:meth:`Strategy.train_macs`).

Statistics: when ``plan.stats`` names any of :data:`fedsap_ray.stats.STAT_KEYS`, a
:class:`fedsap_ray.stats.ChannelStats` watches the LAST local epoch (forward hooks on the
model's activation modules; gradients read after masking, before clipping; the DGA
layer is ``plan.extra["dga_layer"]``, default ``conv1``) and its arrays go into
``ClientResult.stats``. It only reads, so the trained values are the same bit for bit;
with no statistics requested nothing is hooked or copied. ``plan.extra["probe"]`` (FedSAP's
``dga_source=probe``) computes :func:`fedsap_ray.stats.probe_gradient` before training and
returns it as ``dga_gradient``; the model is reloaded from the plan afterwards, so training is
unaffected.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsap_ray.aggregation import scatter
from fedsap_ray.algorithms.objectives import make_objective
from fedsap_ray.data.base import DomainData, as_input
from fedsap_ray.errors import ClientError
from fedsap_ray.masks import ParamLayout, TorchMask, mask_grads_
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.messages import ClientPlan, ClientResult
from fedsap_ray.stats import STAT_KEYS, ChannelStats, probe_gradient


def pick_device(preference: str = "auto") -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def default_workers(torch_threads: int) -> int:
    """How many clients this machine trains at once, each with ``torch_threads`` intra-op threads."""
    return max(1, (os.cpu_count() or 1) // max(1, torch_threads))


def train_client(
    plan: ClientPlan,
    model: MaskableModel,
    layout: ParamLayout,
    data: DomainData,
    device: torch.device | None = None,
) -> ClientResult:
    """Run the plan on ``data`` with ``model`` (a scratch module, overwritten) and return the result."""
    try:
        return _train(plan, model, layout, data, device or torch.device("cpu"))
    except ClientError:
        raise
    except Exception as e:  # errors carry round and client id (docs/architecture.md#design-rules)
        raise ClientError(f"client {plan.client_id} failed in round {plan.round}: {e.__class__.__name__}: {e}") from e


def _train(plan: ClientPlan, model: MaskableModel, layout: ParamLayout, data: DomainData, device: torch.device) -> ClientResult:
    unknown = [s for s in plan.stats if s not in STAT_KEYS]
    if unknown:
        raise ValueError(f"unknown statistics requested: {unknown}")
    t0 = time.perf_counter()
    probe = plan.extra.get("probe")  # FedSAP dga_source=probe: a gradient of the received probe model, before training
    probe_grad = (None if probe is None else
                  probe_gradient(model, layout, probe, data, plan.extra.get("dga_layer", "conv1"), plan.batch_size, device))
    start = scatter(plan.values, plan.mask, layout.size)
    model.to(device)
    layout.load_into(model, start)
    params = [p for p in model.parameters()]
    tmask = None if plan.mask is None else TorchMask.build(model, layout, plan.mask)
    anchor = [p.detach().clone() for p in params] if plan.prox_mu > 0 else None
    corrections = _control_tensors(plan, model, layout, device)
    objective = make_objective(plan, model, layout, device)  # a strategy's own local loss and hooks

    opt = torch.optim.SGD(params, lr=plan.lr, momentum=plan.momentum, weight_decay=plan.weight_decay)
    x_all = as_input(data.x).to(device)
    y_all = data.y.to(device)
    n = len(y_all)
    gen = torch.Generator().manual_seed(plan.seed)
    model.train()
    losses: list[float] = []
    # built (and checked) before training; it watches the last local epoch only
    stats_all = (ChannelStats(model, model.channel_space(), layout, plan.stats, plan.extra.get("dga_layer", "conv1"))
                 if plan.stats else None)
    collector: ChannelStats | None = None
    steps = 0
    seen = 0  # samples in the batches of the steps taken (ClientResult.samples_seen)
    try:
        for epoch in range(plan.local_epochs):
            if stats_all is not None and epoch == plan.local_epochs - 1:
                collector = stats_all.start()
            order = torch.randperm(n, generator=gen).to(device)
            steps = 0
            for start_i in range(0, n, plan.batch_size):
                idx = order[start_i:start_i + plan.batch_size]
                if len(idx) < 2 and n >= 2:  # BatchNorm cannot train on a single sample
                    continue
                opt.zero_grad(set_to_none=False)
                if objective is None:
                    loss = _objective(model, x_all[idx], y_all[idx], plan.rep_gamma)
                else:
                    loss = objective.loss(model, x_all[idx], y_all[idx])
                if anchor is not None:
                    prox = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
                    loss = loss + 0.5 * plan.prox_mu * prox
                loss.backward()
                if tmask is not None:
                    mask_grads_(model, layout, tmask)
                if collector is not None:
                    collector.after_backward()
                if objective is not None:
                    objective.after_backward(model)
                if plan.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, plan.grad_clip)
                if corrections is not None:  # SCAFFOLD: g_i(y) + c - c_i, after clipping g_i(y)
                    for p, corr in corrections:
                        assert p.grad is not None  # corrections cover trained parameters only
                        p.grad.add_(corr)
                opt.step()
                if objective is not None:
                    objective.after_step(model)
                losses.append(float(loss.detach()))
                seen += len(idx)
                steps += 1
                if plan.max_steps_per_epoch is not None and steps >= plan.max_steps_per_epoch:
                    break
    finally:
        if collector is not None:
            collector.stop()  # the scratch model is reused: never leave hooks behind
    if not losses:
        raise ValueError(f"no training step ran ({n} samples, batch size {plan.batch_size})")
    loss_mean = float(np.mean(losses))
    if not np.isfinite(loss_mean):
        raise FloatingPointError(f"training loss is {loss_mean} (diverged; lower training.lr?)")
    flat = layout.flatten(model)
    upload = None if objective is None else objective.upload_mask()
    if upload is None:
        upload = plan.mask
    values = flat if upload is None else flat[upload]
    stats = {} if collector is None else collector.result(steps)
    if probe_grad is not None:
        stats["dga_gradient"] = probe_grad
    if objective is not None:
        stats.update(objective.result(model))
    return ClientResult(
        client_id=plan.client_id, round=plan.round, values=np.ascontiguousarray(values, dtype=np.float32),
        n_samples=n, train_loss=loss_mean, stats=stats, wall_s=time.perf_counter() - t0, steps=len(losses),
        samples_seen=seen,
    )


def _control_tensors(plan: ClientPlan, model: MaskableModel, layout: ParamLayout,
                     device: torch.device) -> list[tuple[nn.Parameter, torch.Tensor]] | None:
    """(parameter, correction) pairs from ``plan.extra["control"]`` (None when absent), built once per plan.

    Buffer coordinates of the flat vector are ignored; coordinates outside ``plan.mask`` are zeroed
    so a masked-out coordinate stays exactly where it was.
    """
    control = plan.extra.get("control")
    if control is None:
        return None
    control = np.asarray(control)
    if control.dtype != np.float32 or control.shape != (layout.size,):
        raise ValueError(f"plan.extra['control'] must be float32 of shape ({layout.size},), "
                         f"got {control.dtype} {control.shape}")
    if plan.mask is not None:
        control = np.where(plan.mask, control, np.float32(0.0))
    out = []
    for name, p in model.named_parameters():
        corr = torch.from_numpy(np.ascontiguousarray(layout.slice(name, control))).to(device=device, dtype=p.dtype)
        out.append((p, corr))
    return out


def _objective(model: MaskableModel, x: torch.Tensor, y: torch.Tensor, rep_gamma: float) -> torch.Tensor:
    """Cross-entropy, plus papers/000 Eq. 7's (gamma/|B|) sum_x ||f_enc(x)||_2^2 when gamma > 0."""
    if rep_gamma <= 0:
        return F.cross_entropy(model(x), y)
    feats = model.forward_features(x)
    logits = getattr(model, model.classifier)(feats)
    return F.cross_entropy(logits, y) + rep_gamma * feats.pow(2).sum(dim=1).mean()
