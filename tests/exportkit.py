"""Helpers of the export tests: the dense sub-model a FedSAP client deploys, built by hand."""
from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from fedsap_ray.models.masks import ParamLayout, param_mask
from fedsap_ray.models import build_model
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.models.sliced import sliced_model

INPUT_SHAPES = {"mlp": (800,), "char_lstm": (80,), "cnn_emnist": (1, 28, 28)}  # every other model: (3, 32, 32)


def randomize_bn_(model: nn.Module, rng: np.random.Generator) -> None:
    """BatchNorm scale, shift and running statistics far from their initial 1/0, so that an export which ran BN on
    batch statistics, or dropped it, or folded it wrongly, computes other logits."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, c).astype(np.float32)))
                m.bias.copy_(torch.from_numpy(rng.normal(0, 0.2, c).astype(np.float32)))
                m.running_mean.copy_(torch.from_numpy(rng.normal(0, 0.2, c).astype(np.float32)))
                m.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2.0, c).astype(np.float32)))


def fedsap_like_submodel(name: str, *, width_mult: float = 0.0625, keep: float = 0.5, seed: int = 0,
                         full: MaskableModel | None = None) -> tuple[MaskableModel, MaskableModel]:
    """(the dense sub-model, the full model it was sliced from): each layer keeps a random subset of about ``keep`` of
    its channels (at least one; not a prefix, as FedSAP's channel choice), sliced with
    :func:`fedsap_ray.models.sliced.sliced_model` and holding the full model's values at those channels, in eval mode.
    The sub-model is a copy (the slicer's cached network is shared)."""
    rng = np.random.default_rng(seed)
    if full is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            full = build_model(name, num_classes=10, input_shape=INPUT_SHAPES.get(name, (3, 32, 32)),
                               width_mult=width_mult, vocab_size=95 if name == "char_lstm" else None)
        randomize_bn_(full, rng)
    layout = ParamLayout.from_model(full)
    space = full.channel_space()
    cm = {layer.name: rng.permutation(np.arange(layer.channels) < max(1, round(keep * layer.channels)))
          for layer in space.layers}
    sliced = sliced_model(full, layout, param_mask(space, layout, cm))
    assert sliced is not None, name
    sliced.layout.load_into(sliced.model, sliced.gather(layout.flatten(full)))
    return copy.deepcopy(sliced.model).eval(), full.eval()
