"""DapperFL (Jia, Zhang, Hu, Choo, Qi, Xu, Beheshti, Dou, NeurIPS 2024, "DapperFL: Domain Adaptive
Federated Learning with Model Fusion Pruning for Edge Devices"), FedSAP's closest baseline
(papers/000 Appendix A). Client i prunes to its capacity kappa_i = ``federation.clients[i].capacity``
(pruning ratio rho_i = 1 - kappa_i). Round t (1-based), local epochs E:

1. Download: the full global model W^{t-1}; the client prunes it itself, so it needs all of it.
2. Model Fusion Pruning (MFP), local fine-tuning: the client trains the FULL model for one local
   epoch on its data (with the DAR loss below), giving w_hat_i^t.
3. MFP fusion of the global and the fine-tuned local model,

       w_i^t = alpha_t * W^{t-1} + (1 - alpha_t) * w_hat_i^t,
       alpha_t = max(alpha_0 * (1 - epsilon)^(t - 1), alpha_min),

   alpha weighting the GLOBAL model (heavy reliance on the global model early, decaying as local
   knowledge accumulates). The fusion covers the whole flat state (parameters and BN statistics).
4. MFP pruning: structured l1 magnitude pruning of the FUSED model, keeping the ceil(kappa_i C_l)
   filters with the largest l1 norm in every channel layer (:func:`fusion_prune`, with
   :func:`fedsap_ray.algorithms.pruning.l1_channel_masks`); pruned coordinates are zeroed.
5. The remaining E - 1 epochs train the pruned model (masked SGD: pruned coordinates get no
   gradient and are reset to zero after every step, so momentum cannot revive them).
6. Domain Adaptive Regularization (DAR) on the representation z = f_enc(x) in every step:
   loss = CE + gamma * mean_x ||z||_2 (the shared ``rep_norm`` client hook,
   :mod:`fedsap_ray.algorithms.representation`; ``dar_form``, :func:`dar_loss`).
7. Aggregation with reconstruction: each pruned model is brought back to full size by filling
   its pruned coordinates with the previous global model, w~_i = M_i * w_i + (1 - M_i) * W^{t-1},
   then W^t = sum_i n_i w~_i / sum_i n_i (sample weights: the reference code's default
   ``--averaing weight``).

Sources. The paper's method section was not reachable through our search tools, so its equation
numbers are not cited here; the formulas come from a summary of the paper (themoonlight.io review of
arXiv 2412.05823: one-epoch fine-tuning of the global model, w_i^t = alpha_t W_{t-1} + (1 - alpha_t)
w_hat_i^t, l1-norm mask) and the authors' reference code (github.com/jyzgh/DapperFL,
``models/dapperfl.py``: fusion and pruning after the first local epoch, alpha_k = max((1-eps)^r alpha_0,
alpha_min) with r the 0-based round, i.e. exponent t - 1 here; ``models/utils/federated_model.py``:
pruned weights refilled from the previous global model before the weighted average). Readings:

- No fusion in round 1 (alpha = 0): the reference code skips it in round 0, and W^0 is the random
  initialisation, which carries no knowledge of the other domains that the fusion exists to inject.
- DAR as the reference code computes it, the unsquared norm mean_x ||z||_2 (``dar_form=norm``, default);
  ``dar_form=squared`` is papers/000 Eq. 7's squared form gamma * mean_x ||z||_2^2, this simulator's
  reading before issue 13 (docs/readings.md#baselines-of-fedsaps-table-1). On 512-d features the squared
  form is roughly an order of magnitude stronger at the same gamma.
- ``full_first_epoch`` (default true, the reference code): the first local epoch trains the FULL model even
  on a capacity-0.2 client, beyond the capacity every other sub-model method obeys. ``false`` is a
  capacity-respecting reading of ours (not in the paper or its code): the client l1-prunes the received
  W^{t-1} to kappa_i before training (:func:`fedsap_ray.algorithms.pruning.l1_channel_masks`), trains that
  pruned model in every epoch, and after the first epoch fuses it with W^{t-1} on the kept coordinates
  (w = alpha_t W^{t-1} + (1 - alpha_t) w_hat, pruned coordinates stay 0); the mask is not re-chosen.
- Asynchronous training (``devices.mode=async``, :mod:`fedsap_ray.engine.asyncmode`; both ``full_first_epoch``
  readings, docs/readings.md#asynchronous-training): a client started on version v fuses with and prunes
  the x_v it downloaded at alpha_{v+1}; the server applies w_i - x_v on the coordinates the client uploaded
  (``ClientResult.mask``), staleness-weighted, and step 7 refills the rest from the current model, which
  plays W^{t-1} (:meth:`DapperFL.merge`). Why it is faithful: synchronously too the server sees only the
  pruned model and refills everything else, so the upload is a delta on M_i from what the client received.
- What the released reference code computes (docs/readings.md#readings-of-the-authors-code, read with PyTorch's
  pruning semantics): ``_train_net`` fuses only modules ``torch.nn.utils.prune.is_pruned`` reports, and
  ``aggregate_nets`` removes every participant's pruning after each round, so nothing is ever fused (and a
  value assigned to a pruned module's ``weight`` is discarded by ``prune.remove``): ``alpha_0=0 alpha_min=0``
  here. The same discard undoes its refill (``module.weight += W_prev - W_prev * mask`` before
  ``prune.remove``), so its pruned weights enter the weighted mean as 0: ``refill=zero`` (default ``global``,
  step 7 as the paper describes it). With ``zero`` the pruned *parameter* coordinates count as 0 and the
  BatchNorm running statistics of pruned channels are still refilled from W^{t-1} (the reference keeps
  training those on every channel, which a pruned channel here cannot); asynchronous training refuses
  ``zero`` (a zero is not a delta from what the client received).
- Stateless clients: nothing a client trains is kept between rounds except the global model (DapperFL's
  local model of round t is built from W^{t-1} in round t). ``ServerState.strategy_state["kept"]`` only records
  each client's last kept channels, for the ``deployed`` evaluation of the pruned model it runs.

Defaults (reference code ``main.py``, used for its Digits and Office-Caltech runs, whose protocol
papers/000 follows): alpha_0 = 0.9, alpha_min = 0.1, epsilon = 0.2, DAR weight gamma = 0.01
(``--reg_coeff``; papers/000 also uses gamma = 0.01 for Eq. 7).

Accounting: the plan carries the full global model (the client chooses its own mask); the client
uploads only its pruned model's coordinates (``ClientHook.upload_mask``) plus the kept channel
mask in ``stats`` (C bytes), so ``bytes_up`` and ``macs_per_sample`` (the deployed model) are the
pruned model's. What the client spent is not: with ``full_first_epoch=true`` ``params_trained`` is the
full model's trainable count (epoch 1 updates all of it) and ``train_macs`` = (first-epoch samples) x
(full-model MACs) + (later samples) x (pruned MACs) (:func:`first_epoch_samples`); with ``false`` both
are the pruned model's.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.algorithms.records import CHANNEL_COUNT_COLUMNS, client_records
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.pruning import l1_channel_masks
from fedsap_ray.algorithms.registry import register
from fedsap_ray.algorithms.schedule import plan_settings
from fedsap_ray.algorithms.representation import RepresentationNorm
from fedsap_ray.algorithms.representation import REP_FORMS, rep_norm_loss
from fedsap_ray.config.checks import check_bool, check_choice, check_number, fail
from fedsap_ray.models.masks import (ChannelMasks, ParamLayout, TorchMask, apply_mask_, mask_grads_, nested_channel_masks,
                              nested_count, param_mask)
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundOutput, RoundRecords, ServerState
from fedsap_ray.models import model_macs
from fedsap_ray.models.space import ChannelSpace, MaskableModel

HOOK = "dapperfl_mfp"
MASK_KEY = "channel_mask"  # ClientResult.stats: the kept channels, concatenated in ChannelSpace order


# --- the mechanism as pure functions (tested on hand-built cases) ---------------------------------

def fusion_alpha(t: int, alpha_0: float, epsilon: float, alpha_min: float) -> float:
    """alpha_t = max(alpha_0 (1 - epsilon)^(t - 1), alpha_min) for round t >= 1 (module docstring, step 3)."""
    if t < 1:
        raise ValueError(f"round must be >= 1, got {t}")
    return max(alpha_0 * (1.0 - epsilon) ** (t - 1), alpha_min)


def fuse(global_params: np.ndarray, local_params: np.ndarray, alpha: float) -> np.ndarray:
    """w = alpha * W_global + (1 - alpha) * w_local (float64 arithmetic, float32 result)."""
    if global_params.shape != local_params.shape:
        raise ValueError(f"fuse: global has shape {global_params.shape}, local {local_params.shape}")
    out = alpha * global_params.astype(np.float64) + (1.0 - alpha) * local_params.astype(np.float64)
    return out.astype(np.float32)


def fusion_prune(space: ChannelSpace, layout: ParamLayout, global_params: np.ndarray, local_params: np.ndarray,
                 alpha: float, capacity: float) -> tuple[np.ndarray, ChannelMasks, np.ndarray]:
    """MFP (steps 3-4): (fused model with pruned coordinates at 0, kept channels, parameter mask M).

    The kept channels are the largest-l1 filters of the FUSED model, not of either input.
    """
    fused = fuse(global_params, local_params, alpha)
    cmasks = l1_channel_masks(space, layout, fused, capacity)
    pmask = param_mask(space, layout, cmasks)
    fused[~pmask] = 0.0
    return fused, cmasks, pmask


def reconstruct(global_prev: np.ndarray, values: np.ndarray, pmask: np.ndarray) -> np.ndarray:
    """Step 7: the full-size model M * w + (1 - M) * W^{t-1} (pruned coordinates from the previous global)."""
    if values.shape != global_prev.shape or pmask.shape != global_prev.shape:
        raise ValueError(f"reconstruct: shapes {values.shape}, {pmask.shape} do not match the model {global_prev.shape}")
    return np.where(pmask, values, global_prev)


def pack_channel_masks(space: ChannelSpace, cmasks: ChannelMasks) -> np.ndarray:
    return np.concatenate([np.asarray(cmasks[layer.name], dtype=bool) for layer in space.layers])


def unpack_channel_masks(space: ChannelSpace, flat: np.ndarray) -> dict[str, np.ndarray]:
    flat = np.asarray(flat, dtype=bool)
    if flat.shape != (space.total_channels,):
        raise ValueError(f"channel mask has shape {flat.shape}, the model has {space.total_channels} channels")
    out, start = {}, 0
    for layer in space.layers:
        out[layer.name] = flat[start:start + layer.channels]
        start += layer.channels
    return out


def first_epoch_steps(n_samples: int, batch_size: int, max_steps_per_epoch: int | None) -> int:
    """Optimizer steps of one local epoch in :mod:`fedsap_ray.engine.client` (a last batch of one sample is
    skipped when n >= 2; at most ``max_steps_per_epoch``): where the client fuses and prunes."""
    if n_samples < 2:
        steps = n_samples
    elif batch_size == 1:
        steps = 0  # every batch is a single sample
    else:
        steps = n_samples // batch_size + (1 if n_samples % batch_size >= 2 else 0)
    return steps if max_steps_per_epoch is None else min(steps, max_steps_per_epoch)


def first_epoch_samples(n_samples: int, batch_size: int, max_steps_per_epoch: int | None) -> int:
    """Samples in the batches of the first local epoch's :func:`first_epoch_steps` steps (the client loop's
    batching: full batches, then a last partial batch of at least two samples): what DapperFL's full-model
    epoch runs through the full model (``train_macs``)."""
    steps = first_epoch_steps(n_samples, batch_size, max_steps_per_epoch)
    if n_samples < 2:
        return steps * n_samples
    return min(steps * batch_size, n_samples)


DAR_FORMS = REP_FORMS
REFILLS = ("global", "zero")  # step 7: pruned coordinates from W^{t-1}, or as 0 (the released reference code)


def dar_loss(model: MaskableModel, x: torch.Tensor, y: torch.Tensor, gamma: float, form: str = "norm") -> torch.Tensor:
    """Cross-entropy plus the DAR term on z = f_enc(x) (step 6): the shared ``rep_norm`` loss
    (:func:`fedsap_ray.algorithms.representation.rep_norm_loss`).

    ``form="norm"`` (default): gamma * mean_x ||z||_2, the unsquared norm of DapperFL's reference code
    (jyzgh/DapperFL ``models/dapperfl.py``, ``--reg_coeff`` 0.01); ``"squared"``: gamma * mean_x ||z||_2^2,
    the form of papers/000 Eq. 7 (this simulator's earlier reading).
    """
    return rep_norm_loss(model, x, y, gamma, form)


# --- client side ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class FusionPruningPayload:
    alpha: float  # alpha_t, 0 = no fusion
    keep_ratio: float  # the client's capacity (kappa_i); the field keeps its name: async checkpoints store it
    prune_after_steps: int  # the optimizer steps of the first local epoch (first_epoch_steps)
    full_first_epoch: bool = True  # False: the capacity-respecting reading (module docstring)


@register_hook(HOOK)
class ModelFusionPruning(ClientHook):
    """Steps 2-5 on the client: full-model epoch, fusion with the received W^{t-1}, l1 pruning, masked rest
    (the DAR loss of step 6 is the ``rep_norm`` hook the plan lists before this one).

    The payload (:class:`FusionPruningPayload`): ``alpha`` (alpha_t, 0 = no fusion), ``keep_ratio`` (the capacity kappa_i),
    ``prune_after_steps`` (the optimizer steps of the first local epoch) and ``full_first_epoch`` (False: the
    capacity-respecting reading, module docstring); ``plan.values`` is W^{t-1}.
    """

    Payload: ClassVar[type] = FusionPruningPayload
    payload: FusionPruningPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device) -> None:
        super().__init__(plan, model, layout, device)
        if plan.mask is not None:
            raise ValueError("a DapperFL plan carries the full global model (mask None): the client prunes it")
        self.alpha, self.capacity = self.payload.alpha, self.payload.keep_ratio
        self.prune_at = int(self.payload.prune_after_steps)
        if self.prune_at < 1:  # the server's count of first-epoch steps, not an option
            raise ValueError(f"prune_after_steps must be >= 1, got {self.prune_at}")
        self.full_first = self.payload.full_first_epoch
        self.space = model.channel_space()
        self.steps = 0
        self.cmasks: ChannelMasks | None = None
        self.torch_mask: TorchMask | None = None
        self.pmask: np.ndarray | None = None
        if not self.full_first:  # prune W^{t-1} by l1 before training: the client never runs more than kappa_i
            self.cmasks = l1_channel_masks(self.space, layout, plan.values, self.capacity)
            self.pmask = param_mask(self.space, layout, self.cmasks)
            self.torch_mask = TorchMask.build(model, layout, self.pmask)

    def start(self, model: MaskableModel) -> None:
        if not self.full_first:
            assert self.torch_mask is not None  # built from the plan when not full_first
            apply_mask_(model, self.layout, self.torch_mask)

    def after_backward(self, model: MaskableModel) -> None:
        if self.torch_mask is not None:
            mask_grads_(model, self.layout, self.torch_mask)

    def after_step(self, model: MaskableModel) -> None:
        self.steps += 1
        if self.torch_mask is not None:
            apply_mask_(model, self.layout, self.torch_mask)  # momentum / weight decay must not revive pruned filters
        if self.steps != self.prune_at:
            return
        if not self.full_first:  # fusion on the fixed pruned model (its coordinates only)
            fused = fuse(self.plan.values, self.layout.flatten(model), self.alpha)
            assert self.pmask is not None  # pruned before training when not full_first
            fused[~self.pmask] = 0.0
            self.layout.load_into(model, fused)
        else:
            local = self.layout.flatten(model)
            fused, self.cmasks, pmask = fusion_prune(self.space, self.layout, self.plan.values, local,
                                                     self.alpha, self.capacity)
            self.layout.load_into(model, fused)
            self.torch_mask = TorchMask.build(model, self.layout, pmask)
            self.pmask = pmask

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        if self.steps < self.prune_at:
            raise ValueError(f"the first local epoch should end after {self.prune_at} steps, but only "
                             f"{self.steps} ran: nothing was pruned")
        assert self.cmasks is not None  # set by the pruning step, which has run
        return {MASK_KEY: pack_channel_masks(self.space, self.cmasks)}

    def upload_mask(self) -> np.ndarray | None:
        """Only the kept (pruned-model) coordinates go up, as in DapperFL."""
        return self.pmask


# --- server side ---------------------------------------------------------------------------------

@register("dapperfl")
class DapperFL(Strategy):
    summary = "fuse global + 1-epoch local model, l1-prune the fusion to kappa_i, DAR loss, refill pruned from global"
    columns = {"clients": CHANNEL_COUNT_COLUMNS}
    state_keys = ("kept",)  # client -> the channel mask it kept, from its first round on
    supports_async = True  # both full_first_epoch readings: docs/readings.md#asynchronous-training

    @dataclass(frozen=True)
    class Options:
        alpha_0: float = 0.9  # initial fusion weight of the global model (reference code -a)
        alpha_min: float = 0.1  # its floor (reference code -amin)
        epsilon: float = 0.2  # its per-round decay (reference code -e)
        gamma: float = 0.01  # DAR weight (reference code --reg_coeff; papers/000 Eq. 7 gamma)
        dar_form: str = "norm"  # norm: gamma mean ||z||_2 (reference code); squared: papers/000 Eq. 7's ||z||^2
        full_first_epoch: bool = True  # True: reference code (epoch 1 trains the full model); False: pruned from the start
        refill: str = "global"  # step 7's pruned coordinates: global: W^{t-1} (paper); zero: 0 (the released code)

        def __post_init__(self) -> None:
            for name in ("alpha_0", "alpha_min", "epsilon"):
                check_number(f"algorithm.{name}", getattr(self, name), 0, 1)
            if self.alpha_min > self.alpha_0:
                fail("algorithm.alpha_min", self.alpha_min, f"must be <= algorithm.alpha_0={self.alpha_0!r}")
            check_number("algorithm.gamma", self.gamma, 0)
            check_choice("algorithm.dar_form", self.dar_form, DAR_FORMS)
            check_bool("algorithm.full_first_epoch", self.full_first_epoch)
            check_choice("algorithm.refill", self.refill, REFILLS)

    @classmethod
    def async_support(cls, options: Any) -> str | None:
        """``refill=zero`` has no asynchronous reading: a zero is not a delta from the model the client received."""
        if options.refill == "zero":
            return "algorithm.refill=zero averages pruned weights as zeros, which is no delta (use refill=global)"
        return super().async_support(options)

    def alpha_at(self, t: int) -> float:
        """The fusion weight of the global model in round t (0 in round 1: no fusion with the random init)."""
        if t <= 1:
            return 0.0
        o = self.opts
        return fusion_alpha(t, o.alpha_0, o.epsilon, o.alpha_min)

    def capacity(self, client_id: int) -> float:
        return min(float(self.ctx.federation.clients[client_id].capacity), 1.0)

    def assigned_width(self, plan: ClientPlan) -> float:
        """The capacity kappa_i the client prunes to (:meth:`Strategy.assigned_width`)."""
        return self.capacity(plan.client_id)

    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        return self.configure_clients(state, t, self.sampler.sample(t))

    def configure_clients(self, state: ServerState, t: int, clients: list[int]) -> dict[int, ClientPlan]:
        """The round-t plans of ``clients`` from ``state`` (:meth:`configure_round`'s sample; the asynchronous
        mode asks for the clients it starts on version t - 1, whose W^{t-1} they fuse with at alpha_t)."""
        tr = self.cfg.training
        space = self.ctx.space
        total = space.total_channels
        alpha = self.alpha_at(t)
        plans: dict[int, ClientPlan] = {}
        for cid in clients:
            keep = self.capacity(cid)
            active = sum(nested_count(keep, layer.channels) for layer in space.layers)
            n = self.ctx.federation.clients[cid].n_samples
            plans[cid] = ClientPlan(
                params=state.params, mask=None, capacity_used=active / total,  # shared, never mutated
                hooks=(call(RepresentationNorm, gamma=float(self.opts.gamma), form=self.opts.dar_form),
                       call(ModelFusionPruning, alpha=float(alpha), keep_ratio=keep,
                            prune_after_steps=first_epoch_steps(n, tr.batch_size, tr.max_steps_per_epoch),
                            full_first_epoch=bool(self.opts.full_first_epoch))),
                **plan_settings(self.cfg, t, cid),
            )
        return plans

    def aggregate(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                  t: int) -> RoundOutput:
        """Step 7 (:meth:`merge`); each client's kept channels are stored for its deployed model
        (:meth:`after_aggregate`). Split as FedAvg's is, so the asynchronous engine
        (:class:`fedsap_ray.engine.asyncmode.AsyncStrategy`) calls the same pieces on its buffer."""
        params = self.merge(state, plans, results, t)
        masks = {r.client_id: r.mask for r in results}
        new = ServerState(round=t, params=params, strategy_state=self.after_aggregate(state, params, results, masks, t))
        return RoundOutput(new, self.records(new, plans, results, t))

    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> dict[str, Any]:
        """The next ``strategy_state``: each client's last kept channels, the mask of the pruned model it deploys
        (:meth:`deployed_model`), from the results aggregated (asynchronously: the updates applied)."""
        extra = dict(state.strategy_state)
        extra["kept"] = {**state.strategy_state.get("kept", {}),
                         **{r.client_id: np.asarray(r.stats[MASK_KEY], dtype=bool) for r in results}}
        return extra

    def records(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                t: int) -> RoundRecords:
        """The clients' rows (:func:`~fedsap_ray.algorithms.records.client_records`; ``state``: the state after round t)."""
        return RoundRecords(clients=client_records(self, state, plans, results))

    def merge(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
              t: int) -> np.ndarray:
        """Step 7: reconstruct every pruned model with W^{t-1}, then the sample-weighted mean (client-id order);
        ``refill=zero``: the pruned parameter coordinates as 0 instead (running statistics still from W^{t-1}).

        FedAvg's signature (``plans`` unread: each result's kept channels are in its ``stats``). Asynchronously
        ``state`` is the current model x_V and ``results`` hold the recovered values z_i = x_V|M_i +
        eta s(tau_i) (w_i - x_{v_i}|M_i) at the uploaded coordinates M_i, so the refill with x_V makes this
        x_V + eta sum_i n_i s(tau_i) M_i (w_i - x_{v_i}) / sum_i n_i (docs/readings.md#asynchronous-training)."""
        if not results:
            raise ValueError(f"round {t}: DapperFL needs at least one client result")
        prev = state.params
        base = np.where(self.ctx.layout.param_coords(), np.float32(0), prev) if self.opts.refill == "zero" else prev
        acc = np.zeros(prev.shape, dtype=np.float64)
        wsum = 0.0
        for r in sorted(results, key=lambda r: r.client_id):
            pmask = self.upload_mask_of(r, t)
            full = prev.copy()
            full[pmask] = r.values
            acc += float(r.n_samples) * reconstruct(base, full, pmask).astype(np.float64)
            wsum += float(r.n_samples)
        return prev.copy() if wsum <= 0 else (acc / wsum).astype(np.float32)

    def deployed_model(self, state: ServerState, client_id: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The pruned model the device runs: the global model at the channels the client kept in its last
        round (its MFP choice, step 4); before it ever trained, the largest-l1 filters of the global model
        at its capacity (the same criterion, without a local model to fuse)."""
        space = self.ctx.space
        kept = state.strategy_state.get("kept", {}).get(client_id)
        if kept is not None:
            cmasks: ChannelMasks = unpack_channel_masks(space, kept)
        else:
            keep = self.capacity(client_id)
            if keep >= 1.0:
                return state.params, None
            cmasks = l1_channel_masks(space, self.ctx.layout, state.params, keep)
        return state.params, param_mask(space, self.ctx.layout, cmasks)

    def upload_mask_of(self, r: ClientResult, t: int) -> np.ndarray:
        """The parameter mask of the client's pruned model, from the kept channels it reported."""
        if MASK_KEY not in r.stats:
            raise ValueError(f"client {r.client_id} in round {t} sent no {MASK_KEY!r}")
        pmask = param_mask(self.ctx.space, self.ctx.layout, unpack_channel_masks(self.ctx.space, r.stats[MASK_KEY]))
        if r.values.size != int(pmask.sum()):
            raise ValueError(f"client {r.client_id}: sent {r.values.size} values, its pruned model has {int(pmask.sum())}")
        return pmask

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """``macs_per_sample``: the pruned model, what the client deploys (training: :meth:`train_macs`); the
        pruned model's channels are shared (Global), the pruned-away ones Dropped."""
        total = self.ctx.space.total_channels
        active = int(round(plan.capacity_used * total))  # capacity_used = active / total (configure_round)
        return {"macs_per_sample": self.pruned_macs(float(plan.payload(HOOK).keep_ratio)), "n_global": active,
                "n_private": 0, "n_dropped": total - active}

    def params_trained(self, plan: ClientPlan, result: ClientResult) -> int:
        """Reference behaviour: every trainable coordinate (epoch 1 updates the full model); with
        ``full_first_epoch=false`` only the pruned model's."""
        if plan.payload(HOOK).full_first_epoch:
            return int(self.ctx.trainable.sum())
        return int((self.upload_mask_of(result, plan.round) & self.ctx.trainable).sum())

    def train_macs(self, plan: ClientPlan, result: ClientResult) -> int:
        """first-epoch samples x full MACs + the other samples x pruned MACs (all samples x pruned MACs with
        ``full_first_epoch=false``); one forward pass per sample (:meth:`Strategy.train_macs`)."""
        pruned = self.pruned_macs(float(plan.payload(HOOK).keep_ratio))
        seen = int(result.samples_seen)
        if not plan.payload(HOOK).full_first_epoch:
            return seen * pruned
        first = min(first_epoch_samples(result.n_samples, plan.batch_size, plan.max_steps_per_epoch), seen)
        return first * self.compute.mask_macs(None) + (seen - first) * pruned

    def pruned_macs(self, keep: float) -> int:
        """MACs per sample of the kappa-pruned model (they depend on the per-layer counts only; memoised)."""
        cmasks = nested_channel_masks(self.ctx.space, keep)
        return self.memo("pruned_macs", tuple(int(m.sum()) for m in cmasks.values()), lambda: int(model_macs(
            self.ctx.model, self.ctx.federation.input_shape, None if keep >= 1.0 else cmasks)))
