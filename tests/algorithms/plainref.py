"""Plain-PyTorch pieces the equivalence tests' references share (tests/algorithms/test_reference_*.py).

Imports nothing of fedsap_ray, on purpose: a reference built from these can only agree with ours if the rule
it writes down is the one ours computes. Weights are a dict of plain tensors named as the ``mlp`` model's state
(``fc1``, ``fc2``: the two hidden layers, ``fc3``: the classifier), a client's data plain tensors, its batches
index tensors drawn from its plan's seed as a client draws them (one ``randperm`` a local epoch from one
generator, a last batch of one sample skipped, at most ``max_steps`` steps an epoch).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F

Weights = dict[str, torch.Tensor]
HIDDEN = ("fc1", "fc2")  # the maskable layers, in forward order; fc3 is the classifier


def forward(w: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Logits of the three-layer ReLU MLP ``w`` (any widths)."""
    h = F.relu(F.linear(x, w["fc1.weight"], w["fc1.bias"]))
    h = F.relu(F.linear(h, w["fc2.weight"], w["fc2.bias"]))
    return F.linear(h, w["fc3.weight"], w["fc3.bias"])


def batches(n: int, batch_size: int, seed: int, epochs: int, max_steps: int | None) -> Iterator[torch.Tensor]:
    """The index tensors of a client's local steps, in order."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        steps = 0
        for lo in range(0, n, batch_size):
            idx = order[lo:lo + batch_size]
            if len(idx) < 2 <= n:
                continue
            yield idx
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break


def local_sgd(w: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, steps: Iterator[torch.Tensor], *,
              lr: float, momentum: float = 0.0, weight_decay: float = 0.0, grad_clip: float | None = None,
              loss_fn: Callable[[Weights, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
              after_step: Callable[[Weights], None] | None = None) -> tuple[Weights, int]:
    """(trained copy of ``w``, number of steps): torch's SGD on ``loss_fn`` (cross-entropy of :func:`forward` by
    default), the gradient's norm clipped to ``grad_clip`` before each step; ``after_step`` may edit the weights
    in place after each step (under ``torch.no_grad``)."""
    p = {k: v.detach().clone().requires_grad_(True) for k, v in w.items()}
    opt = torch.optim.SGD(list(p.values()), lr=lr, momentum=momentum, weight_decay=weight_decay)
    k = 0
    for idx in steps:
        opt.zero_grad()
        xb, yb = x[idx], y[idx]
        loss = loss_fn(p, xb, yb) if loss_fn is not None else F.cross_entropy(forward(p, xb), yb)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(list(p.values()), grad_clip)
        opt.step()
        if after_step is not None:
            with torch.no_grad():
                after_step(p)
        k += 1
    return {name: v.detach() for name, v in p.items()}, k


def kept(channels: int, rate: float) -> int:
    """Channels a width-``rate`` sub-model keeps of a layer of ``channels``: the leading ceil(rate x channels)
    (HeteroFL's ``split_model``)."""
    return int(math.ceil(channels * rate))


def sub_indices(w: Mapping[str, torch.Tensor], rate: float) -> dict[str, tuple[slice, slice]]:
    """Per tensor, the (rows, columns) of the width-``rate`` sub-model: the leading channels of each hidden layer
    (its rows and its bias) and of the next layer's inputs (columns); the classifier keeps every row."""
    keep = {name: kept(w[f"{name}.weight"].shape[0], rate) for name in HIDDEN}
    out: dict[str, tuple[slice, slice]] = {}
    prev = slice(None)
    for layer in ("fc1", "fc2", "fc3"):
        rows = slice(0, keep[layer]) if layer in keep else slice(None)
        out[f"{layer}.weight"] = (rows, prev)
        out[f"{layer}.bias"] = (rows, slice(None))
        prev = rows
    return out


def extract(w: Mapping[str, torch.Tensor], rate: float) -> Weights:
    """The width-``rate`` sub-model of ``w`` (copies)."""
    idx = sub_indices(w, rate)
    return {k: (v[idx[k]] if v.dim() == 2 else v[idx[k][0]]).clone() for k, v in w.items()}


def sample_mean(models: list[Weights], sizes: list[int]) -> Weights:
    """FedAvg's server step: the mean of the clients' models weighted by their sample counts (in float64)."""
    total = sum(sizes)
    return {k: (sum(n * m[k].double() for m, n in zip(models, sizes)) / total).float() for k in models[0]}
