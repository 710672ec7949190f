"""Local training of one virtual client under a :class:`ClientPlan` (pure; no Ray).

Sub-model training (docs/architecture.md#sub-model-training), chosen by ``plan.submodel``
(``training.submodel``):

- ``sliced`` (default): when the plan has a mask that a channel set describes exactly,
  :func:`fedsap_ray.models.sliced.sliced_model` gives a dense smaller network holding only the active
  channels (cached per scratch model and channel counts) and the map from its flat coordinates to
  the full ones. The client loads the covered values into it, trains it with the loop below and
  scatters the trained values back into the full-size vector; ``values = flat[plan.mask]`` as in
  masked mode. Gradient clipping acts on the sub-network (its norm over the sub-network's
  gradients equals the masked one, whose other gradients are zero); the hooks map between the
  two layouts themselves (:mod:`fedsap_ray.algorithms.hooks`, "Sliced sub-models"). Sliced and
  masked agree to float rounding (tests/models/test_sliced.py).
- ``masked``, and the fallback whatever the option: when no channel set describes the mask (NeFL's
  ``depth=true``), when the model cannot be rebuilt at other widths (not built by
  :func:`fedsap_ray.models.build_model`), or when a hook of the plan does not declare
  ``supports_sliced`` (MOON, FedSR and FPL send full models anyway, FedSPU restores frozen
  full-model coordinates, DapperFL prunes during training). The client holds a full-size model and
  trains the sub-model by masking: coordinates outside the plan's mask are set to zero before
  training and their gradients are zeroed after every backward pass. Zero weights, zero
  gradients, zero momentum and weight decay of a zero weight keep them exactly zero, and because a
  dropped channel's BN weight and bias are zero too its activation is exactly zero, so the forward
  pass equals that of the physically sliced sub-model (tested in tests/models/test_masks.py).

Either way only the covered coordinates are sent back, so BatchNorm running statistics of channels
the client did not train never reach the server (docs/architecture.md#batchnorm: statistics
follow their channel like parameters do). Each step's loss stays on the device and is read once
after training (no host synchronisation per step on CUDA).

Local update: mini-batch SGD with momentum and weight decay (papers/000 Appendix C) and
optional gradient-norm clipping (papers/003 section 4.1). This loop names no algorithm:
whatever a method adds (FedProx's proximal term, FedSAP's Eq. 7 and channel statistics,
SCAFFOLD's control variates, MOON, FedSR, FPL, FedSPU, DapperFL) is a client hook its
strategy lists in ``plan.hooks`` (:mod:`fedsap_ray.algorithms.hooks`), called
in that order at each point of the loop:

1. the hooks are built from the plan (``__init__``), then ``before_training`` runs on the
   scratch model (FedSAP's probe gradient), then the plan's values are loaded (zeros outside
   ``plan.mask``) and ``start`` runs (FedProx's anchor w^t, SCAFFOLD's corrections);
2. each local epoch: ``epoch_start`` (FedSAP's statistics watch the last epoch only), then
   for each batch: ``batch_start`` (FjORD's per-step width), the loss (one hook's ``loss``,
   else cross-entropy; then every hook's ``add_terms``), backward, mask the gradients to
   ``plan.mask``, ``after_backward`` (where statistics read gradients), clip the gradient norm (``grad_clip``), ``after_clip``
   (SCAFFOLD adds c - c_i there, so clipping never rescales it), the optimizer step (weight
   decay inside it), ``after_step``;
3. every hook's ``close`` in a ``finally`` (no module hook stays on the reused scratch model),
   then the trained values at ``plan.mask`` (or at the one hook's ``upload_mask``) and every
   hook's ``result`` in ``ClientResult.stats``.

Compiled steps (``resources.compile=train``, :mod:`fedsap_ray.engine.compiled`): the loop computes
``model(x)`` through a ``torch.compile``-d forward (and so a compiled backward), the rest of the loop as
above; a plan whose hooks do not all declare ``supports_compile`` trains eager, named in a warning. ``off``
(the default) passes the module itself: the eager loop, unchanged.

A plan without hooks runs the plain loop's arithmetic exactly. ``ClientResult.steps`` counts the
optimizer steps taken over all local epochs (SCAFFOLD's K) and ``ClientResult.samples_seen`` the
samples in their batches (skipped size-1 batches and steps beyond ``max_steps_per_epoch`` not
counted), from which the strategy computes the ``train_macs`` column (:meth:`Strategy.train_macs`).

Per-client overhead (issue 27). With many small clients (200 clients x 16 samples, cnn_small, one
thread, local backend, 4 rounds; py-spy, fractions of the time in ``Server.round``) forward,
backward and step were 71%; what could go was the first optimizer importing ``torch._dynamo`` in
round 1 (22% of the four rounds, several seconds on a loaded machine), each client's data gathered
from the pool and normalised again every round (``Federation.client_data`` and :func:`as_input`,
0.8%) and ``model.to(device)`` walking a module that is already there (0.7%). Hence
:class:`PreparedData` (a backend builds each client's normalised tensors once per run, within a
memory budget; ``as_input`` of a float tensor is the tensor itself, so the loop's own call then
costs nothing), :func:`warm_torch` (a backend pays the import when it starts) and :func:`to_device`.
After them the import is out of the rounds and the three costs are about 0.3% together (the first
round's builds). None of them changes what the loop computes: the same tensors, the same values, the
same order (tests/runtime/test_overhead.py). Still per client, and left: loading the plan's values
into the scratch model and flattening it back (1.1% and 0.7%), the copies any client needs.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fedsap_ray.algorithms.hooks import ClientHook, defines_loss, make_hooks, supports_sliced
from fedsap_ray.data.base import DomainData, as_input
from fedsap_ray.common.errors import ClientError
from fedsap_ray.engine.compiled import loss_model, record_new_files, training_forward
from fedsap_ray.models.masks import ParamLayout, TorchMask, mask_grads_
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.common.messages import ClientPlan, ClientResult
from fedsap_ray.models.sliced import SlicedModel, sliced_model


def pick_device(preference: str = "auto") -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def to_device(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to(device)`` unless every parameter and buffer is there already (the scratch models of a
    backend are: the full ``Module.to`` walk was 0.7% of a 200 x 16 round, module docstring)."""
    if any(t.device != device for t in itertools.chain(model.parameters(), model.buffers())):
        model.to(device)


