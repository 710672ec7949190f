"""The one client extension point: named hooks a strategy declares for its clients' local training.

The client loop (:mod:`fedsap_ray.client`) is masked mini-batch SGD and names no algorithm.
Everything a method adds to local training (FedProx's proximal term, FedSAP's Eq. 7 and
channel statistics, SCAFFOLD's correction, MOON's contrastive term, DapperFL's pruning, ...)
is a :class:`ClientHook` subclass registered under a name in that method's module
(:func:`register_hook`). A strategy lists the names in ``plan.extra["hooks"]`` (a tuple,
run in that order) and puts what they read in ``plan.extra`` under the keys each hook
documents: pure data, so any worker can run any client. Whatever a hook sends back goes into
``ClientResult.stats`` (counted in bytes_up).

Hook points, in the order the client calls them (every hook of the plan at each point):

====================  ===================================================================
``__init__``          before the plan's values are loaded: read and check the payload; the
                      model's structure may be read, its values must not (they are stale)
``before_training``   the scratch model and the client's data, before the plan's values are
                      loaded into it (FedSAP's probe gradient); anything written to it is overwritten
``start``             the plan's values are loaded on the device, coordinates outside the
                      plan's mask are zero; build state from them (FedProx's anchor, masks)
``epoch_start``       at the start of each local epoch (ChannelStats watches the last one)
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
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fedsap_ray.data.base import DomainData
from fedsap_ray.masks import ParamLayout
from fedsap_ray.messages import ClientPlan
from fedsap_ray.models.space import MaskableModel

HOOKS_KEY = "hooks"  # plan.extra[HOOKS_KEY]: the names of the plan's client hooks, in calling order

_HOOKS: dict[str, type[ClientHook]] = {}


class ClientHook:
    """Does nothing at every hook point; subclasses override the points they need (module docstring)."""

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device) -> None:
        self.plan, self.layout, self.device = plan, layout, device

    def before_training(self, model: MaskableModel, data: DomainData) -> None:
        """The scratch model before the plan's values are loaded (they overwrite whatever is left in it)."""

    def start(self, model: MaskableModel) -> None:
        """The plan's values are loaded (zeros outside ``plan.mask``) and the model is on ``self.device``."""

    def epoch_start(self, model: MaskableModel, epoch: int) -> None:
        """Local epoch ``epoch`` (0-based, of ``plan.local_epochs``) begins."""

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


def register_hook(name: str) -> Callable[[type[ClientHook]], type[ClientHook]]:
    """Class decorator: make ``name`` usable in ``plan.extra["hooks"]``."""
    def deco(cls: type[ClientHook]) -> type[ClientHook]:
        if name in _HOOKS:
            raise ValueError(f"client hook {name!r} registered twice")
        _HOOKS[name] = cls
        return cls
    return deco


def unregister_hook(name: str) -> None:
    """Forget ``name`` (for tests that register a hook of their own)."""
    _HOOKS.pop(name, None)


def hook_names(plan: ClientPlan) -> tuple[str, ...]:
    """The plan's hook names (``plan.extra["hooks"]``), checked to be a sequence of distinct strings."""
    names: Any = plan.extra.get(HOOKS_KEY, ())
    if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"plan.extra[{HOOKS_KEY!r}] must be a tuple of hook names, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"plan.extra[{HOOKS_KEY!r}] names a hook twice: {list(names)}")
    return tuple(names)


def defines_loss(hook: ClientHook | type[ClientHook]) -> bool:
    """Whether a hook (class) overrides :meth:`ClientHook.loss`, i.e. gives the base loss."""
    cls = hook if isinstance(hook, type) else type(hook)
    return cls.loss is not ClientHook.loss


def make_hooks(plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device,
               built: list[ClientHook]) -> list[ClientHook]:
    """Build the plan's hooks in order, appending each to ``built`` as soon as it exists (so the caller
    can close those already built when a later one fails). Strategies register theirs on import."""
    names = hook_names(plan)
    if names:
        import fedsap_ray.algorithms  # noqa: F401  (registers every strategy's hooks, also on Ray workers)
    unknown = [n for n in names if n not in _HOOKS]
    if unknown:
        raise ValueError(f"unknown client hook(s) {unknown}; registered: {sorted(_HOOKS)}")
    losses = [n for n in names if defines_loss(_HOOKS[n])]
    if len(losses) > 1:
        raise ValueError(f"client hooks {losses} all define the base loss; at most one may")
    for n in names:
        built.append(_HOOKS[n](plan, model, layout, device))
    return built
