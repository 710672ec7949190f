"""NeFL (Kang et al., IEEE TMC 2025, "NeFL: Nested Model Scaling for Federated Learning with
System Heterogeneous Clients") at each client's capacity (papers/000 Table 1).

Default (``depth=false``): width-only nesting (NeFL-W), the leading ceil(kappa_i C_l) channels of
every layer, i.e. the HeteroFL sub-model at kappa_i. That is the NeFL setting of the comparison
FedSAP follows (DapperFL's NeFL baseline, whose budgets never skip blocks); with FedSAP's budgets
the depth rule below would skip ``layer1.0`` on every ResNet10 client below kappa = 1 and all five
identity blocks of ResNet18 at kappa 0.2 and 0.4 (issue 13).

``depth=true`` (this simulator's earlier default): NeFL cuts nested sub-models out of one global
model in depth AND width: a sub-model skips some residual blocks and keeps the leading channels of
the others, and the server
averages every coordinate over the sub-models that contain it (NeFL's NeFedAvg, which
for a coordinate is papers/003 Algorithm 1 line 18; :class:`~fedsap_ray.algorithms.channel_subsets.ChannelSubsetStrategy`).

Budget. Client i with capacity kappa_i (= 1 - pruning ratio; kappa_i = 1: full model)
gets the parameter budget of the width-only nested sub-model at kappa_i,
B = trainable parameters of the leading ceil(kappa_i C_l) channels of every layer
(:func:`fedsap_ray.models.masks.params_in_mask` over nn.Parameters, BN running statistics not
counted), i.e. NeFL's model-size ratio gamma = B / P (P: the full model's count).

Depth/width split (NeFL-WD). NeFL writes gamma = gamma_W * gamma_D (width and depth
shares of the parameter ratio); its published NeFL-WD sub-models of ResNet34/56/110
split the two evenly, gamma_W ~ gamma_D ~ sqrt(gamma) (the sub-model tables published
with NeFL's code, "Details on architectures of submodels"), so ``depth_share`` = 0.5 by
default, with

1. depth: skip skippable blocks from the deepest one backwards (NeFL's depthwise
   sub-models of ResNet18/56/110 drop later blocks first) while the full-width model without them
   still holds at least P * gamma^depth_share trainable parameters; stop at the first
   block whose removal would go below (so a large deep block is never traded for
   several shallow ones);
2. width: the largest nested width p in [kappa_i, 1] whose sub-model without the skipped
   blocks holds at most B trainable parameters (p = kappa_i always fits, so the count
   never exceeds the budget; the search runs over every breakpoint k / C_l at which a
   layer's ceil(p C_l) changes).

``depth_share`` only acts with ``depth=true``. ``depth_share = 0`` is width-only nesting (NeFL-W,
the HeteroFL sub-models, the same as ``depth=false``); ``depth_share = 1`` skips as deep as the budget
allows before narrowing. On ResNet18 the
default reproduces NeFL's ResNet18 NeFL-WD table for gamma = 0.4, 0.6, 0.8 (width only:
removing layer4.1 alone would leave gamma_D = 0.58 < sqrt(gamma)); at gamma = 0.2 it
skips layer4.1 and layer3.1 where NeFL's table skips layer4.1 only.

Skippable blocks. A residual block can be left out exactly when its shortcut is the
identity (a :class:`~fedsap_ray.models.resnet.BasicBlock` whose ``shortcut`` is empty,
found from the module structure): its residual branch (conv1, bn1, conv2, bn2) is left
out of the mask, so on the client those weights and the BN scale and bias are 0, the
branch outputs exactly 0 (train and eval mode), and the block computes relu(x) = x on its
input, which is always post-ReLU here: an exact identity (tests/algorithms/test_nefl.py). ResNet18
has 5 such blocks (layer1.0, layer1.1, layer2.1, layer3.1, layer4.1), ResNet10 only
layer1.0. Blocks with a projection shortcut are never skipped: without its branch such a
block still computes relu(shortcut(x)), not an identity (NeFL's depthwise ResNet18
sub-models do drop them, relying on its step sizes). Models without
residual blocks (cnn_small, the CNNs, the MLP, the LSTM) fall back to width-only nesting.
A skipped block appears in the channel masks as an empty inner channel layer
(``layerS.B.conv1`` all False), which is how aggregation and the MAC count see it.

Weighting (``weighting``). NeFL's code (honggkang/NeFL, ``utils/NeFedAvg.py`` ``NeFedAvg``) divides each
coordinate's sum over the sub-models holding it by their number, one per client; ours weighs each client by
its samples, the rule of the other nested methods here (papers/003 Algorithm 1 line 18). ``weighting=count``
gives the authors' (:meth:`~fedsap_ray.algorithms.fedavg.FedAvg.client_weight`, the same option as HeteroFL's).

Not modelled: NeFL's learnable step sizes (the ODE-solver view that scales each
residual branch) and its decoupled "inconsistent" parameters (step sizes and BN layers
kept per sub-model and averaged separately); every parameter here is one shared,
nested parameter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from collections.abc import Mapping

import numpy as np

from fedsap_ray.algorithms.fedavg import WEIGHTINGS
from fedsap_ray.algorithms.channel_subsets import ChannelSubsetStrategy
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_bool, check_choice, check_number
from fedsap_ray.models.masks import ChannelMasks, nested_channel_masks, nested_count
from fedsap_ray.common.messages import ServerState
from fedsap_ray.models.resnet import BasicBlock
from fedsap_ray.models.space import ParamAxis


@dataclass(frozen=True)
class SkippableBlock:
    """A residual block with an identity shortcut: its branch can be left out exactly."""

    name: str  # module path, e.g. "layer4.1"
    inner: str  # its inner channel layer (the branch's conv1), e.g. "layer4.1.conv1"
    spans: tuple[tuple[int, int], ...]  # flat-layout spans of the branch's tensors (parameters and BN stats)


@register("nefl")
class NeFL(ChannelSubsetStrategy):
    summary = "nested width-only sub-models at kappa_i (depth=true: also skip identity blocks, deepest first)"
    supports_async = True  # docs/readings.md#asynchronous-training

    @dataclass(frozen=True)
    class Options:
        depth: bool = False  # False: width-only (DapperFL's NeFL setting); True: NeFL-WD depth rule
        depth_share: float = 0.5  # with depth=true: gamma_D ~ gamma^depth_share (module docstring)
        # samples: each coordinate's mean over the sub-models holding it weighted by their samples (our nested
        # rule); count: weighted by 1 per client, as the authors' utils/NeFedAvg.py NeFedAvg (module docstring)
        weighting: str = "samples"
        # options a run that names their default keeps the config hash it had before they existed
        unhashed_defaults: ClassVar[tuple[str, ...]] = ("weighting",)

        def __post_init__(self) -> None:
            check_bool("algorithm.depth", self.depth)
            check_number("algorithm.depth_share", self.depth_share, 0, 1)
            check_choice("algorithm.weighting", self.weighting, WEIGHTINGS)

    # --- the sub-model ----------------------------------------------------------------
    def channel_masks(self, state: ServerState, client_id: int, t: int) -> ChannelMasks | None:
        capacity = float(self.ctx.federation.clients[client_id].capacity)
        return None if capacity >= 1.0 else self.nefl_masks(capacity)

    def nefl_masks(self, capacity: float) -> dict[str, np.ndarray]:
        """Leading ceil(p C_l) channels, and an empty inner layer for every skipped block."""
        skip, p = self.scaling(capacity)
        out = dict(nested_channel_masks(self.ctx.space, p))
        for blk in self.skippable():
            if blk.name in skip:
                out[blk.inner] = np.zeros_like(out[blk.inner])
        return out

    def coverage(self, cmasks: ChannelMasks) -> np.ndarray:
        """The channel coverage minus the residual branch of every block whose inner layer is empty."""
        mask = super().coverage(cmasks)
        for blk in self.skippable():
            if not np.any(cmasks[blk.inner]):
                for a, b in blk.spans:
                    mask[a:b] = False
        return mask

    # --- the depth/width rule (pure in kappa, memoised) ---------------------------------
    def scaling(self, kappa: float) -> tuple[tuple[str, ...], float]:
        """(skipped blocks, deepest first; width p) of a client of capacity ``kappa`` (module docstring)."""
        return self.memo("scaling", kappa, lambda: self._scaling(kappa))

    def _scaling(self, kappa: float) -> tuple[tuple[str, ...], float]:
        space = self.ctx.space
        full = {layer.name: layer.channels for layer in space.layers}
        budget = self.trainable_count(self._nested_counts(kappa), ())
        total = self.trainable_count(full, ())
        share = float(self.opts.depth_share) if self.opts.depth else 0.0  # depth=false: width-only
        target = total * (budget / total) ** share
        skip: list[str] = []
        for blk in reversed(self.skippable()):
            if self.trainable_count(full, (*skip, blk.name)) < target:
                break
            skip.append(blk.name)
        if not skip:  # width-only: exactly the nested sub-model at kappa
            return (), kappa
        cands = sorted({kappa} | {k / layer.channels for layer in space.layers
                                  for k in range(1, layer.channels + 1) if kappa < k / layer.channels <= 1})
        lo, hi = 0, len(cands) - 1  # cands[0] = kappa fits: skipping only removes parameters
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.trainable_count(self._nested_counts(cands[mid]), tuple(skip)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return tuple(skip), float(cands[lo])

    def trainable_count(self, counts: Mapping[str, int], skip: tuple[str, ...]) -> int:
        """Trainable parameters of the sub-model with ``counts`` leading channels per layer and ``skip`` blocks left out.

        A tensor's covered count is the product over its axes of the active entries (the
        coverage rule of :func:`fedsap_ray.models.masks.param_mask` is an outer product), so this
        equals params_in_mask of :meth:`coverage` without building the mask.
        """
        n = 0
        for owner, shape, axes in self._tensor_axes():
            if owner in skip:
                continue
            c = 1
            for axis, size in enumerate(shape):
                hit = axes.get(axis)
                c *= size if hit is None else hit[1].blocks * counts[hit[0]] * hit[1].group
            n += c
        return n

    def budget(self, capacity: float) -> int:
        """B: trainable parameters of the width-only nested sub-model at ``capacity`` (kappa_i)."""
        return self.trainable_count(self._nested_counts(capacity), ())

    # --- structure, read once from the template model -----------------------------------
    def skippable(self) -> tuple[SkippableBlock, ...]:
        """Identity-shortcut residual blocks in forward order (empty for models without them)."""
        return self.memo("skippable", None, self._skippable)

    def _skippable(self) -> tuple[SkippableBlock, ...]:
        layout, space, out = self.ctx.layout, self.ctx.space, []
        for name, mod in self.ctx.model.named_modules():
            if not (isinstance(mod, BasicBlock) and len(mod.shortcut) == 0):
                continue
            inner = space.output_layer_of(f"{name}.conv1.weight")
            if inner is None:
                continue
            spans = tuple(layout.span(n) for n in layout.names if n.startswith(f"{name}."))
            out.append(SkippableBlock(name=name, inner=inner, spans=spans))
        return tuple(out)

    def _tensor_axes(self) -> list[tuple[str | None, tuple[int, ...], dict[int, tuple[str, ParamAxis]]]]:
        """Per trainable tensor: (skippable block owning it or None, shape, {axis: (layer, ParamAxis)})."""
        return self.memo("tensor_axes", None, self._compute_tensor_axes)

    def _compute_tensor_axes(self) -> list[tuple[str | None, tuple[int, ...], dict[int, tuple[str, ParamAxis]]]]:
        layout, space = self.ctx.layout, self.ctx.space
        by_tensor: dict[str, dict[int, tuple[str, ParamAxis]]] = {}
        for layer in space.layers:
            for ax in layer.out + layer.inp:
                by_tensor.setdefault(ax.name, {})[ax.axis] = (layer.name, ax)
        owners = {blk.name for blk in self.skippable()}
        rows = []
        for name, shape, is_param in zip(layout.names, layout.shapes, layout.is_param):
            if not is_param:
                continue
            owner = next((o for o in owners if name.startswith(f"{o}.")), None)
            rows.append((owner, shape, by_tensor.get(name, {})))
        return rows

    def _nested_counts(self, p: float) -> dict[str, int]:
        return {layer.name: nested_count(min(p, 1.0), layer.channels) for layer in self.ctx.space.layers}
