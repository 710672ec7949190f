"""FedSPU (Niu, Dong, Qin, AAAI 2025, "FedSPU: Personalized Federated Learning for
Resource-Constrained Devices with Stochastic Parameter Update"; arXiv 2403.11464), the
papers/000 Table 1 baseline that keeps the full architecture on every device.

Every client keeps its own full model w_i (personalised). In round t, client i draws a
uniformly random subset of ceil(kappa_i C_l) neurons (channels) of every layer l
(:func:`fedsap_ray.algorithms.pruning.random_channel_masks`, seeded by
``rng_for(seed, t, i, "fedspu")``), with kappa_i = ``federation.clients[i].capacity``. Let
M_i^t be the parameter mask of those active channels (:func:`fedsap_ray.models.masks.param_mask`:
a coordinate is trained only if BOTH its output channel and its input channel are active;
classifier bias and output rows always are). Then

    client start:   w_i <- M_i^t * w^t + (1 - M_i^t) * w_i          (active part from the global model)
    local training: SGD on the coordinates in M_i^t; the others are frozen (never move)
    server:         w^{t+1} = coordinate-wise sample-weighted mean over the clients whose
                    M_i^t covers the coordinate; coordinates nobody trained keep w^t

This is the update rule as the authors' code realises it (github.com/ZiruNiu0/FedSPU,
``CIFAR10/spues.py`` + ``spues_client.py`` + ``util.py``: the server sends the randomly
chosen sub-network of the global model (``generate_filters_random``), the client writes it
into its personal model (``merge_subnet``), freezes the other neurons' gradients, trains,
uploads the sub-network (``get_subnet``) and keeps the whole trained model as its personal
model; ``spu_aggregation`` averages each coordinate over the clients that sent it). The
paper (abstract; its framework figure) describes the same scheme: the full architecture stays
on the device, a random share of its neurons is frozen during local training and only the
rest is updated and shared. Every personal model starts as the initial
global model w^0 (``spues.py``: ``personal_models[i] = initial_parameters``), so a client
sampled for the first time in a later round freezes neurons at their w^0 values.

Frozen means bit-identical: coordinates outside M_i^t get zero gradients in the masked loop
(:mod:`fedsap_ray.engine.client`) and the ``fedspu`` client hook writes the personal values back
after every optimiser step, because weight decay and momentum would move them even with a zero
gradient (the authors' code trains with plain SGD, where a gradient mask suffices). BatchNorm
running statistics of frozen channels are restored too (they belong to the frozen neuron).

Messages: the plan's ``values``/``mask`` are the global values at M_i^t (what the real server
sends), the ``fedspu`` hook's payload ``frozen_values`` the client's own frozen personal values (stored on the
device in the real system, so not counted in bytes_down), the result the trained values at
M_i^t (what the real client uploads). Because frozen coordinates come back unchanged the server
rebuilds the client's new personal model exactly from its previous one and those values
(``ServerState.strategy_state["personal"]``, client id -> float32 vector; ``["init"]`` = w^0).

Evaluation: ``global`` (the global model w^t) first, then ``personal``: for each domain, the
personal model of that domain's client holding the most training samples (ties: lowest id),
the global model while that client has never participated. The FedSAP paper reports FedSPU's
global accuracy (Appendix A), the ``global`` mode.

Defaults: kappa_i from the run's capacities (papers/000 protocol: pruning ratios
{0, .2, .4, .6, .8}); the count is ceil(kappa C_l) (papers/003 Algorithm 2; the authors' code
uses max(1, int(kappa C_l))). FedSPU's optional early-stopping rule (a lambda-weighted sum of
training and validation loss, lambda = 0.7 in the authors' code) is not part of the Table 1
comparison and is not modelled.
The optimiser is the run's ``training`` section (the authors' code: plain SGD, lr 0.005).

Compute: ``params_trained`` counts M_i^t only (frozen coordinates never move, BN statistics included),
while ``macs_per_sample`` and ``train_macs`` (samples_seen x full-model MACs) count the full model:
frozen neurons still run forward (and backward passes through them to earlier layers).
"""
from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedsap_ray.algorithms.aggregation import masked_weighted_average, scatter
from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.algorithms.records import CHANNEL_COUNT_COLUMNS, clients_only
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.pruning import random_channel_masks
from fedsap_ray.algorithms.registry import register
from fedsap_ray.algorithms.schedule import plan_settings
from fedsap_ray.data.base import EvalDomains
from fedsap_ray.models.masks import ChannelMasks, ParamLayout, param_mask
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundOutput, ServerState
from fedsap_ray.common.seeding import rng_for