def warm_torch() -> None:
    """Pay torch's one-time optimizer start-up now: the first ``torch.optim`` optimizer imports
    ``torch._dynamo`` (about 2 s, which otherwise lands in round 1). A throwaway SGD with momentum on a
    dummy parameter is built, zeroed and stepped; it draws no random numbers and leaves nothing behind."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt.step()
    opt.zero_grad(set_to_none=False)


class PreparedData:
    """Each client's training data as the loop consumes it (images through :func:`as_input`, on
    ``device``), built by ``build(client_id)`` once per run instead of every round it is selected.

    Kept while the prepared tensors total at most ``max_bytes`` (default
    :data:`PREPARED_BYTES`); a client beyond that is prepared on every call, as before, so a large
    dataset costs no more memory than ``max_bytes`` per backend or Ray worker. ``builds`` counts the
    calls of ``build`` (tests). Thread-safe: the local backend's threads share one. The tensors are
    handed to every round's training of the client, so the loop and the hooks only read them (they do:
    batches and FedSAP's probe index copies out of them)."""

    def __init__(self, build: Callable[[int], DomainData], device: torch.device, max_bytes: int | None = None) -> None:
        self.build, self.device = build, device
        self.max_bytes = PREPARED_BYTES if max_bytes is None else max_bytes
        self.builds = 0
        self.nbytes = 0
        self._data: dict[int, DomainData] = {}
        self._lock = threading.Lock()

    def get(self, client_id: int) -> DomainData:
        hit = self._data.get(client_id)
        if hit is not None:
            return hit
        raw = self.build(client_id)
        data = DomainData(as_input(raw.x.to(self.device)), raw.y.to(self.device))
        size = data.x.element_size() * data.x.nelement() + data.y.element_size() * data.y.nelement()
        with self._lock:
            self.builds += 1
            if client_id not in self._data and self.nbytes + size <= self.max_bytes:
                self._data[client_id] = data
                self.nbytes += size
        return data

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.nbytes = 0


