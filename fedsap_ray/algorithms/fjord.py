"""FjORD (Horvath et al. 2021) as papers/003 runs it: ordered dropout over the capacity tiers.

Every round each sampled client draws its width uniformly from the federation's
capacity tiers at or below its own p_max (papers/003 section 4.2: "assigns capacity
tiers randomly from the available options"), seeded by (run seed, round, client), and
trains the nested sub-model of that width. papers/003 section 4.1 mentions FjORD's
knowledge distillation between widths in passing but gives no setting for it, and section
4.2 describes the baseline by its random tier assignment alone; the distillation is not
modelled (docs/readings.md#other-choices).

``od_sampling=batch`` is the reading of Flower's FjORD baseline (adap/flower,
``baselines/fjord/fjord/models.py`` ``train`` with its ``ODSampler``, ``od/samplers/fixed_od.py``; the
server's ``strategy.py`` ``fjord_average``): the client holds its maximum-width (p_max) sub-model, draws a
width from the tiers at or below p_max for every batch and trains that nested sub-model for the step,
then uploads its whole p_max sub-model, which the server averages over the clients whose p_max covers
each coordinate, sample-weighted (our aggregation rule). The draw is the :class:`BatchWidths` client
hook's; it trains masked (docs/readings.md#fjord-flowers-baseline).

``od_bn=per_width`` is that baseline's BatchNorm (``od/layers/batch_norm.py`` ``ODBatchNorm2d``: an
affine-free BatchNorm per width with its own running statistics over ceil(p C) channels, one affine weight and
bias sliced to the width; ``strategy.py`` ``fjord_average``'s ``layer_p`` branch: width p's statistics averaged,
sample-weighted, over the clients whose p_max >= p; ``models.py`` ``test``: a width evaluated with its own).
The affine weight and bias stay the flat layout's; the running statistics of every tier below the widest are
the server's (``strategy_state["bn"]``, one float32 vector per tier: the running mean and variance of that
width's channels, in layout order, see :func:`running_stats`), and the flat layout's own are the widest tier's
set, so the global model evaluated at full width reads them unchanged (where the widest tier is below 1.0 the
channels beyond it are trained by nobody and keep their initial statistics, as under ``shared``). A plan at
width w starts from :meth:`FjORD.width_params` (the global model with w's statistics in place), so its values
carry w's set; the other tiers at or below p_max travel beside it: under ``batch`` in the :class:`BatchWidths`
payload, swapped in for each step of their width and sent back as their change; under ``round`` (one width all
round, the others untouched) only their bytes are counted (``side_bytes_down``/``_up``), what the reference's
whole-model exchange sends. The server merges each tier over the clients whose p_max reaches it
(:meth:`FjORD.tier_stats`); deployed models at width w carry w's set (:meth:`FjORD.deployed_model`), so the
deployed evaluation, ``training.deployed_bn=aggregated`` and the kept models read it
(docs/readings.md#fjord-flowers-baseline).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.registry import register
from fedsap_ray.algorithms.widths import CAPACITY, RANDOM_TIER, WidthRule
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.models.masks import ParamLayout, TorchMask, mask_grads_, nested_channel_masks, param_mask
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.config.checks import check_choice
from fedsap_ray.common.seeding import seed_for
from fedsap_ray.models.sliced import SlicedModel
from fedsap_ray.algorithms.staleness import update_factor

OD_SAMPLING = ("round", "batch")
OD_BN = ("shared", "per_width")
HOOK = "fjord_batch_widths"
STATS_KEY = "fjord_bn"  # ClientResult.stats under od_bn=per_width and batch: the change of each tier below p_max
RUNNING_STATS = ("running_mean", "running_var")  # a BatchNorm's statistics in the layout (num_batches_tracked is not)


@dataclass(frozen=True)
class BatchWidthsPayload:
    widths: tuple[float, ...]  # the tiers at or below the client's p_max, ascending: what each step draws from
    seed: int  # seeds the per-step draw: seed_for(run seed, round, client, "fjord_batch")
    # od_bn=per_width: the running statistics of widths[:-1], one float32 vector each (that width's coordinates of
    # running_stats, in layout order); p_max's own travel in the plan's values. Empty: one shared set (od_bn=shared)
    bn: tuple[np.ndarray, ...] = ()


def running_stats(layout: ParamLayout) -> np.ndarray:
    """bool [size]: the coordinates of every BatchNorm's running mean and variance. The layout leaves out
    ``num_batches_tracked``, which a BatchNorm with a momentum (PyTorch's default 0.1, the reference's too) never
    reads, so a width's statistics are these two tensors over its channels."""
    out = np.zeros(layout.size, dtype=bool)
    for name in layout.names:
        if name.rsplit(".", 1)[-1] in RUNNING_STATS:
            a, b = layout.span(name)
            out[a:b] = True
    return out


