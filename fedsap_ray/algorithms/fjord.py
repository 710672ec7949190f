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
hook's; it trains masked (docs/readings.md#fjord-flowers-baseline). That baseline also keeps BatchNorm
running statistics per width (``od/layers/batch_norm.py`` ``ODBatchNorm2d``); ``od_bn=per_width`` is
refused, for the reason :data:`PER_WIDTH_BLOCKED` gives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.registry import register
from fedsap_ray.algorithms.widths import CAPACITY, RANDOM_TIER, WidthRule
from fedsap_ray.masks import ParamLayout, TorchMask, mask_grads_, nested_channel_masks, param_mask
from fedsap_ray.messages import ClientPlan, ClientResult, ServerState
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.schema import check_choice, fail
from fedsap_ray.seeding import seed_for
from fedsap_ray.sliced import SlicedModel

OD_SAMPLING = ("round", "batch")
OD_BN = ("shared", "per_width")  # per_width is refused (PER_WIDTH_BLOCKED): the allowed value is shared
HOOK = "fjord_batch_widths"
# why od_bn=per_width is refused (the option's message): what it would need that the layout does not have
PER_WIDTH_BLOCKED = ("not built: the flat parameter layout holds one set of BatchNorm running statistics per "
                     "channel, and per-width statistics need a set per tier in the server state, sent with the "
                     "plan, updated by the step's width and used by each width's evaluation "
                     "(docs/readings.md#fjord-flowers-baseline); use shared")


@dataclass(frozen=True)
class BatchWidthsPayload:
    widths: tuple[float, ...]  # the tiers at or below the client's p_max, ascending: what each step draws from
    seed: int  # seeds the per-step draw: seed_for(run seed, round, client, "fjord_batch")


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
    Masked only (``supports_sliced`` False): a sliced sub-network has one width."""

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

    def start(self, model: MaskableModel) -> None:
        self.masks = {p: TorchMask.build(model, self.layout, keep) for p, keep in self.keep.items()}
        self.state = model.state_dict(keep_vars=True)

    def batch_start(self, model: MaskableModel, step: int) -> None:
        self.drop = self.masks[draw_width(self.rng, self.payload.widths)]
        with torch.no_grad():
            for name, unc in self.drop.uncovered.items():
                t = self.state[name]
                self.aside.append((t, unc, t[unc].clone()))
                t.masked_fill_(unc, 0.0)

    def after_backward(self, model: MaskableModel) -> None:
        if self.drop is not None:
            mask_grads_(model, self.layout, self.drop)
        self._restore()

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
    @dataclass(frozen=True)
    class Options:
        """Not FedAvg's ``width``: the rule is FjORD's (docs/readings.md#fjord-flowers-baseline)."""

        # round: one tier per client per round (papers/003 section 4.2); batch: a tier per local step up to
        # p_max, the p_max sub-model uploaded and aggregated (Flower's FjORD baseline)
        od_sampling: str = "round"
        # shared: one sliced set of BatchNorm running statistics; per_width (Flower's ODBatchNorm2d) is not built
        od_bn: str = "shared"
        # options a run that names their default keeps the config hash it had before they existed
        unhashed_defaults: ClassVar[tuple[str, ...]] = ("od_sampling", "od_bn")

        def __post_init__(self) -> None:
            check_choice("algorithm.od_sampling", self.od_sampling, OD_SAMPLING)
            if self.od_bn == "per_width":
                fail("algorithm.od_bn", self.od_bn, PER_WIDTH_BLOCKED)
            check_choice("algorithm.od_bn", self.od_bn, OD_BN[:1])

    width = RANDOM_TIER

    @classmethod
    def width_rule(cls, options: Any) -> WidthRule:
        """``od_sampling=batch``: the plan holds the client's p_max sub-model (its steps draw their widths)."""
        return CAPACITY if getattr(options, "od_sampling", "round") == "batch" else cls.width

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict[str, Any]:
        """Under ``batch``, the :class:`BatchWidths` hook with the tiers at or below p_max; a client with one tier
        to draw trains its p_max sub-model plainly (sliced), which is what the draw would give."""
        widths = self.batch_widths(client_id)
        if len(widths) < 2:
            return {}
        return {"hooks": (call(BatchWidths, widths=widths, seed=seed_for(self.cfg.seed, t, client_id, "fjord_batch")),)}

    def batch_widths(self, client_id: int) -> tuple[float, ...]:
        """The tiers a client's steps draw from under ``batch`` (none under ``round``)."""
        if self.opts.od_sampling != "batch":
            return ()
        tiers = self.memo("fjord_tiers", None, lambda: sorted({float(c.capacity) for c in self.ctx.federation.clients}))
        p_max = float(self.ctx.federation.clients[client_id].capacity)
        return tuple(p for p in tiers if p <= p_max)

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
