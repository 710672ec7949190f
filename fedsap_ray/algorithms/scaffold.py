"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", Algorithm 1 with the option II control-variate update), full model.

With server model x, server control c, client control c_i (zero until client i first
participates), round learning rate eta (``training.lr`` decayed, :func:`~fedsap_ray.algorithms.schedule.lr_at`)
and server step size eta_g (``algorithm.global_lr``), a round over the sampled set S is

    client i, each local step (line 10):   y <- y - eta (g_i(y) - c_i + c)
    client i, option II (line 12):         c_i+ = c_i - c + (x - y_i) / (K_i eta)
    server (lines 16-17):                  x <- x + eta_g * mean_{i in S}(y_i - x)
                                           c <- c + |S|/N * mean_{i in S}(c_i+ - c_i)

where K_i is the number of local steps client i actually took (``ClientResult.steps``;
with ``max_steps_per_epoch`` and a dropped last batch it can be fewer than
epochs x batches) and N the number of clients in the federation. The means are the
paper's unweighted means over S (not FedAvg's sample-size weights).

Clients are stateless here (any worker may run any client), so the server keeps every
c_i in ``ServerState.strategy_state["c_i"]`` (client id -> float32 [n_params], only for clients
that have participated) next to c in ``strategy_state["c"]``; a plan carries the correction c - c_i as
the ``scaffold`` hook's payload (``control``) and the client's ``scaffold`` hook (:class:`ControlCorrection`) adds it
to every step's gradient after clipping (:mod:`fedsap_ray.algorithms.hooks`). Because the server knows x, eta and K_i it recomputes
c_i+ from y_i itself, so nothing but the trained model comes back.

Control variates live on nn.Parameter coordinates only; BatchNorm running statistics
(also in the flat vector) get no correction and are averaged plainly
(mean_{i in S} y_i, whatever eta_g: a server step > 1 could push a running variance
below zero). The server step is evaluated as (1 - eta_g) x + eta_g mean(y_i) in float64,
algebraically the line-16 update, so eta_g = 1 gives the plain mean exactly.

Local optimiser: plain SGD, momentum 0 whatever ``training.momentum`` says. papers/003
section 4.5 reports SCAFFOLD as "the strongest full-model baseline ... once its control
variates are run under vanilla local SGD", while "under the momentum-based optimizer ...
it diverges to chance accuracy", and reports it in that canonical configuration; the
control variates of option II estimate the mean gradient only when the step is the plain
gradient step. Weight decay, gradient clipping (of the raw stochastic gradient, before
the correction is added) and the per-round learning-rate decay come from the config.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

import torch
from torch import nn

from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.algorithms.records import CHANNEL_COUNT_COLUMNS, clients_only
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.registry import register
from fedsap_ray.algorithms.schedule import lr_at, plan_settings
from fedsap_ray.config.checks import check_number
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundOutput, ServerState
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.models.sliced import SlicedModel

HOOK = "scaffold"


@dataclass(frozen=True)
class ControlPayload:
    control: np.ndarray  # c - c_i, float32, one value per coordinate of the flat layout


@register_hook(HOOK)
class ControlCorrection(ClientHook):
    """y <- y - lr (g_i(y) + c - c_i) (Algorithm 1 line 10): adds the payload's ``control`` (c - c_i, float32,
    one value per coordinate of the flat :class:`ParamLayout` vector) to every step's gradient AFTER the raw
    stochastic gradient was clipped (so clipping never rescales the control variate); the optimizer then adds
    weight decay inside its step. Only nn.Parameters get a correction (BatchNorm running statistics are not
    trained by gradients) and coordinates outside ``plan.mask`` get none, so they stay where they were.
    On a sliced sub-network the control is gathered to its coordinates (the covered ones, exactly those
    the masked model would correct).
    """

    supports_sliced = True
    supports_compile = True  # adds to the gradients after clipping: never touches the forward
    Payload: ClassVar[type] = ControlPayload
    payload: ControlPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device,
                 sliced: SlicedModel | None = None) -> None:
        super().__init__(plan, model, layout, device, sliced)
        control = np.asarray(self.payload.control)
        if control.dtype != np.float32 or control.shape != (layout.size,):  # wire check: an array that arrived
            raise ValueError(f"the scaffold payload's control must be float32 of shape ({layout.size},), "
                             f"got {control.dtype} {control.shape}")
        if sliced is not None:
            self.control = sliced.gather(control)
        else:
            self.control = control if plan.mask is None else np.where(plan.mask, control, np.float32(0.0))
        self.corrections: list[tuple[nn.Parameter, torch.Tensor]] = []

    def start(self, model: MaskableModel) -> None:
        """(parameter, correction) pairs, built once per plan (buffer coordinates are ignored)."""
        for name, p in model.named_parameters():
            corr = torch.from_numpy(np.ascontiguousarray(self.train_layout.slice(name, self.control)))
            self.corrections.append((p, corr.to(device=self.device, dtype=p.dtype)))

    def after_clip(self, model: MaskableModel) -> None:
        for p, corr in self.corrections:  # g_i(y) + c - c_i, after clipping g_i(y)
            assert p.grad is not None  # corrections cover trained parameters only
            p.grad.add_(corr)


