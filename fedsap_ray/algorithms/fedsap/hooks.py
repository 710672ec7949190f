"""FedSAP's client hooks: the channel statistics of Algorithm 1 line 6 and the DGA probe gradient.

- ``channel_stats`` (:class:`ChannelStatsHook`): a :class:`fedsap_ray.algorithms.fedsap.stats.ChannelStats` watches the
  LAST local epoch (forward hooks on the model's activation modules; gradients read after masking,
  before clipping) and sends back the keys its payload's ``keys`` names (of
  :data:`fedsap_ray.algorithms.fedsap.stats.STAT_KEYS`); the DGA layer is the payload's ``dga_layer`` (default
  ``conv1``). It only reads, so the trained values are the same bit for bit. On a sliced sub-network it
  watches the sub-network and scatters its statistics to the full channel space / DGA tensors, 0 on
  inactive channels (what masked training gives there: zero activation, zero masked gradient).
- ``dga_probe`` (:class:`DGAProbe`, ``dga_source=probe``): before training, the gradient of the probe
  model its payload describes (:func:`fedsap_ray.algorithms.fedsap.stats.probe_gradient`), sent back as
  ``dga_gradient``; the client loads the plan's values afterwards, so training is unaffected. It always
  runs on the full-size scratch model (``before_training``), so it supports sliced training as is.

FedSAP's Eq. 7 regulariser is the shared ``rep_norm`` hook (:mod:`fedsap_ray.algorithms.representation`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedsap_ray.algorithms.hooks import ClientHook, register_hook
from fedsap_ray.data.base import DomainData
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.models.sliced import SlicedModel, scatter_channel_values, scatter_tensor_values
from fedsap_ray.algorithms.fedsap.stats import ChannelStats, dga_param_names, probe_gradient

CHANNEL_STATS = "channel_stats"
DGA_PROBE = "dga_probe"


@dataclass(frozen=True)
class ChannelStatsPayload:
    keys: tuple[str, ...]  # the statistics to send back (of fedsap_ray.stats.STAT_KEYS)
    dga_layer: str = "conv1"  # the layer of the DGA gradient (algorithm.dga_layer)


@dataclass(frozen=True)
class ProbePayload:
    """The probe model (papers/000 Eq. 4's input under dga_source=probe): its values at its mask."""

    mask: np.ndarray  # bool [n_params]
    values: np.ndarray  # float32, the server parameters at the mask
    samples: int  # local samples the gradient averages over (algorithm.probe_samples)
    seed: int  # picks those samples (fixed per client)
    dga_layer: str = "conv1"

    def as_dict(self) -> dict[str, Any]:
        """What :func:`fedsap_ray.stats.probe_gradient` reads."""
        return {"mask": self.mask, "values": self.values, "samples": self.samples, "seed": self.seed}


@register_hook(CHANNEL_STATS)
class ChannelStatsHook(ClientHook):
    """:class:`ChannelStats` over the last local epoch; built (and checked) before training."""

    supports_sliced = True
    # forward hooks on the trained module: Dynamo traces them into the compiled graph, guarded on their presence
    # (fedsap_ray.engine.compiled._configure_dynamo), so the last epoch's hooks see every activation
    supports_compile = True
    Payload: ClassVar[type] = ChannelStatsPayload
    payload: ChannelStatsPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device,
                 sliced: SlicedModel | None = None) -> None:
        super().__init__(plan, model, layout, device, sliced)
        self.space = model.channel_space()
        self.dga_layer = self.payload.dga_layer
        watched = model if sliced is None else sliced.model  # the model the loop trains
        self.stats = ChannelStats(watched, watched.channel_space(), self.train_layout, tuple(self.payload.keys),
                                  self.dga_layer)
        self.collector: ChannelStats | None = None

    def epoch_start(self, model: MaskableModel, epoch: int) -> None:
        if epoch == self.plan.local_epochs - 1:
            self.collector = self.stats.start()

    def after_backward(self, model: MaskableModel) -> None:
        if self.collector is not None:
            self.collector.after_backward()

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        out = {} if self.collector is None else self.collector.result()
        if self.sliced is None:
            return out
        for key in ("channel_activation", "channel_gradient"):  # sub-network channels -> the full channel space
            if key in out:
                out[key] = scatter_channel_values(self.space, self.sliced.model.channel_space(),
                                                  self.sliced.channel_masks, out[key])
        if "dga_gradient" in out:
            out["dga_gradient"] = scatter_tensor_values(self.layout, self.sliced,
                                                        dga_param_names(self.layout, self.dga_layer), out["dga_gradient"])
        return out

    def close(self) -> None:
        if self.collector is not None:
            self.collector.stop()


@register_hook(DGA_PROBE)
class DGAProbe(ClientHook):
    """The probe model's DGA-layer gradient (``dga_gradient``), computed on the scratch model before training."""

    supports_sliced = True  # before_training gets the full-size scratch model and self.layout is its layout
    supports_compile = True  # its probe runs before training, eager, on the scratch model: the loop is untouched
    Payload: ClassVar[type] = ProbePayload
    payload: ProbePayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device,
                 sliced: SlicedModel | None = None) -> None:
        super().__init__(plan, model, layout, device, sliced)
        self.grad: np.ndarray | None = None

    def before_training(self, model: MaskableModel, data: DomainData) -> None:
        self.grad = probe_gradient(model, self.layout, self.payload.as_dict(), data, self.payload.dga_layer,
                                   self.plan.batch_size, self.device)

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        assert self.grad is not None  # before_training ran
        return {"dga_gradient": self.grad}