def tier_key(p: float) -> str:
    """Tier p's key in ``strategy_state["bn"]`` (a checkpoint's state fields are named by strings)."""
    return repr(float(p))


def draw_width(rng: np.random.Generator, widths: tuple[float, ...]) -> float:
    """One step's width, uniform over ``widths`` (the reference's ``np.random.choice(p_s)`` per forward pass)."""
    return float(widths[int(rng.integers(len(widths)))])


def step_widths(payload: BatchWidthsPayload, steps: int) -> list[float]:
    """The widths of steps 0..steps-1: :func:`draw_width` in step order from one generator per client-round,
    what :class:`BatchWidths` trains and :meth:`FjORD.train_macs` counts."""
    rng = np.random.default_rng(payload.seed)
    return [draw_width(rng, payload.widths) for _ in range(steps)]


def step_sizes(n: int, batch_size: int, epochs: int, max_steps: int | None) -> list[int]:
    """The samples in each optimizer step of the client loop (``client._loop``: batches of ``batch_size`` in
    each epoch, a size-1 batch skipped, at most ``max_steps`` steps an epoch)."""
    sizes: list[int] = []
    for _ in range(epochs):
        taken = 0
        for start in range(0, n, batch_size):
            size = min(batch_size, n - start)
            if size < 2 and n >= 2:
                continue
            sizes.append(size)
            taken += 1
            if max_steps is not None and taken >= max_steps:
                break
    return sizes