HOOK = "fedspu"


@dataclass(frozen=True)
class FrozenPayload:
    # the client's own values at the coordinates outside plan.mask (float32; empty when it trains everything)
    frozen_values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.float32))


@register_hook(HOOK)
class FrozenNeurons(ClientHook):
    """Cross-entropy; writes the frozen personal values into the model and restores them after every step."""

    Payload: ClassVar[type] = FrozenPayload
    payload: FrozenPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device) -> None:
        super().__init__(plan, model, layout, device)
        frozen = np.asarray(self.payload.frozen_values)
        free = np.zeros(layout.size, dtype=bool) if plan.mask is None else ~plan.mask
        if frozen.dtype != np.float32 or frozen.shape != (int(free.sum()),):  # wire check: an array that arrived
            raise ValueError(f"the fedspu payload's frozen_values must be float32 of shape ({int(free.sum())},) "
                             f"(the coordinates outside plan.mask), got {frozen.dtype} {frozen.shape}")
        state = model.state_dict(keep_vars=True)
        self.slots: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        pos = 0
        for name, off, shape in zip(layout.names, layout.offsets, layout.shapes):
            m = free[off:off + math.prod(shape)]
            k = int(m.sum())
            if k == 0:
                continue
            t = state[name]
            vals = torch.from_numpy(np.ascontiguousarray(frozen[pos:pos + k])).to(device=t.device, dtype=t.dtype)
            self.slots.append((t, torch.from_numpy(m.reshape(shape).copy()).to(t.device), vals))
            pos += k

    def start(self, model: MaskableModel) -> None:
        self._restore()  # the masked loop starts them at 0; a frozen neuron keeps its personal value

    def _restore(self) -> None:
        with torch.no_grad():
            for t, m, v in self.slots:
                t.masked_scatter_(m, v)

    def after_step(self, model: MaskableModel) -> None:
        self._restore()


