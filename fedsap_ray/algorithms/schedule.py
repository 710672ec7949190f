"""A round's optimiser settings for a client's plan, from the config alone: every strategy's clients follow the
same learning-rate schedule and seeds unless the method's paper says otherwise (SCAFFOLD's momentum 0)."""
from __future__ import annotations

from typing import Any

from fedsap_ray.config.schema import ExperimentConfig
from fedsap_ray.common.seeding import seed_for


def lr_at(cfg: ExperimentConfig, t: int) -> float:
    """Learning rate of round t (1-based): lr * decay^(t-1) (papers/003 section 4.1)."""
    tr = cfg.training
    return tr.lr * tr.lr_decay ** (t - 1)


def plan_settings(cfg: ExperimentConfig, t: int, client_id: int) -> dict[str, Any]:
    """The :class:`~fedsap_ray.common.messages.ClientPlan` fields of client ``client_id``'s round ``t`` that the config
    decides (epochs, batch size, learning rate, optimiser, its training seed, the sub-model mode)."""
    tr = cfg.training
    return dict(
        client_id=client_id, round=t, local_epochs=tr.local_epochs, batch_size=tr.batch_size,
        lr=lr_at(cfg, t), momentum=tr.momentum, weight_decay=tr.weight_decay, grad_clip=tr.grad_clip,
        max_steps_per_epoch=tr.max_steps_per_epoch, seed=seed_for(cfg.seed, t, client_id, "train"),
        submodel=tr.submodel,
    )