@register_hook(HOOK)
class BatchWidths(ClientHook):
    """Each step trains the nested sub-model of a width drawn from ``payload.widths`` (Flower's ``ODSampler``).

    The client holds its p_max sub-model masked: at ``batch_start`` the coordinates of the channels beyond the
    step's width are set aside and zeroed (a zero channel's activation is exactly zero, so the forward pass is
    the width's sub-model's, docs/architecture.md#sub-model-training), and at ``after_backward`` their
    gradients are zeroed and their values (BatchNorm running statistics included, which the forward pass
    moved) put back before the optimizer step. The step thus applies weight decay and momentum to the whole
    p_max sub-model, as the reference's SGD over whole tensors does; only the width's coordinates get a gradient.
    Masked only (``supports_sliced`` False): a sliced sub-network has one width.

    With ``payload.bn`` (``od_bn=per_width``) the hook holds every width's running statistics (p_max's read from
    the plan's values at ``start``): a step at width p writes p's set into the leading channels' statistics before
    the forward pass and reads it back after it (the forward pass is what moves them), then puts p_max's set back,
    so the upload's statistics are p_max's; :meth:`result` sends the change of each narrower set
    (:data:`STATS_KEY`), which the server applies to the set it holds (:meth:`FjORD.tier_stats`)."""

    Payload: ClassVar[type] = BatchWidthsPayload
    payload: BatchWidthsPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device,
                 sliced: SlicedModel | None = None) -> None:
        super().__init__(plan, model, layout, device, sliced)
        space = model.channel_space()
        held = np.ones(layout.size, dtype=bool) if plan.mask is None else plan.mask
        # per width, the held coordinates it keeps (the others are zeroed for its steps)
        self.keep = {p: held & param_mask(space, layout, nested_channel_masks(space, p)) for p in self.payload.widths}
        self.rng = np.random.default_rng(self.payload.seed)
        self.aside: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (tensor, dropped positions, values)
        self.drop: TorchMask | None = None
        self.stat_keep = self._stat_keep(held) if self.payload.bn else {}
        self.sets: dict[float, torch.Tensor] = {}  # od_bn=per_width: each width's running statistics
        self.step_width: float | None = None  # the width whose statistics the model holds during a step

    def _stat_keep(self, held: np.ndarray) -> dict[float, np.ndarray]:
        """Per width, its running-statistic coordinates; the payload's sets checked against them (wire check)."""
        widths, bn = self.payload.widths, self.payload.bn
        if len(bn) != len(widths) - 1:
            raise ValueError(f"the {HOOK} payload holds {len(bn)} BatchNorm sets for the {len(widths) - 1} widths "
                             "below p_max")
        stats = running_stats(self.layout)
        keep = {p: self.keep[p] & stats for p in widths}
        for p, values in zip(widths[:-1], bn):
            n = int(keep[p].sum())
            if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != (n,):
                raise ValueError(f"the {HOOK} payload's BatchNorm set of width {p:g} must be float32 of shape ({n},), "
                                 f"got {getattr(values, 'dtype', type(values).__name__)} {np.shape(values)}")
        return keep

    def start(self, model: MaskableModel) -> None:
        self.masks = {p: TorchMask.build(model, self.layout, keep) for p, keep in self.keep.items()}
        self.state = model.state_dict(keep_vars=True)
        if self.stat_keep:
            self.stat_at = {p: self._positions(keep) for p, keep in self.stat_keep.items()}
            self.sets = {p: torch.from_numpy(v.copy()).to(self.device) for p, v in zip(self.payload.widths[:-1], self.payload.bn)}
            self.sets[self.payload.widths[-1]] = self._read(self.payload.widths[-1])

    def _positions(self, keep: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, its positions in ``keep``) per layout tensor ``keep`` touches, in layout order: what a set's
        coordinates are in the model (row-major within a tensor, as the flat layout)."""
        out = []
        for name, off, shape in zip(self.layout.names, self.layout.offsets, self.layout.shapes):
            m = keep[off:off + int(np.prod(shape))]
            if m.any():
                t = self.state[name]
                out.append((t, torch.from_numpy(m.reshape(shape)).to(t.device)))
        return out

    def _read(self, p: float) -> torch.Tensor:
        """Width p's statistics as the model holds them now."""
        return torch.cat([t.detach()[at] for t, at in self.stat_at[p]]).clone()

    def _write(self, p: float, values: torch.Tensor) -> None:
        """Width p's statistics into the model."""
        with torch.no_grad():
            i = 0
            for t, at in self.stat_at[p]:
                n = int(at.sum())
                t[at] = values[i:i + n].to(t.dtype)
                i += n

    def batch_start(self, model: MaskableModel, step: int) -> None:
        p = draw_width(self.rng, self.payload.widths)
        self.drop = self.masks[p]
        with torch.no_grad():
            for name, unc in self.drop.uncovered.items():
                t = self.state[name]
                self.aside.append((t, unc, t[unc].clone()))
                t.masked_fill_(unc, 0.0)
        if self.sets:
            self.step_width = p
            self._write(p, self.sets[p])

    def after_backward(self, model: MaskableModel) -> None:
        if self.drop is not None:
            mask_grads_(model, self.layout, self.drop)
        if self.step_width is not None:  # the forward pass moved the step width's statistics: keep them, put p_max's back
            self.sets[self.step_width] = self._read(self.step_width)
            top = self.payload.widths[-1]
            self._write(top, self.sets[top])
            self.step_width = None
        self._restore()

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        """Under ``od_bn=per_width``: the change of each width's statistics below p_max, concatenated in width order
        (float32; computed in float64); p_max's set is in the uploaded values."""
        if not self.sets:
            return {}
        changes = [self.sets[p].to("cpu", torch.float64).numpy() - v.astype(np.float64)
                   for p, v in zip(self.payload.widths[:-1], self.payload.bn)]
        return {STATS_KEY: np.concatenate(changes).astype(np.float32)}

    def close(self) -> None:
        self._restore()

    def _restore(self) -> None:
        with torch.no_grad():
            for t, unc, values in self.aside:
                t.masked_scatter_(unc, values)
        self.aside, self.drop = [], None


