"""Staleness weights of asynchronous updates (``asynchronous.staleness``; :mod:`fedsap_ray.engine.asyncmode`).

An update trained on model version v and applied when the server holds version V has staleness
s = V - v (server steps it missed). FedAsync (Xie, Koyejo and Gupta 2019, "Asynchronous Federated
Optimization", section 5.2, the functions s(t - tau) of their mixing weight alpha_t = alpha x s(t - tau))
gives three rules, which FedBuff (Nguyen et al. 2022, section 3 and Algorithm 1) reuses to scale each
buffered delta:

- constant:   s(s) = 1
- polynomial: s(s) = (1 + s)^(-a)                                 (FedAsync: a = 0.5 in the experiments)
- hinge:      s(s) = 1 if s <= b else 1 / (a (s - b) + 1)         (FedAsync: a = 10, b = 4)

Every rule is 1 at s = 0, so a fresh update is never scaled. Here, beside the strategies, rather than in the
engine: a strategy moves its own state by the same factor (FjORD's ``staleness_factor``).
"""
from __future__ import annotations

from fedsap_ray.config.device_config import AsyncConfig

DEFAULT_A = {"polynomial": 0.5, "hinge": 10.0}  # FedAsync's experimental values (asynchronous.staleness_a null)


def staleness_weight(rule: str, s: int, a: float | None = None, b: float = 4.0) -> float:
    """s(s) of ``rule`` (module docstring); ``a`` None takes FedAsync's value for the rule."""
    if s < 0:
        raise ValueError(f"staleness must be >= 0, got {s}")
    if rule == "constant":
        return 1.0
    a_ = DEFAULT_A[rule] if a is None else float(a)
    if rule == "polynomial":
        return float((1.0 + s) ** (-a_))
    if rule == "hinge":
        return 1.0 if s <= b else 1.0 / (a_ * (s - b) + 1.0)
    raise ValueError(f"unknown staleness rule {rule!r}")


def weight_for(cfg: AsyncConfig, s: int) -> float:
    """s(s) under the config's rule and parameters."""
    return staleness_weight(cfg.staleness, s, cfg.staleness_a, cfg.staleness_b)


def update_factor(cfg: AsyncConfig, s: int) -> float:
    """eta_g s(s): the factor the asynchronous engine applies to an update of staleness ``s`` (the server
    learning rate times its staleness weight), for the model and for any state a strategy moves the same way."""
    return float(cfg.server_lr) * weight_for(cfg, s)