@register("scaffold")
class Scaffold(Strategy):
    summary = "full model, control variates c - c_i correct client drift (plain local SGD)"
    confound_variants = {"scaffold": ()}  # papers/003 Table 6 (full model)
    columns = {"clients": CHANNEL_COUNT_COLUMNS}
    state_vectors = ("c", "c_i")  # the server's and each client's control variate, model-sized
    @dataclass(frozen=True)
    class Options:
        global_lr: float = 1.0  # eta_g, the server step size (Algorithm 1 line 16)

        def __post_init__(self) -> None:
            check_number("algorithm.global_lr", self.global_lr, 0, low_open=True)

    def __init__(self, ctx: RunContext, options: Any) -> None:
        super().__init__(ctx, options)
        self.param_coords = ctx.layout.param_coords()  # control variates live here only
        self.n_clients = len(ctx.federation.clients)

    def init_state(self) -> ServerState:
        """x from the seeded template, c = 0 and no client controls yet (c_i = 0 until seen)."""
        state = super().init_state()
        state.strategy_state = {"c": np.zeros(self.ctx.layout.size, dtype=np.float32), "c_i": {}}
        return state

    def sgd_settings(self, t: int, client_id: int) -> dict[str, Any]:
        """The plan's settings (:func:`~fedsap_ray.algorithms.schedule.plan_settings`) with momentum 0: vanilla local
        SGD (papers/003 section 4.5)."""
        return {**plan_settings(self.cfg, t, client_id), "momentum": 0.0}

    def control_for(self, state: ServerState, client_id: int) -> np.ndarray:
        """The correction c - c_i of Algorithm 1 line 10 (c_i = 0 for a client not seen yet)."""
        c = state.strategy_state["c"]
        c_i = state.strategy_state["c_i"].get(client_id)
        return c.copy() if c_i is None else (c - c_i).astype(np.float32)

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """Every client trains the whole model: all channels shared (Global)."""
        return {"n_global": sum(layer.channels for layer in self.ctx.space.layers), "n_private": 0, "n_dropped": 0}

    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        plans: dict[int, ClientPlan] = {}
        for cid in self.sampler.sample(t):
            control = self.control_for(state, cid)  # sent down; the client would send Delta c_i back up
            plans[cid] = ClientPlan(
                params=state.params, mask=None, capacity_used=1.0,  # shared, never mutated
                hooks=(call(ControlCorrection, control=control),), side_bytes_down=control.nbytes, side_bytes_up=control.nbytes,
                **self.sgd_settings(t, cid),
            )
        return plans

    def aggregate(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                  t: int) -> RoundOutput:
        """Option II client controls and the server update of lines 16-17, in float64, client-id order."""
        if not results:
            raise ValueError(f"round {t}: SCAFFOLD needs at least one client result")
        results = sorted(results, key=lambda r: r.client_id)
        lr = lr_at(self.cfg, t)
        x = state.params.astype(np.float64)
        c = state.strategy_state["c"].astype(np.float64)
        pc = self.param_coords
        y_sum = np.zeros_like(x)
        dc_sum = np.zeros_like(x)
        c_i = dict(state.strategy_state["c_i"])
        for r in results:
            if r.values.size != x.size:
                raise ValueError(f"client {r.client_id}: full update has {r.values.size} values, model has {x.size}")
            if r.steps < 1:
                raise ValueError(f"client {r.client_id} in round {t} reports {r.steps} local steps; SCAFFOLD needs K >= 1")
            y = r.values.astype(np.float64)
            y_sum += y
            dc = np.zeros_like(x)  # c_i+ - c_i = -c + (x - y_i) / (K eta), parameters only
            dc[pc] = (x[pc] - y[pc]) / (r.steps * lr) - c[pc]
            dc_sum += dc
            old = c_i.get(r.client_id)
            c_i[r.client_id] = (dc if old is None else old.astype(np.float64) + dc).astype(np.float32)
        y_mean = y_sum / len(results)
        g = float(self.opts.global_lr)
        params = y_mean.copy()  # buffers: plain mean
        params[pc] = (1.0 - g) * x[pc] + g * y_mean[pc]
        c_new = c + dc_sum / self.n_clients  # |S|/N * mean over S = sum over S / N
        extra = dict(state.strategy_state)
        extra.update(c=c_new.astype(np.float32), c_i=c_i)
        return clients_only(self, ServerState(round=t, params=params.astype(np.float32), strategy_state=extra), plans, results)
