"""FedRolex (Alam et al., NeurIPS 2022, "FedRolex: Model-Heterogeneous Federated Learning with Rolling
Sub-Model Extraction") on the federation's capacity tiers.

A client of capacity kappa_i < 1 trains, of every channel layer l, the contiguous window of
k_l = ceil(kappa_i C_l) channels (:func:`fedsap_ray.models.masks.nested_count`, HeteroFL's count) that starts at
an index rolling one channel per round and wrapping modulo C_l, each layer by its own C_l; a client at
kappa_i = 1 trains the full model. Round t (1-based) uses the roll r = (t - 1) mod C_l, so round 1 trains
the leading channels, as HeteroFL would. Aggregation is coordinate-wise over the clients that trained each
coordinate, sample-weighted (:class:`~fedsap_ray.algorithms.channel_subsets.ChannelSubsetStrategy`, papers/003
Algorithm 1 line 18), the rule every sub-model method here shares.

Our reading of the authors' code (AIoT-MLSys-Lab/FedRolex, ``resnet_server.py``
``ResnetServer.split_model``), docs/readings.md#fedrolex:

- **The step.** The server counts its steps (``rounds``, 0 before the first aggregation) and for every
  layer with C output channels takes ``torch.roll(arange(C), rounds % C)[:k]``: the window
  {(j - r) mod C : j < k}, which starts at (C - r) mod C and so moves *backward* by one channel a round
  (``direction=backward``, the default). The paper's section 3 writes the window as {r, ..., r + k - 1}
  mod C, moving *forward* (``direction=forward``). Both step one channel a round, wrap at C_l and visit
  the same C_l windows, in opposite order. The order of indices inside a window does not matter: the
  next layer's input follows the same order, so the sub-network is the same up to a permutation.
- **BatchNorm and the scaler.** The authors' models (``models/resnet.py``) use HeteroFL's static
  BatchNorm (``track_running_stats=False``) and its ``Scaler`` (activations divided by the width ratio in
  training); as for ``heterofl``, neither is modelled: BN running statistics follow their channel like
  every coordinate (:mod:`fedsap_ray.models.masks`) and the deployed model recomputes them on the client's data
  (``training.deployed_bn``).
- **Not modelled.** The authors' ``combine`` averages by client count (and the classifier by label split,
  with cumulative update counts as weights on 1-d and classifier tensors); ours is the sample-weighted
  rule above. Their ``model_split_mode=dynamic`` (a width redrawn per round) is not modelled: widths are
  the clients' capacities, as their ``fix`` mode.

The deployed model of a client is the window it would receive next, round ``state.round + 1``
(:meth:`FedAvg.deployed_model`): a rolling method has no fixed sub-model, and that window is the
one the server would extract for the client now, a pure function of the round, so it is recomputed,
never stored. Asynchronous mode (:mod:`fedsap_ray.engine.asyncmode`): a client started on model version v trains
the window of round t = v + 1, the version it downloaded plus one; the coordinates it uploads are that
window's (``ClientResult.mask``), however stale it arrives.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsap_ray.algorithms.fedavg import MASK_CACHE
from fedsap_ray.algorithms.channel_subsets import ChannelSubsetStrategy
from fedsap_ray.algorithms.registry import register
from fedsap_ray.models.masks import ChannelMasks, nested_count
from fedsap_ray.common.messages import ServerState
from fedsap_ray.models.space import ChannelSpace
from fedsap_ray.config.checks import check_choice

DIRECTIONS = ("backward", "forward")


def window_start(t: int, channels: int, direction: str) -> int:
    """First channel of layer's round-t window: roll r = (t - 1) mod C, start (C - r) mod C backward (the
    authors' ``torch.roll``), r forward (the paper's section 3)."""
    r = (t - 1) % channels
    return (-r) % channels if direction == "backward" else r


def rolling_channel_masks(space: ChannelSpace, kappa: float, t: int, direction: str) -> dict[str, np.ndarray]:
    """Per channel layer, the ceil(kappa C_l) channels of the round-t window, wrapping modulo C_l."""
    out = {}
    for layer in space.layers:
        m = np.zeros(layer.channels, dtype=bool)
        m[:nested_count(kappa, layer.channels)] = True
        out[layer.name] = np.roll(m, window_start(t, layer.channels, direction))
    return out


@register("fedrolex")
class FedRolex(ChannelSubsetStrategy):
    summary = "rolling sub-models: a contiguous window of ceil(p_max C_l) channels, moved one channel a round"
    supports_async = True  # docs/readings.md#asynchronous-training (t = downloaded version + 1)
    supports_privacy = True  # windows from (capacity, round)  # docs/readings.md#privacy
    confound_variants = {"fedrolex": ()}  # a sub-model width method of the capacity-confound study

    @dataclass(frozen=True)
    class Options:
        direction: str = "backward"  # backward: the authors' torch.roll (resnet_server.py); forward: the paper's section 3

        def __post_init__(self) -> None:
            check_choice("algorithm.direction", self.direction, DIRECTIONS)

    def channel_masks(self, state: ServerState, client_id: int, t: int) -> ChannelMasks | None:
        """The client's round-t window of every layer (None at capacity 1: the full model)."""
        kappa = float(self.ctx.federation.clients[client_id].capacity)
        if kappa >= 1.0:
            return None
        return rolling_channel_masks(self.ctx.space, kappa, t, self.opts.direction)

    def sub_model(self, state: ServerState, client_id: int, t: int) -> tuple[np.ndarray | None, int, float]:
        """:meth:`ChannelSubsetStrategy.sub_model`, kept per (capacity, round) for the round's clients of one tier:
        the window depends on nothing else (LRU-cached like the nested masks)."""
        kappa = float(self.ctx.federation.clients[client_id].capacity)
        return self.memo("rolling_mask", (min(kappa, 1.0), t), lambda: super(FedRolex, self).sub_model(state, client_id, t),
                         maxsize=MASK_CACHE)
