"""Held-out evaluation: per-domain top-1 accuracy and mean cross-entropy (the ``rounds`` table,
docs/reference/results.md#rounds)."""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsap_ray.data.base import DomainData, as_input
from fedsap_ray.masks import ParamLayout


@torch.no_grad()
def evaluate(model: nn.Module, layout: ParamLayout, params: np.ndarray, data: DomainData,
             device: torch.device, batch_size: int = 1024) -> tuple[float, float]:
    """(accuracy, loss) of ``params`` on ``data``; BatchNorm uses the aggregated running statistics."""
    model.to(device)
    layout.load_into(model, params)
    model.eval()
    correct, loss_sum, n = 0, 0.0, len(data)
    for i in range(0, n, batch_size):
        x = as_input(data.x[i:i + batch_size]).to(device)
        y = data.y[i:i + batch_size].to(device)
        out = model(x)
        loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
    return correct / max(n, 1), loss_sum / max(n, 1)


def evaluate_domains(scratch: list[nn.Module], layout: ParamLayout, models: dict[str, np.ndarray],
                     test: dict[str, DomainData], device: torch.device) -> dict[str, tuple[float, float]]:
    """Evaluate every domain, one domain per scratch module concurrently (threads; same numbers as serial)."""
    pool: queue.SimpleQueue = queue.SimpleQueue()
    for m in scratch:
        pool.put(m)

    def one(d: str) -> tuple[float, float]:
        m = pool.get()
        try:
            return evaluate(m, layout, models[d], test[d], device)
        finally:
            pool.put(m)

    domains = list(test)
    if len(scratch) <= 1 or len(domains) <= 1:
        return {d: one(d) for d in domains}
    with ThreadPoolExecutor(min(len(scratch), len(domains))) as ex:
        return dict(zip(domains, ex.map(one, domains)))


def summarise(per_domain: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Global accuracy = unweighted mean over domains at this round (papers/000 section 5)."""
    accs = np.array([a for a, _ in per_domain.values()])
    losses = np.array([l for _, l in per_domain.values()])
    return {"global_accuracy": float(accs.mean()), "loss": float(losses.mean()),
            "worst_domain_accuracy": float(accs.min())}