@register("fedspu")
class FedSPU(Strategy):
    summary = "full model on every client, a random 1 - kappa_i of neurons frozen each round, personalised models"
    columns = {"clients": CHANNEL_COUNT_COLUMNS}
    state_vectors = ("init", "personal")  # w^0 and each client's personalised model

    @dataclass(frozen=True)
    class Options:
        pass

    # --- masks (pure in seed, round, client) ---------------------------------------------------
    def channel_masks(self, t: int, client_id: int) -> ChannelMasks:
        """The neurons client ``client_id`` trains in round t: ceil(kappa_i C_l) random channels per layer."""
        capacity = float(self.ctx.federation.clients[client_id].capacity)
        return random_channel_masks(self.ctx.space, capacity, rng_for(self.cfg.seed, t, client_id, "fedspu"))

    def assigned_width(self, plan: ClientPlan) -> float:
        """The client's capacity kappa_i, the share of neurons per layer it trains (:meth:`Strategy.assigned_width`)."""
        return min(float(self.ctx.federation.clients[plan.client_id].capacity), 1.0)

    def trained_mask(self, t: int, client_id: int) -> tuple[np.ndarray | None, int]:
        """(parameter mask M_i^t, None when every coordinate is trained; active channel count)."""
        cm = self.channel_masks(t, client_id)
        active = int(sum(int(m.sum()) for m in cm.values()))
        if active == self.ctx.space.total_channels:
            return None, active
        return param_mask(self.ctx.space, self.ctx.layout, cm), active

    # --- contract ---------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        state = super().init_state()
        state.strategy_state = {"init": state.params.copy(), "personal": {}}
        return state

    def personal_model(self, state: ServerState, client_id: int) -> np.ndarray:
        """w_i: the client's last trained model, w^0 before it first trains (the authors' initialisation)."""
        return state.strategy_state["personal"].get(client_id, state.strategy_state["init"])

    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        total = self.ctx.space.total_channels
        plans: dict[int, ClientPlan] = {}
        for cid in self.sampler.sample(t):
            mask, active = self.trained_mask(t, cid)
            frozen = (np.zeros(0, dtype=np.float32) if mask is None
                      else self.personal_model(state, cid)[~mask])
            plans[cid] = ClientPlan(
                params=state.params, mask=mask, capacity_used=active / total,
                hooks=(call(FrozenNeurons, frozen_values=frozen),), **plan_settings(self.cfg, t, cid),
            )
        return plans

    def aggregate(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                  t: int) -> RoundOutput:
        """Average the trained coordinates into w^t; store every client's new personal model."""
        results = sorted(results, key=lambda r: r.client_id)
        masks = {r.client_id: self.trained_mask(t, r.client_id)[0] for r in results}
        params = masked_weighted_average(state.params, [(masks[r.client_id], r.values, float(r.n_samples))
                                                        for r in results])
        personal = dict(state.strategy_state["personal"])
        for r in results:
            personal[r.client_id] = scatter(r.values, masks[r.client_id], state.params.size,
                                            fill=self.personal_model(state, r.client_id))
        extra = dict(state.strategy_state)
        extra["personal"] = personal
        return clients_only(self, ServerState(round=t, params=params, strategy_state=extra), plans, results)

    def deployed_model(self, state: ServerState, client_id: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The client's personal model w_i, whole: FedSPU devices run the full network (frozen neurons
        stay in it)."""
        return self.personal_model(state, client_id), None

    def eval_sets(self, state: ServerState, domains: EvalDomains) -> dict[str, dict[str, np.ndarray]]:
        """``global`` first (drives global accuracy), then each domain's ``personal`` model."""
        return {"global": self.eval_models(state, domains), "personal": self.personal_eval_models(state, domains)}

    def personal_eval_models(self, state: ServerState, domains: EvalDomains) -> dict[str, np.ndarray]:
        """Per test domain, the personal model of its representative client (``domains``: evaluation-only)."""
        out = {}
        for d in domains.names:
            cid = self.domain_representative(domains.members[d])
            out[d] = state.params if cid is None else state.strategy_state["personal"].get(cid, state.params)
        return out

    def domain_representative(self, members: tuple[int, ...]) -> int | None:
        """The client among ``members`` (a test domain's clients) with the most training samples (ties:
        lowest id); None if none."""
        clients = self.ctx.federation.clients
        if not members:
            return None
        return min(members, key=lambda c: (-clients[c].n_samples, c))

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """Every client runs the full model forward (frozen neurons stay in it); trained channels are shared
        (aggregated, Global), frozen ones stay personal on the device (Private)."""
        total = self.ctx.space.total_channels
        active = int(round(plan.capacity_used * total))  # capacity_used = active / total (configure_round)
        return {"macs_per_sample": self.compute.mask_macs(None), "n_global": active, "n_private": total - active,
                "n_dropped": 0}

    def train_macs(self, plan: ClientPlan, result: ClientResult) -> int:
        """samples_seen x full-model MACs: frozen neurons get no update but still run forward."""
        return int(result.samples_seen) * self.compute.mask_macs(None)

    # params_trained: the default (the coordinates of M_i^t). Frozen coordinates, including their BN running
    # statistics, are restored after every step, so M_i^t is exactly what the client updates.