#: The hint a diverged client's error ends with; the run's session names its own step sizes in it
#: (:func:`fedsap_ray.run.session.diverged`: in ``devices.mode=async`` also ``asynchronous.server_lr``).
DIVERGED_HINT = "diverged; lower training.lr?"

PREPARED_BYTES = 512 << 20  # per backend / Ray worker: room for a large round's prepared clients (issue 27)


def default_workers(torch_threads: int) -> int:
    """How many clients this machine trains at once, each with ``torch_threads`` intra-op threads."""
    return max(1, (os.cpu_count() or 1) // max(1, torch_threads))


def train_client(
    plan: ClientPlan,
    model: MaskableModel,
    layout: ParamLayout,
    data: DomainData,
    device: torch.device | None = None,
    compile: str = "off",
) -> ClientResult:
    """Run the plan on ``data`` with ``model`` (a scratch module, overwritten) and return the result.
    ``compile`` is ``resources.compile`` (:mod:`fedsap_ray.engine.compiled`; ``off``: the eager loop)."""
    try:
        return _train(plan, model, layout, data, device or torch.device("cpu"), compile)
    except ClientError:
        raise
    except Exception as e:  # errors carry round and client id (docs/architecture.md#design-rules)
        raise ClientError(f"client {plan.client_id} failed in round {plan.round}: {e.__class__.__name__}: {e}") from e


def _train(plan: ClientPlan, model: MaskableModel, layout: ParamLayout, data: DomainData, device: torch.device,
           compile: str = "off") -> ClientResult:
    t0 = time.perf_counter()
    to_device(model, device)
    sliced = _sliced_for(plan, model, layout)
    # the model the loop trains: the dense sub-network when sliced (module docstring), else the scratch model
    train_model, train_layout = (model, layout) if sliced is None else (sliced.model, sliced.layout)
    hooks: list[ClientHook] = []
    try:
        make_hooks(plan, model, layout, device, hooks, sliced)
        for h in hooks:
            h.before_training(model, data)  # always the full-size scratch model
        start = plan.start_vector()  # read only: plan.params itself for the full model
        if sliced is None:
            layout.load_into(model, start)
        else:
            to_device(train_model, device)
            train_layout.load_into(train_model, sliced.gather(start))
        for h in hooks:
            h.start(train_model)
        forward, compiled_as = training_forward(plan, train_model, compile)
        losses, steps, seen = _loop(plan, train_model, train_layout, data, device, hooks, None if sliced else plan.mask,
                                    forward)
        record_new_files(compiled_as)  # the digests of what this client's compile wrote (engine/compile_cache.py)
    finally:
        for h in hooks:
            h.close()  # the scratch model is reused: never leave hooks behind
    n = len(data.y)
    if not losses:
        raise ValueError(f"no training step ran ({n} samples, batch size {plan.batch_size})")
    # read once after training: the same float32 values as a per-step float(), averaged in float64; the sum
    # divided by the count is what np.mean computes (same reduction, same division) without its call
    # overhead, which showed in profiles of many small clients (issue 27)
    steps64 = torch.stack(losses).to("cpu", torch.float64).numpy()
    loss_mean = float(np.add.reduce(steps64) / steps64.size)
    if not np.isfinite(loss_mean):
        raise FloatingPointError(f"training loss is {loss_mean} ({DIVERGED_HINT})")
    flat = train_layout.flatten(train_model)
    if sliced is not None:
        flat = sliced.scatter_into(start, flat)
    chosen = [m for m in (h.upload_mask() for h in hooks) if m is not None]
    if len(chosen) > 1:
        raise ValueError(f"{len(chosen)} client hooks chose the upload mask; at most one may")
    if chosen and sliced is not None:
        raise ValueError("a client hook that chooses its own upload mask must not set supports_sliced")
    upload = chosen[0] if chosen else plan.mask
    values = flat if upload is None else flat[upload]
    stats: dict[str, np.ndarray] = {}
    for h in hooks:
        out = h.result(train_model)
        clash = sorted(set(out) & set(stats))
        if clash:
            raise ValueError(f"client hook {type(h).__name__} sends back {clash}, already sent by another hook")
        stats.update(out)
    return ClientResult(
        client_id=plan.client_id, round=plan.round, values=np.ascontiguousarray(values, dtype=np.float32),
        n_samples=n, train_loss=loss_mean, stats=stats, wall_s=time.perf_counter() - t0, steps=steps,
        samples_seen=seen, mask=upload, compile=compiled_as,
    )


def _sliced_for(plan: ClientPlan, model: MaskableModel, layout: ParamLayout) -> SlicedModel | None:
    """The sub-network to train instead of the masked full model, or None (masked; module docstring)."""
    if plan.submodel != "sliced" or plan.mask is None or not supports_sliced(plan):
        return None
    return sliced_model(model, layout, plan.mask)


def _loop(plan: ClientPlan, model: MaskableModel, layout: ParamLayout, data: DomainData, device: torch.device,
          hooks: list[ClientHook], mask: np.ndarray | None,
          forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[list[torch.Tensor], int, int]:
    """The local epochs on ``model`` (gradients masked to ``mask``, None for a full or sliced model):
    (per-step losses, kept on the device; optimizer steps over all epochs; samples in their batches).
    ``forward`` computes ``model(x)`` for the loss (the compiled forward, :mod:`fedsap_ray.engine.compiled`); a
    hook giving the base loss computes it through the same compiled network (``through``)."""
    forward = model if forward is None else forward
    through = loss_model(model, forward)
    params = [p for p in model.parameters()]
    grad_mask = None if mask is None else TorchMask.build(model, layout, mask)
    base = next((h for h in hooks if defines_loss(h)), None)  # at most one (make_hooks)
    opt = torch.optim.SGD(params, lr=plan.lr, momentum=plan.momentum, weight_decay=plan.weight_decay)
    x_all = as_input(data.x).to(device)
    y_all = data.y.to(device)
    n = len(y_all)
    gen = torch.Generator().manual_seed(plan.seed)
    model.train()
    losses: list[torch.Tensor] = []
    seen = 0  # samples in the batches of the steps taken (ClientResult.samples_seen)
    for epoch in range(plan.local_epochs):
        for h in hooks:
            h.epoch_start(model, epoch)
        order = torch.randperm(n, generator=gen).to(device)
        steps = 0
        for start_i in range(0, n, plan.batch_size):
            idx = order[start_i:start_i + plan.batch_size]
            if len(idx) < 2 and n >= 2:  # BatchNorm cannot train on a single sample
                continue
            opt.zero_grad(set_to_none=False)
            for h in hooks:
                h.batch_start(model, len(losses))
            x, y = x_all[idx], y_all[idx]
            loss = base.loss(through, x, y) if base is not None else None
            if loss is None:
                loss = F.cross_entropy(forward(x), y)
            for h in hooks:
                loss = h.add_terms(model, loss)
            loss.backward()
            if grad_mask is not None:
                mask_grads_(model, layout, grad_mask)
            for h in hooks:
                h.after_backward(model)
            if plan.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, plan.grad_clip)
            for h in hooks:
                h.after_clip(model)
            opt.step()
            for h in hooks:
                h.after_step(model)
            losses.append(loss.detach())
            seen += len(idx)
            steps += 1
            if plan.max_steps_per_epoch is not None and steps >= plan.max_steps_per_epoch:
                break
    return losses, len(losses), seen
