"""Ours, driven on exact inputs for the equivalence tests (tests/algorithms/test_reference_*.py).

A tiny ``mlp`` federation config on ``generated_blobs`` (only its size, classes and capacities matter: the
clients train on the tensors a test hands them, not on the federation's data), the strategy built in-process,
and each round's plans trained by :func:`fedsap_ray.engine.client.train_client` on those tensors, in client-id order,
then aggregated by the strategy. What a reference needs from a plan is plain data: its seed (the batch order)
and its learning rate.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from conftest import make_strategy
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import DomainData
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState

# 6 features would do; generated_blobs has 32 and 10 classes. Width 1/32: hidden layers of 16 and 8 units.
BASE = ["data.name=generated_blobs", "model.name=mlp", "data.partition=iid", "data.client_fraction=1.0",
        "data.max_train_per_domain=40", "data.max_test_per_domain=20", "model.width_mult=0.03125",
        "training.participation=1.0", "training.batch_size=8", "training.local_epochs=2",
        "training.max_steps_per_epoch=3", "training.lr=0.1", "training.momentum=0.0", "training.weight_decay=0.0"]
FEATURES, CLASSES = 32, 10


@dataclass
class Trace:
    """What ours did: the states (``states[0]`` initial, ``states[t]`` after round t), each round's plans and
    results, and the layout that maps a flat vector to named tensors."""

    layout: ParamLayout
    states: list[ServerState]
    plans: list[dict[int, ClientPlan]]
    results: list[list[ClientResult]]

    def weights(self, flat: np.ndarray) -> dict[str, torch.Tensor]:
        """``flat`` as the model's named float32 tensors (plain tensors, for a reference)."""
        lay = self.layout
        return {n: torch.from_numpy(flat[o:o + int(np.prod(s))].reshape(s).copy())
                for n, s, o in zip(lay.names, lay.shapes, lay.offsets)}

    def round_weights(self, t: int) -> dict[str, torch.Tensor]:
        return self.weights(self.states[t].params)


def config(algorithm: str, clients: int, *extra: str):
    return build_config(preset="smoke", overrides=[f"algorithm.name={algorithm}", *BASE, f"data.num_clients={clients}",
                                                   *extra])


def client_data(sizes: list[int], seed: int = 7, classes: list[list[int]] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded plain data: client i holds ``sizes[i]`` samples of 32 features, its labels drawn from
    ``classes[i]`` (every class by default)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        pool = torch.arange(CLASSES) if classes is None else torch.tensor(classes[i])
        y = pool[torch.randint(0, len(pool), (n,), generator=g)]
        x = torch.randn(n, FEATURES, generator=g) + 0.5 * y[:, None].float()
        out.append((x, y))
    return out


def drive(cfg, data: list[tuple[torch.Tensor, torch.Tensor]], rounds: int) -> Trace:
    """Ours for ``rounds`` rounds on ``data`` (client i trains on ``data[i]``)."""
    fed = build_federation(cfg)
    ctx, strat = make_strategy(cfg, fed)
    scratch = copy.deepcopy(ctx.model)
    trace = Trace(ctx.layout, [strat.init_state()], [], [])
    for t in range(1, rounds + 1):
        plans = strat.configure_round(trace.states[-1], t)
        results = [train_client(plans[c], scratch, ctx.layout, DomainData(*data[c])) for c in sorted(plans)]
        trace.states.append(strat.aggregate(trace.states[-1], plans, results, t).state)
        trace.plans.append(plans)
        trace.results.append(results)
    return trace


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest coordinate difference of two weight dicts with the same names and shapes."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
