"""Per-channel statistics a FedSAP client uploads after local training (papers/000 Eq. 4-6, Algorithm 1 line 6).

:class:`ChannelStats` watches the LAST local epoch (docs/readings.md#statistics) and returns, as
float32 numpy arrays, only the keys it was asked for:

- ``channel_activation`` [space.total_channels], layers concatenated in ``space.layers``
  order: the mean |activation| of each channel over the epoch's samples (the r of
  Eq. 5 and the mu of Eq. 6). A sample's activation of a channel is the mean of
  |output| over its non-channel, non-batch positions (spatial positions of a conv/BN
  output; time steps of an LSTM output; a linear output has none). Which module
  outputs are read is the model's ``activation_modules()``: channels on dim 1 of the
  output, except ``nn.LSTM`` modules, whose output tuple's [0] has them on the last
  dim. When a layer lists several modules (ResNet streams: the stem BN and every block
  output of the stage) the value is the average of the per-module means.
- ``channel_gradient`` [space.total_channels]: for each channel, the L2 norm over all
  entries its channel owns in the layer's ``out`` parameter tensors (filters, biases,
  BN affine parameters, LSTM gate rows of all four blocks; buffers have no gradient) of
  the MEAN gradient over the epoch's optimiser steps (the h of Eq. 5). Entries map to
  channels by :class:`~fedsap_ray.models.space.ParamAxis`'s expansion
  (index ``b*C*group + c*group + j``).
- ``dga_gradient``: the mean gradient over the epoch's steps of every parameter whose
  name starts with ``f"{dga_prefix}."``, flattened and concatenated in layout order
  (the g_i of Eq. 4).

Gradients are read by :meth:`ChannelStats.after_backward`, which FedSAP's ``channel_stats``
client hook (:mod:`fedsap_ray.algorithms.fedsap.hooks`) calls at the client loop's
``after_backward`` point, after masking the gradients and before clipping: the gradient of
the local loss (cross entropy plus the loss terms of the plan's other hooks, e.g. Eq. 7;
weight decay is applied inside the optimiser and is not part of it). Dropped channels have zero output and zero (masked) gradient, so
their statistics are exactly 0. Collecting never changes the training numbers: hooks
only read detached outputs and gradients are copied, never modified.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsap_ray.algorithms.aggregation import scatter
from fedsap_ray.data.base import DomainData, as_input
from fedsap_ray.models.masks import ParamLayout, TorchMask, mask_grads_
from fedsap_ray.models.space import ChannelSpace

STAT_KEYS: tuple[str, ...] = ("channel_activation", "channel_gradient", "dga_gradient")


def dga_param_names(layout: ParamLayout, prefix: str) -> list[str]:
    """The trainable parameters of the DGA layer ``prefix`` (Eq. 4's g_i), in layout order; a ValueError
    naming the model's top-level modules when there are none."""
    names = [n for n, p in zip(layout.names, layout.is_param) if p and n.startswith(f"{prefix}.")]
    if not names:
        tops = sorted({n.split(".")[0] for n in layout.names})
        raise ValueError(f"no parameter starts with {prefix + '.'!r}; top-level modules are {tops}")
    return names


class ChannelStats:
    """Collect channel activations (forward hooks) and gradients (:meth:`after_backward`) over one epoch.

    Use as a context manager or with :meth:`start`/:meth:`stop`; hooks exist only between them.
    """

    def __init__(self, model: nn.Module, space: ChannelSpace, layout: ParamLayout, want: Sequence[str],
                 dga_prefix: str | None = None) -> None:
        want = tuple(want)
        unknown = [k for k in want if k not in STAT_KEYS]
        if unknown:
            raise ValueError(f"ChannelStats: unknown statistics {unknown}; known are {list(STAT_KEYS)}")
        self.model, self.space, self.layout, self.want = model, space, layout, want
        self.dga_prefix = dga_prefix
        params = dict(model.named_parameters())
        device = next(model.parameters()).device
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

        # activations: modules per layer, validated now so that a wrong name fails before training
        self._act_modules: dict[str, list[tuple[str, nn.Module]]] = {}
        if "channel_activation" in want:
            fn = getattr(model, "activation_modules", None)
            if fn is None:
                raise ValueError(f"ChannelStats: {type(model).__name__} has no activation_modules()")
            spec = fn()
            if set(spec) != set(space.names):
                raise ValueError(f"ChannelStats: activation_modules() names {sorted(spec)}, "
                                 f"channel layers are {list(space.names)}")
            mods = dict(model.named_modules())
            for layer in space.layers:
                names = spec[layer.name]
                if not names:
                    raise ValueError(f"ChannelStats: no activation module for layer {layer.name!r}")
                missing = [m for m in names if m not in mods]
                if missing:
                    raise ValueError(f"ChannelStats: layer {layer.name!r}: no submodules {missing}")
                self._act_modules[layer.name] = [(m, mods[m]) for m in names]
        # per layer: sum over (module, sample) of the per-sample mean |activation|, and the (module, sample) count
        self._act_sum = {n: torch.zeros(space.layer(n).channels, device=device) for n in self._act_modules}
        self._act_count = {n: 0 for n in self._act_modules}

        # gradients: every out-axis parameter (channel_gradient) and the DGA parameters, each summed once
        grad_names: list[str] = []
        if "channel_gradient" in want:
            space.validate(dict(zip(layout.names, layout.shapes)))
            grad_names += [ax.name for layer in space.layers for ax in layer.out if ax.name in params]
        self._dga_names: list[str] = []
        if "dga_gradient" in want:
            if not dga_prefix:
                raise ValueError("ChannelStats: dga_gradient needs a dga_prefix (the layer whose gradient is sent)")
            try:
                self._dga_names = dga_param_names(layout, dga_prefix)
            except ValueError as e:
                raise ValueError(f"ChannelStats: {e}") from None
            grad_names += self._dga_names
        self._grad_params = {n: params[n] for n in dict.fromkeys(grad_names)}
        self._grad_sum = {n: torch.zeros_like(p, memory_format=torch.contiguous_format)
                          for n, p in self._grad_params.items()}
        self._steps = 0

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> ChannelStats:
        if self._handles:
            raise RuntimeError("ChannelStats.start: already started")
        for layer_name, mods in self._act_modules.items():
            channels = self.space.layer(layer_name).channels
            for mod_name, mod in mods:
                self._handles.append(mod.register_forward_hook(self._hook(layer_name, mod_name, mod, channels)))
        return self

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> ChannelStats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- collection --------------------------------------------------------------------------------

    def _hook(self, layer_name: str, mod_name: str, mod: nn.Module, channels: int) -> Callable:
        acc = self._act_sum[layer_name]
        recurrent = isinstance(mod, nn.RNNBase)

        def fn(_m: nn.Module, _inputs: tuple, output: Any) -> None:
            out = output[0] if recurrent else output
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"ChannelStats: {mod_name!r} output is {type(out).__name__}, not a tensor")
            if recurrent and not _m.batch_first:
                out = out.transpose(0, 1)
            cdim = out.dim() - 1 if recurrent else 1
            if out.dim() < 2 or out.shape[cdim] != channels:
                raise ValueError(f"ChannelStats: {mod_name!r} output has shape {tuple(out.shape)}; layer "
                                 f"{layer_name!r} expects {channels} channels on dim {cdim}")
            with torch.no_grad():
                a = out.detach().abs()
                rest = tuple(d for d in range(1, a.dim()) if d != cdim)
                if rest:
                    a = a.mean(dim=rest)
                acc.add_(a.sum(dim=0).to(acc.dtype))
            self._act_count[layer_name] += int(out.shape[0])
        return fn

    def after_backward(self) -> None:
        """Add the current gradients (call once per optimiser step, after grad masking, before clipping)."""
        with torch.no_grad():
            for n, p in self._grad_params.items():
                if p.grad is not None:
                    self._grad_sum[n].add_(p.grad)
        self._steps += 1

    # --- result ----------------------------------------------------------------------------------

    def result(self, n_steps: int | None = None) -> dict[str, np.ndarray]:
        """The requested statistics as float32 numpy arrays (see the module docstring).

        ``n_steps``: optimiser steps the gradient means divide by (default: after_backward calls).
        """
        n_steps = self._steps if n_steps is None else int(n_steps)
        out: dict[str, np.ndarray] = {}
        if "channel_activation" in self.want:
            parts = []
            for layer in self.space.layers:
                cnt = self._act_count[layer.name]
                if cnt == 0:
                    raise ValueError(f"ChannelStats: no forward pass reached layer {layer.name!r}")
                parts.append((self._act_sum[layer.name] / cnt).cpu())
            out["channel_activation"] = torch.cat(parts).numpy().astype(np.float32)
        if "channel_gradient" in self.want or "dga_gradient" in self.want:
            if n_steps < 1:
                raise ValueError("ChannelStats: no step was recorded (call after_backward after each backward)")
        if "channel_gradient" in self.want:
            parts = []
            with torch.no_grad():
                for layer in self.space.layers:
                    sq = torch.zeros(layer.channels, dtype=torch.float64)
                    for ax in layer.out:
                        if ax.name not in self._grad_sum:
                            continue  # buffers (BN running statistics) have no gradient
                        g = (self._grad_sum[ax.name] / n_steps).to("cpu", torch.float64)
                        g2 = g.movedim(ax.axis, 0).reshape(ax.length(layer.channels), -1).pow(2).sum(dim=1)
                        # entry b*C*group + c*group + j belongs to channel c (ParamAxis.expand)
                        sq += g2.view(ax.blocks, layer.channels, ax.group).sum(dim=(0, 2))
                    parts.append(sq.sqrt())
            out["channel_gradient"] = torch.cat(parts).numpy().astype(np.float32)
        if "dga_gradient" in self.want:
            flat = [(self._grad_sum[n] / n_steps).reshape(-1).cpu() for n in self._dga_names]
            out["dga_gradient"] = torch.cat(flat).numpy().astype(np.float32)
        return out


