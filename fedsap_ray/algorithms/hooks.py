"""The one client extension point: named hooks a strategy declares for its clients' local training.

The client loop (:mod:`fedsap_ray.engine.client`) is mini-batch SGD on the plan's sub-model (sliced or masked) and names no algorithm.
Everything a method adds to local training (FedProx's proximal term, FedSAP's Eq. 7 and
channel statistics, SCAFFOLD's correction, MOON's contrastive term, DapperFL's pruning, ...)
is a :class:`ClientHook` subclass registered under a name in that method's module
(:func:`register_hook`, the one generic registry :data:`fedsap_ray.config.registry.HOOKS`). Each hook
declares what it reads as a frozen dataclass, its ``Payload`` (module-level, so it pickles to Ray
workers). A strategy puts the hooks of a plan in ``plan.hooks``, a tuple of :class:`HookCall`
(hook name, payload instance) run in that order, each built one way: ``call(HookClass, field=...)``.
The hook receives its own typed payload as ``self.payload``: pure data, so any worker can run any
client. The payload's values were validated where they came from (the strategy's typed options);
a hook checks only the type and shape of arrays that arrive over the wire (wire checks). Whatever
a hook sends back goes into ``ClientResult.stats`` (counted in bytes_up).

Hook points, in the order the client calls them (every hook of the plan at each point):

====================  ===================================================================
``__init__``          before the plan's values are loaded: read the payload (``self.payload``); the
                      model's structure may be read, its values must not (they are stale)
``before_training``   the scratch model and the client's data, before the plan's values are
                      loaded into it (FedSAP's probe gradient); anything written to it is overwritten
``start``             the plan's values are loaded on the device, coordinates outside the
                      plan's mask are zero; build state from them (FedProx's anchor, masks)
``epoch_start``       at the start of each local epoch (ChannelStats watches the last one)
``batch_start``       a batch's step begins (gradients zeroed, before the forward pass): FjORD's
                      ``od_sampling=batch`` narrows the model to the step's drawn width here (and
                      swaps in that width's BatchNorm statistics under ``od_bn=per_width``)
``loss``              the batch's base loss; at most one hook of a plan defines it, otherwise
                      it is ``cross_entropy(model(x), y)``
``add_terms``         ``loss -> loss + term`` (FedProx's (mu/2)||w - w^t||^2), after the base
``after_backward``    gradients are masked to the plan's coordinates, not yet clipped
``after_clip``        gradients are clipped (``grad_clip``); the optimiser step comes next
``after_step``        the optimiser step is done
``result``            arrays for ``ClientResult.stats`` (keys must not collide across hooks)
``upload_mask``       coordinates to upload when the client chose them (at most one hook)
``close``             always, in a ``finally``: remove module hooks from the reused scratch model
====================  ===================================================================

Hooks never change the order of the loop's own floating-point operations: a plan without
hooks trains exactly as the plain loop.

Sliced sub-models (``training.submodel=sliced``, the default; docs/architecture.md#sub-model-training):
when the plan's mask is a channel sub-model the client trains a dense smaller network
(:class:`fedsap_ray.models.sliced.SlicedModel`) instead of the masked full-size one, but only if EVERY hook of
the plan declares ``supports_sliced = True``; otherwise the plan trains masked, bit for bit as before.
A hook that supports it is built with ``sliced`` (None when the plan trains masked or has no mask) and

- its ``model`` and ``layout`` arguments, ``self.layout``, ``before_training``'s model and
  ``plan.values``/``plan.mask``/``self.payload`` stay in the FULL-size coordinates (the plan's);
- every later hook point (``start`` ... ``result``) receives the model being trained: the
  sub-network ``sliced.model`` with layout ``sliced.layout`` (:attr:`ClientHook.train_layout`);
- ``sliced.gather`` maps a full flat vector to the sub-network's coordinates (SCAFFOLD's control),
  ``sliced.index``/``sliced.channel_masks`` map sub-network values back (FedSAP's statistics are
  scattered to the full channel space, 0 on inactive channels, what masked training gives there).

A hook that only touches ``model.parameters()`` or the loss (FedProx, Eq. 7) needs no mapping. The
default is False because a hook written for the full model may read full-size coordinates, a
frozen full-size copy or choose its own upload mask (MOON, FedSR, FPL, FedSPU, DapperFL).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from fedsap_ray.data.base import DomainData
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan, HookCall
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.config.registry import HOOKS
from fedsap_ray.models.sliced import SlicedModel

_HOOKS: dict[str, type[ClientHook]] = HOOKS.entries  # the table itself (tests register and unregister)


@dataclass(frozen=True)
class NoPayload:
    """The payload of a hook that reads nothing but the plan's own fields."""


