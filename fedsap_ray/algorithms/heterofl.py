"""HeteroFL (Diao et al. 2021) as papers/003 runs it: static resource-only widths p_i = p_max_i.

Nested sub-models and coordinate-wise aggregation (papers/003 Algorithms 1-2); the
widest tier trains the full model, so every coordinate stays covered (Table 4's
"full coverage" row). HeteroFL's static batch-norm and scaler modules are not part of
papers/003's protocol and are not modelled.

Two readings of the authors' code are options (docs/readings.md#heterofl-as-its-authors-code-runs-it;
repository diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-Heterogeneous-Clients):

- ``weighting=count``: ``src/fed.py`` ``Federation.combine`` divides each coordinate's sum by the number of
  clients that hold it, not by their samples; here every client's weight is 1 in the same coordinate-wise mean.
- ``label_mask=true``: with its ``mask`` control on, the models' ``forward`` (``src/models/conv.py``,
  ``resnet.py``) fills the logits of the classes a client does not hold with 0 (not -inf: they stay in the
  softmax's denominator, their gradient is cut) before the cross-entropy, and ``combine`` averages each
  classifier row (weight row and bias) over the clients whose label split holds that class only. A client
  knows its classes from its own data (:class:`LabelMask`) and sends them with its update (one byte a class,
  counted in ``bytes_up``), so the server never reads the data.

The defaults (``samples``, ``false``) are papers/003 Algorithm 1 line 18, what every run before these options computed.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedsap_ray.algorithms.aggregation import Contribution, masked_weighted_average
from fedsap_ray.algorithms.fedavg import WEIGHTINGS, FedAvg
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.registry import register
from fedsap_ray.algorithms.widths import CAPACITY
from fedsap_ray.data.base import DomainData
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.config.checks import check_bool, check_choice

HOOK = "heterofl_label_mask"
CLASSES = "held_classes"  # ClientResult.stats key: bool [num_classes], the classes of the client's training data


@register_hook(HOOK)
class LabelMask(ClientHook):
    """The base loss with the logits of the classes absent from the client's training data filled with 0 (the
    authors' ``masked_fill(label_mask == 0, 0)``); sends back which classes it held (:data:`CLASSES`).

    Works on a sliced sub-network as is: the classifier's output units are never sliced."""

    supports_sliced = True
    supports_compile = True  # its loss calls the model it is given (the compiled view)

    def before_training(self, model: MaskableModel, data: DomainData) -> None:
        self.held_ids = torch.unique(data.y).to(self.device)

    def start(self, model: MaskableModel) -> None:
        classes = int(getattr(model, model.classifier).weight.shape[0])
        self.absent = torch.ones(classes, dtype=torch.bool, device=self.device)
        self.absent[self.held_ids] = False

    def loss(self, model: MaskableModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).masked_fill(self.absent, 0.0), y)

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        return {CLASSES: (~self.absent).cpu().numpy()}


@register("heterofl")
class HeteroFL(FedAvg):
    summary = "static nested sub-models at p_max, coordinate-wise aggregation"
    confound_variants = {"heterofl": ()}  # papers/003 Table 3
    supports_async = True  # docs/readings.md#asynchronous-training
    supports_privacy = True  # widths from capacity; label_mask refused (privacy_support)  # docs/readings.md#privacy

    @dataclass(frozen=True)
    class Options:
        """Not FedAvg's ``width`` (the rule is fixed); the two readings of the authors' code (module docstring)."""

        # samples: each coordinate's mean over the clients holding it, weighted by their samples (papers/003);
        # count: weighted by 1 per client, as the authors' src/fed.py combine
        weighting: str = "samples"
        # true: logits of classes a client does not hold are 0 in its training and each classifier row is averaged
        # over the clients holding that class only (the authors' mask=1 setting)
        label_mask: bool = False

        def __post_init__(self) -> None:
            check_choice("algorithm.weighting", self.weighting, WEIGHTINGS)
            check_bool("algorithm.label_mask", self.label_mask)

    width = CAPACITY

    @classmethod
    def privacy_support(cls, options: Any) -> str | None:
        """label_mask uploads which classes a client holds (its data's label set), which no mechanism covers."""
        if getattr(options, "label_mask", False):
            return "algorithm.label_mask uploads the classes each client holds, which no mechanism covers"
        return super().privacy_support(options)

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict[str, Any]:
        return {"hooks": (call(LabelMask),)} if self.opts.label_mask else {}

    def merge(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult], t: int) -> np.ndarray:
        """FedAvg's coordinate-wise mean with this run's weighting, each result's classifier rows of classes it
        does not hold left out under ``label_mask`` (with both defaults: exactly :meth:`FedAvg.merge`)."""
        return masked_weighted_average(state.params, [self.contribution(r) for r in results])

    def contribution(self, r: ClientResult) -> Contribution:
        """(mask, values, weight) of one result: weight n_i or 1, and under ``label_mask`` the mask and values
        without the classifier rows of the classes the client reported absent."""
        weight = self.client_weight(r)
        if not self.opts.label_mask:
            return r.mask, r.values, weight
        keep = self.held_rows(self.held_classes(r))
        if keep is None:
            return r.mask, r.values, weight
        if r.mask is None:
            return keep, r.values[keep], weight
        return r.mask & keep, r.values[keep[r.mask]], weight

    def held_classes(self, r: ClientResult) -> np.ndarray:
        """The client's reported classes (:data:`CLASSES`), checked as what arrives over the wire is."""
        classes = self.ctx.federation.num_classes
        held = r.stats.get(CLASSES)
        if not isinstance(held, np.ndarray) or held.dtype != np.bool_ or held.shape != (classes,):
            got = "nothing" if held is None else f"{getattr(held, 'dtype', type(held).__name__)} {getattr(held, 'shape', '')}"
            raise ValueError(f"round {r.round}, client {r.client_id} (HeteroFL, label_mask): stats[{CLASSES!r}] must be "
                             f"a bool vector of the {classes} classes, got {got}")
        return held

    def held_rows(self, held: np.ndarray) -> np.ndarray | None:
        """Coordinates outside the classifier rows of the classes not in ``held`` (None: every class held, nothing
        to leave out); cached per class set."""
        if held.all():
            return None

        def compute() -> np.ndarray:
            layout, name = self.ctx.layout, self.ctx.model.classifier
            keep = np.ones(layout.size, dtype=np.bool_)
            for tensor in (f"{name}.weight", f"{name}.bias"):
                if tensor in layout.names:
                    lo, hi = layout.span(tensor)
                    keep[lo:hi].reshape(held.size, -1)[~held] = False
            return keep

        return self.memo("heterofl_held_rows", held.tobytes(), compute, maxsize=64)