def probe_gradient(model: nn.Module, layout: ParamLayout, probe: dict, data: DomainData, prefix: str,
                   batch_size: int, device: torch.device) -> np.ndarray:
    """FedSAP's ``dga_source=probe`` (an addition to papers/000 Eq. 4's input): the mean gradient of the
    cross-entropy of the probe model (``probe["values"]`` at ``probe["mask"]``, zeros elsewhere) on a
    fixed seeded subset of ``probe["samples"]`` local samples, for every parameter of ``prefix``,
    flattened in layout order (the same vector shape as ``dga_gradient``).

    Nothing is trained: ``model`` is scratch and the caller loads its own values afterwards. The
    batches run in training mode (BatchNorm on batch statistics), as local training does.
    """
    mask = np.asarray(probe["mask"], dtype=bool)
    layout.load_into(model, scatter(np.asarray(probe["values"], dtype=np.float32), mask, layout.size))
    model.to(device)
    model.train()
    n = len(data)
    gen = torch.Generator().manual_seed(int(probe["seed"]))
    idx = torch.randperm(n, generator=gen)[: min(n, int(probe["samples"]))]
    names = dga_param_names(layout, prefix)
    model.zero_grad(set_to_none=True)
    x_all, y_all = as_input(data.x[idx]).to(device), data.y[idx].to(device)
    for s in range(0, len(idx), batch_size):
        xb, yb = x_all[s:s + batch_size], y_all[s:s + batch_size]
        if len(yb) < 2 and len(idx) >= 2:  # BatchNorm cannot run on a single sample in training mode
            continue
        (torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum") / len(idx)).backward()
    mask_grads_(model, layout, TorchMask.build(model, layout, mask))
    params = dict(model.named_parameters())
    flat = []
    for nm in names:
        grad = params[nm].grad
        assert grad is not None, f"probe_gradient: {nm} got no gradient"
        flat.append(grad.detach().reshape(-1).cpu())
    out = torch.cat(flat).numpy().astype(np.float32)
    model.zero_grad(set_to_none=True)
    return out