class ClientHook:
    """Does nothing at every hook point; subclasses override the points they need (module docstring)."""

    name: ClassVar[str]  # set by @register_hook
    # what the hook reads, a frozen dataclass defined at module level (plans cross to Ray workers)
    Payload: ClassVar[type] = NoPayload
    # whether the hook works on a sliced sub-network (module docstring, "Sliced sub-models"); a plan
    # with any hook that does not trains masked
    supports_sliced: ClassVar[bool] = False
    # whether the loop may compute the model's forward through torch.compile (resources.compile,
    # fedsap_ray.engine.compiled) with this hook: true for a hook whose loss runs the network only through the
    # model it is given (the loop gives the compiled view: its call and forward_features) and whose other work
    # reads parameters, gradients or activations through module hooks (Dynamo traces those, guarded); false for
    # one that runs other networks or the model in another mode; a plan with any hook that does not trains
    # eager, by name
    supports_compile: ClassVar[bool] = False
    payload: Any

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device,
                 sliced: SlicedModel | None = None) -> None:
        if sliced is not None and not self.supports_sliced:
            raise TypeError(f"client hook {type(self).__name__} does not support sliced sub-models")
        self.plan, self.layout, self.device, self.sliced = plan, layout, device, sliced
        self.payload = payload_of(plan, type(self))

    @property
    def train_layout(self) -> ParamLayout:
        """The layout of the model the hook points receive: the sub-network's when sliced, else ``self.layout``."""
        return self.layout if self.sliced is None else self.sliced.layout

    def before_training(self, model: MaskableModel, data: DomainData) -> None:
        """The scratch model before the plan's values are loaded (they overwrite whatever is left in it)."""

    def start(self, model: MaskableModel) -> None:
        """The plan's values are loaded (zeros outside ``plan.mask``) and the model is on ``self.device``."""

    def epoch_start(self, model: MaskableModel, epoch: int) -> None:
        """Local epoch ``epoch`` (0-based, of ``plan.local_epochs``) begins."""

    def batch_start(self, model: MaskableModel, step: int) -> None:
        """Step ``step`` (0-based, over all local epochs) begins: gradients are zeroed, the forward pass is next."""

    def loss(self, model: MaskableModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The base loss of a batch (a hook that overrides this replaces the client's cross-entropy)."""
        return None

    def add_terms(self, model: MaskableModel, loss: torch.Tensor) -> torch.Tensor:
        """The batch loss with this hook's terms added (e.g. ``loss + 0.5 * mu * prox``)."""
        return loss

    def after_backward(self, model: MaskableModel) -> None:
        """Gradients are masked to the plan's coordinates; clipping and the optimiser step come next."""

    def after_clip(self, model: MaskableModel) -> None:
        """Gradients are clipped to ``plan.grad_clip`` (when set); the optimiser step comes next."""

    def after_step(self, model: MaskableModel) -> None:
        """The optimiser step is done (e.g. restore coordinates that must not move)."""

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        """Arrays to send back with the trained values (``ClientResult.stats``)."""
        return {}

    def upload_mask(self) -> np.ndarray | None:
        """Coordinates to upload when the client chose them itself (DapperFL's pruning); None: the plan's mask.
        The strategy must know the same mask (e.g. from :meth:`result`) to read the values."""
        return None

    def close(self) -> None:
        """Training ended, normally or not: release what was attached to the model."""


H = TypeVar("H", bound=type[ClientHook])


def register_hook(name: str) -> Callable[[H], H]:
    """Class decorator: register a :class:`ClientHook` under ``name`` (its ``name``) for ``plan.hooks``."""
    return HOOKS.register(name)


def unregister_hook(name: str) -> None:
    """Forget ``name`` (for tests that register a hook of their own)."""
    HOOKS.unregister(name)


def call(hook: type[ClientHook], /, **fields: Any) -> HookCall:
    """The plan entry that runs ``hook`` with its payload ``hook.Payload(**fields)`` (the one way to build one)."""
    return HookCall(hook.name, hook.Payload(**fields))


def payload_of(plan: ClientPlan, hook: type[ClientHook]) -> Any:
    """The payload the plan sends ``hook``, checked to be of its ``Payload`` type; a plan built without the
    hook (a test constructing one directly) gives the default payload when there is one."""
    for c in plan.hooks:
        if c.name == getattr(hook, "name", None):
            if not isinstance(c.payload, hook.Payload):
                raise TypeError(f"plan.hooks: the payload of client hook {c.name!r} must be a "
                                f"{hook.Payload.__qualname__}, got {type(c.payload).__qualname__}")
            return c.payload
    try:
        return hook.Payload()
    except TypeError:
        raise ValueError(f"plan.hooks has no payload for client hook {getattr(hook, 'name', hook.__name__)!r}") from None


def hook_names(plan: ClientPlan) -> tuple[str, ...]:
    """The plan's hook names, in calling order, checked to be distinct :class:`HookCall`s."""
    calls: Any = plan.hooks
    if not isinstance(calls, tuple) or not all(isinstance(c, HookCall) for c in calls):
        raise TypeError(f"plan.hooks must be a tuple of HookCall (hooks.call(HookClass, ...)), got {calls!r}")
    names = tuple(c.name for c in calls)
    if len(set(names)) != len(names):
        raise ValueError(f"plan.hooks names a hook twice: {list(names)}")
    return names


def defines_loss(hook: ClientHook | type[ClientHook]) -> bool:
    """Whether a hook (class) overrides :meth:`ClientHook.loss`, i.e. gives the base loss."""
    cls = hook if isinstance(hook, type) else type(hook)
    return cls.loss is not ClientHook.loss


def hook_classes(plan: ClientPlan) -> list[type[ClientHook]]:
    """The classes of the plan's hooks, in order; raises on an unknown name. Strategies register theirs on import."""
    names = hook_names(plan)
    if names:
        HOOKS.load()  # imports fedsap_ray.algorithms: registers every strategy's hooks, also on Ray workers
    unknown = [n for n in names if n not in _HOOKS]
    if unknown:
        raise ValueError(f"unknown client hook(s) {unknown}; registered: {sorted(_HOOKS)}")
    return [_HOOKS[n] for n in names]


def supports_sliced(plan: ClientPlan) -> bool:
    """Whether every hook of the plan works on a sliced sub-network (a plan without hooks does)."""
    return all(cls.supports_sliced for cls in hook_classes(plan))


def make_hooks(plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device,
               built: list[ClientHook], sliced: SlicedModel | None = None) -> list[ClientHook]:
    """Build the plan's hooks in order, appending each to ``built`` as soon as it exists (so the caller
    can close those already built when a later one fails). ``model``/``layout`` are the full-size ones;
    ``sliced`` the sub-network the client trains (only when :func:`supports_sliced`)."""
    classes = hook_classes(plan)
    losses = [n for n, cls in zip(hook_names(plan), classes) if defines_loss(cls)]
    if len(losses) > 1:
        raise ValueError(f"client hooks {losses} all define the base loss; at most one may")
    for cls in classes:
        # hooks that do not support sliced models keep the four-argument constructor
        built.append(cls(plan, model, layout, device) if sliced is None else cls(plan, model, layout, device, sliced=sliced))
    return built
