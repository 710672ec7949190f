"""FedDrop: federated dropout of whole channels at each client's capacity (papers/000 Table 1).

What the row is (issue 13). By default this runs plain Federated Dropout (Caldas et al. 2018), NOT
the Adaptive Federated Dropout that papers/000's "FedDrop" row names: AFD's paper was not available
to check ``selection=afd`` against (its score update and weighted draw are our reading), so AFD is
not made the default; the analysis labels the row "FedDrop (FD)" (``selection=afd``: "FedDrop (AFD)",
unvalidated) so a table never claims AFD for what runs plain dropout.

papers/000 Appendix A runs FedDrop as "the Adaptive Federated Dropout baseline"
(Bouacida et al. 2021, "Adaptive Federated Dropout: Improving Communication Efficiency
and Generalization for Federated Learning"): the server sends each client a sub-model
made of a subset of every layer's activations, the client trains it, and the server
puts the trained sub-model back into the global model. Here an "activation" is a
channel of the model's ChannelSpace (a conv filter, a residual-stream channel, a
hidden unit), the sub-model keeps ceil(kappa_i C_l) channels of every layer with their
input connections (kappa_i = 1 - pruning ratio of client i, the count of papers/003
Algorithm 2, :func:`fedsap_ray.algorithms.pruning.random_channel_masks`), and the server
averages every coordinate over the clients that trained it (papers/003 Algorithm 1
line 18, :class:`~fedsap_ray.algorithms.channel_subsets.ChannelSubsetStrategy`). A client with
kappa_i = 1 trains the full model.

``selection`` (which channels a client keeps):

- ``random`` (default): a uniformly random subset of ceil(kappa_i C_l) channels of every
  layer, redrawn every round from ``rng_for(seed, t, client, "feddrop")`` -- Federated
  Dropout (Caldas et al. 2018, "Expanding the Reach of Federated Learning by Reducing
  Client Resource Requirements"), which AFD starts from and falls back to. It is the
  default because papers/000 gives no AFD setting (score map per client or shared, the
  weighted draw) and AFD's selection, designed to cut communication, reduces to this
  draw whenever a client's loss stops improving.
- ``afd``: the smallest version of AFD's Multi-Model activation score map (one map per
  client; Bouacida et al. 2021 also describe a Single-Model variant with one shared map),
  as we read it: every channel's
  score starts at 0; after a round in which client i's training loss l fell below its
  previous loss l_prev (its previous participation), the channels it kept get the score
  (l_prev - l) / l_prev and the client keeps the same sub-model next time; otherwise its
  next sub-model is a weighted random draw without replacement, channel c of layer l
  drawn with weight 1 + score_c (our reading: AFD's weighted random selection must also
  reach unscored channels, and with every score 0 it is the uniform draw). The maps,
  last losses and last masks live in ``ServerState.strategy_state["afd"]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsap_ray.algorithms.channel_subsets import ChannelSubsetStrategy
from fedsap_ray.algorithms.pruning import random_channel_masks
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_choice
from fedsap_ray.models.masks import ChannelMasks, nested_count
from fedsap_ray.common.messages import ClientResult, ServerState
from fedsap_ray.common.seeding import rng_for

SELECTIONS = ("random", "afd")


@register("feddrop")
class FedDrop(ChannelSubsetStrategy):
    summary = "plain Federated Dropout (FD): random channel subsets at kappa_i every round (selection=afd: unvalidated AFD)"
    supports_async = True  # docs/readings.md#asynchronous-training

    @dataclass(frozen=True)
    class Options:
        selection: str = "random"  # random: plain FD (Caldas et al. 2018); afd: our unvalidated AFD reading

        def __post_init__(self) -> None:
            check_choice("algorithm.selection", self.selection, SELECTIONS)

    @classmethod
    def async_support(cls, options: Any) -> str | None:
        """Plain FD redraws from (seed, round, client) alone; AFD's score maps are updated per round."""
        if getattr(options, "selection", "random") == "afd":
            return "selection=afd keeps per-round score maps (use selection=random)"
        return super().async_support(options)

    def init_state(self) -> ServerState:
        state = super().init_state()
        if self.opts.selection == "afd":
            state.strategy_state = {"afd": {"score": {}, "loss": {}, "keep": {}, "reuse": {}}}
        return state

    def channel_masks(self, state: ServerState, client_id: int, t: int) -> ChannelMasks | None:
        kappa = float(self.ctx.federation.clients[client_id].capacity)
        if kappa >= 1.0:
            return None
        rng = rng_for(self.cfg.seed, t, client_id, "feddrop")
        if self.opts.selection == "random":
            return random_channel_masks(self.ctx.space, kappa, rng)
        afd = state.strategy_state["afd"]
        if afd["reuse"].get(client_id, False):
            return self._split(afd["keep"][client_id])
        score = afd["score"].get(client_id)
        if score is None:
            return random_channel_masks(self.ctx.space, kappa, rng)
        return self._weighted_draw(score, kappa, rng)

    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> dict[str, Any]:
        """AFD's score-map update from each participant's training loss (``selection=afd`` only)."""
        if self.opts.selection != "afd":
            return state.strategy_state
        old = state.strategy_state["afd"]
        new = {k: dict(v) for k, v in old.items()}
        for r in results:
            cm = self.channel_masks(state, r.client_id, t)
            if cm is None:  # a full-model client has nothing to select
                continue
            kept = np.concatenate([np.asarray(cm[layer.name], dtype=bool) for layer in self.ctx.space.layers])
            prev = old["loss"].get(r.client_id)
            improved = prev is not None and prev > 0 and r.train_loss < prev
            if improved:
                score = old["score"].get(r.client_id, np.zeros(kept.size)).copy()
                score[kept] = (prev - r.train_loss) / prev
                new["score"][r.client_id] = score
            new["reuse"][r.client_id] = bool(improved)
            new["keep"][r.client_id] = kept
            new["loss"][r.client_id] = float(r.train_loss)
        return {**state.strategy_state, "afd": new}

    def _weighted_draw(self, score: np.ndarray, kappa: float, rng: np.random.Generator) -> ChannelMasks:
        """ceil(kappa C_l) channels of every layer without replacement, weights 1 + score."""
        out, start = {}, 0
        for layer in self.ctx.space.layers:
            w = 1.0 + score[start:start + layer.channels]
            m = np.zeros(layer.channels, dtype=bool)
            m[rng.choice(layer.channels, size=nested_count(kappa, layer.channels), replace=False, p=w / w.sum())] = True
            out[layer.name] = m
            start += layer.channels
        return out

    def _split(self, flat: np.ndarray) -> ChannelMasks:
        out, start = {}, 0
        for layer in self.ctx.space.layers:
            out[layer.name] = np.asarray(flat[start:start + layer.channels], dtype=bool).copy()
            start += layer.channels
        return out