@register("fjord")
class FjORD(FedAvg):
    summary = "ordered dropout: each round a random tier at or below p_max (papers/003; od_sampling=batch: per step)"
    confound_variants = {"fjord": ()}  # papers/003 Table 3
    supports_async = True  # docs/readings.md#asynchronous-training
    supports_privacy = True  # widths drawn by the server; od_bn=per_width refused (privacy_support)  # docs/readings.md#privacy
    @dataclass(frozen=True)
    class Options:
        """Not FedAvg's ``width``: the rule is FjORD's (docs/readings.md#fjord-flowers-baseline)."""

        # round: one tier per client per round (papers/003 section 4.2); batch: a tier per local step up to
        # p_max, the p_max sub-model uploaded and aggregated (Flower's FjORD baseline)
        od_sampling: str = "round"
        # shared: one set of BatchNorm running statistics per channel, sliced to each width; per_width: a set per
        # capacity tier, used by that width's steps and evaluation and averaged over the clients whose p_max reaches
        # it (Flower's ODBatchNorm2d)
        od_bn: str = "shared"
        # options a run that names their default keeps the config hash it had before they existed
        unhashed_defaults: ClassVar[tuple[str, ...]] = ("od_sampling", "od_bn")

        def __post_init__(self) -> None:
            check_choice("algorithm.od_sampling", self.od_sampling, OD_SAMPLING)
            check_choice("algorithm.od_bn", self.od_bn, OD_BN)

    width = RANDOM_TIER

    @classmethod
    def privacy_support(cls, options: Any) -> str | None:
        """od_bn=per_width uploads each narrower width's running statistics besides the update, outside its clip."""
        if getattr(options, "od_bn", "shared") == "per_width":
            return "algorithm.od_bn=per_width uploads each width's BatchNorm statistics outside the clipped update"
        return super().privacy_support(options)

    def __init__(self, ctx: RunContext, options: Any) -> None:
        super().__init__(ctx, options)
        # a model without BatchNorm has no statistics to keep: per_width then runs as shared
        self.per_width = getattr(options, "od_bn", "shared") == "per_width" and bool(running_stats(ctx.layout).any())
        # width_params' vectors, for the one (params, statistics) they were built from: a pure function of the
        # state, kept so every plan and deployed model of a width shares one vector (backends and the kept models
        # move and store each distinct vector once)
        self._vectors: tuple[Any, Any, dict[float, np.ndarray]] = (None, None, {})

    @classmethod
    def width_rule(cls, options: Any) -> WidthRule:
        """``od_sampling=batch``: the plan holds the client's p_max sub-model (its steps draw their widths)."""
        return CAPACITY if getattr(options, "od_sampling", "round") == "batch" else cls.width

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict[str, Any]:
        """Under ``batch``, the :class:`BatchWidths` hook with the tiers at or below p_max (and, under
        ``per_width``, the statistics of those below it, their bytes counted down; their changes come back in the
        result's stats); a client with one tier to draw trains its p_max sub-model plainly (sliced), which is what
        the draw would give."""
        widths = self.batch_widths(client_id)
        if len(widths) < 2:
            return {}
        bn = tuple(self.tier_set(state, p) for p in widths[:-1]) if self.per_width else ()
        hook = call(BatchWidths, widths=widths, seed=seed_for(self.cfg.seed, t, client_id, "fjord_batch"), bn=bn)
        return {"hooks": (hook,), "side_bytes_down": sum(v.nbytes for v in bn)}

    def batch_widths(self, client_id: int) -> tuple[float, ...]:
        """The tiers a client's steps draw from under ``batch`` (none under ``round``)."""
        if self.opts.od_sampling != "batch":
            return ()
        return self.held_tiers(client_id)

    def tiers(self) -> list[float]:
        """The federation's capacity tiers, ascending (the widths FjORD trains)."""
        return self.memo("fjord_tiers", None, lambda: sorted({float(c.capacity) for c in self.ctx.federation.clients}))

    def held_tiers(self, client_id: int) -> tuple[float, ...]:
        """The tiers at or below the client's p_max, ascending."""
        p_max = float(self.ctx.federation.clients[client_id].capacity)
        return tuple(p for p in self.tiers() if p <= p_max)

    # --- od_bn=per_width: a set of running statistics per tier (module docstring) ------------------------
    def stat_coords(self, p: float) -> np.ndarray:
        """The flat coordinates (indices, ascending) of width p's running statistics: those of its leading
        ceil(p C) channels of every BatchNorm."""
        def compute() -> np.ndarray:
            stats = self.memo("fjord_running_stats", None, lambda: running_stats(self.ctx.layout))
            return np.flatnonzero(stats if p >= 1.0 else stats & self.nested_mask(p)[0])

        return self.memo("fjord_stat_coords", self._counts(p), compute)

    def tier_set(self, state: ServerState, p: float) -> np.ndarray:
        """Tier p's running statistics in ``state`` (float32): the widest tier's are the flat layout's own, the
        others the strategy state's (never mutated: plans share them)."""
        if p >= self.tiers()[-1]:
            return state.params[self.stat_coords(p)]
        return state.strategy_state["bn"][tier_key(p)]

    def width_params(self, state: ServerState, p: float) -> np.ndarray:
        """The global model as a width-p model holds it: ``state.params`` with tier p's running statistics in
        place (``state.params`` itself for the widest tier and under ``shared``). One vector per width and state."""
        if not self.per_width or p >= self.tiers()[-1]:
            return state.params
        params, bn, vectors = self._vectors
        if params is not state.params or bn is not state.strategy_state["bn"]:
            vectors = {}
            self._vectors = (state.params, state.strategy_state["bn"], vectors)
        if p not in vectors:
            v = state.params.copy()
            v[self.stat_coords(p)] = self.tier_set(state, p)
            vectors[p] = v
        return vectors[p]

    def init_state(self) -> ServerState:
        """The seeded model; under ``per_width`` every tier below the widest starts from the model's own statistics
        (a fresh BatchNorm's, as the reference's per-width BatchNorms do)."""
        state = super().init_state()
        if self.per_width:
            state.strategy_state = {"bn": {tier_key(p): state.params[self.stat_coords(p)].copy()
                                           for p in self.tiers()[:-1]}}
        return state

    def configure_clients(self, state: ServerState, t: int, clients: list[int]) -> dict[int, ClientPlan]:
        """Under ``per_width`` each plan starts from :meth:`width_params` of the width it trains (its values carry
        that width's statistics); under ``round`` the other tiers at or below p_max, which the reference's
        whole-model exchange sends and returns unchanged, are counted in ``side_bytes_down``/``_up``."""
        plans = super().configure_clients(state, t, clients)
        if not self.per_width:
            return plans
        out = {}
        for cid, plan in plans.items():
            w = self.width_for(state, cid, t)
            echo = 0 if self.opts.od_sampling == "batch" else \
                sum(4 * self.stat_coords(p).size for p in self.held_tiers(cid) if p != w)
            out[cid] = dataclasses.replace(plan, params=self.width_params(state, w),
                                           side_bytes_down=plan.side_bytes_down + echo,
                                           side_bytes_up=plan.side_bytes_up + echo)
        return out

    def merge(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult], t: int) -> np.ndarray:
        """The coordinate-wise merge (:meth:`FedAvg.merge`); under ``per_width`` the flat layout's running
        statistics are then the widest tier's (:meth:`tier_stats`), not a mix of the widths' sets the clients sent."""
        params = super().merge(state, plans, results, t)  # a new vector
        if self.per_width:
            top = self.tiers()[-1]
            params[self.stat_coords(top)] = self.tier_stats(state, results, top)
        return params

    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> Any:
        """Under ``per_width``, every tier below the widest after the round (:meth:`tier_stats`)."""
        if not self.per_width:
            return super().after_aggregate(state, params, results, masks, t)
        return {**state.strategy_state, "bn": {tier_key(p): self.tier_stats(state, results, p) for p in self.tiers()[:-1]}}

    def tier_stats(self, state: ServerState, results: list[ClientResult], p: float) -> np.ndarray:
        """Tier p's running statistics after the round: the sample-weighted mean (float64, client-id order) of what
        every client whose p_max reaches p returns for it, a client that did not run width p returning what it
        received (the reference's ``fjord_average``, its ``layer_p`` branch); kept when no such client trained.

        What a client returns for p (:meth:`returned_set`) is read through the asynchronous engine's rule
        (:mod:`fedsap_ray.engine.asyncmode`): the current set plus eta_g s(tau) times the client's change; synchronously,
        and for a fresh update with factor 1, the client's set itself."""
        current = self.tier_set(state, p)
        acc, total = np.zeros(current.size, dtype=np.float64), 0.0
        for r in sorted(results, key=lambda r: r.client_id):
            if float(self.ctx.federation.clients[r.client_id].capacity) < p:
                continue
            acc += self.client_weight(r) * self.returned_set(state, r, p)
            total += self.client_weight(r)
        return (acc / total).astype(np.float32) if total > 0 else current

    def returned_set(self, state: ServerState, result: ClientResult, p: float) -> np.ndarray:
        """Width p's statistics as client ``result`` returns them, in float64 (:meth:`tier_stats`): from its uploaded
        values when p is the width its plan started from, from its stats' change when it ran p in a narrower step
        (``batch``), the current set when it left p untouched."""
        current = self.tier_set(state, p).astype(np.float64)
        factor = self.staleness_factor(state, result)
        coords = self.stat_coords(p)
        if p == self.width_for(state, result.client_id, result.round):
            if result.mask is not None and not result.mask[coords].all():
                raise ValueError(f"fjord: client {result.client_id}'s upload lacks the statistics of its width {p:g}")
            values = result.values[coords] if result.mask is None else \
                result.values[np.cumsum(result.mask, dtype=np.int64)[coords] - 1]
            if result.round == state.round + 1 and factor == 1.0:  # a fresh update: the values themselves
                return values.astype(np.float64)
            # the engine recovered the values on the flat layout's (widest tier's) statistics: z - x is the scaled change
            return current + (values.astype(np.float64) - state.params[coords].astype(np.float64))
        change = self.stats_change(result, p)
        return current if change is None else current + factor * change

    def stats_change(self, result: ClientResult, p: float) -> np.ndarray | None:
        """The change the client sends for width p (:data:`STATS_KEY`, ``batch`` only), None when it sends none."""
        sent = result.stats.get(STATS_KEY)
        if sent is None:
            return None
        below = self.held_tiers(result.client_id)[:-1]
        sizes = [self.stat_coords(q).size for q in below]
        if sent.dtype != np.float32 or sent.shape != (sum(sizes),):
            raise ValueError(f"fjord: client {result.client_id}'s {STATS_KEY} must be float32 of shape ({sum(sizes)},), "
                             f"got {sent.dtype} {sent.shape}")
        if p not in below:
            return None
        start = sum(sizes[:below.index(p)])
        return sent[start:start + sizes[below.index(p)]].astype(np.float64)

    def staleness_factor(self, state: ServerState, result: ClientResult) -> float:
        """eta_g s(tau), the factor the asynchronous engine applies to an update's change (its staleness tau: the
        server steps since the version its plan was built on, ``result.round`` - 1); 1 synchronously."""
        if self.cfg.devices.mode != "async":
            return 1.0
        return update_factor(self.cfg.asynchronous, state.round - (result.round - 1))

    def deployed_model(self, state: ServerState, client_id: int) -> tuple[np.ndarray, np.ndarray | None]:
        """FedAvg's (the sub-model of the client's next round) with, under ``per_width``, that width's statistics."""
        params, mask = super().deployed_model(state, client_id)
        if not self.per_width:
            return params, mask
        return self.width_params(state, self.width_for(state, client_id, state.round + 1)), mask

    def train_macs(self, plan: ClientPlan, result: ClientResult) -> int:
        """Under ``batch``, each step's samples times the MACs of the width it drew (the compute really spent);
        otherwise one forward pass of the plan's sub-model per sample (:meth:`FedAvg.train_macs`)."""
        if not any(c.name == HOOK for c in plan.hooks):
            return super().train_macs(plan, result)
        sizes = step_sizes(result.n_samples, plan.batch_size, plan.local_epochs, plan.max_steps_per_epoch)
        if len(sizes) != result.steps or sum(sizes) != result.samples_seen:
            raise ValueError(f"fjord: client {result.client_id} took {result.steps} steps over {result.samples_seen} "
                             f"samples, the client loop's batching gives {len(sizes)} over {sum(sizes)}")
        widths = step_widths(plan.payload(HOOK), len(sizes))
        return int(sum(n * self.macs(p) for n, p in zip(sizes, widths)))
