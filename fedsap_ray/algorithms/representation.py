"""The representation-norm regulariser on z = f_enc(x), shared by FedSAP and DapperFL.

FedSAP's Eq. 7 (papers/000) adds (gamma/|B|) sum_x ||f_enc(x)||_2^2 to the cross-entropy
(``form="squared"``); DapperFL's DAR (jyzgh/DapperFL ``models/dapperfl.py``, ``--reg_coeff``)
adds gamma * mean_x ||z||_2, the unsquared norm (``form="norm"``). The ``rep_norm`` client
hook (:class:`RepresentationNorm`) makes it the base loss of local training; its payload is
:class:`RepNormPayload`: ``gamma`` and ``form`` (default ``squared``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from fedsap_ray.algorithms.hooks import ClientHook, register_hook
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.models.sliced import SlicedModel

HOOK = "rep_norm"
REP_FORMS = ("norm", "squared")


def rep_norm_loss(model: MaskableModel, x: torch.Tensor, y: torch.Tensor, gamma: float,
                  form: str = "squared") -> torch.Tensor:
    """Cross-entropy plus gamma times the batch mean of ||z||_2^2 (``squared``, papers/000 Eq. 7) or
    ||z||_2 (``norm``, DapperFL's DAR); the plain ``cross_entropy(model(x), y)`` when gamma <= 0."""
    if gamma <= 0:
        return F.cross_entropy(model(x), y)
    if form not in REP_FORMS:
        raise ValueError(f"unknown representation-norm form {form!r}; allowed: {REP_FORMS}")
    z = model.forward_features(x)
    reg = z.pow(2).sum(dim=1).mean() if form == "squared" else z.norm(dim=1).mean()
    return F.cross_entropy(getattr(model, model.classifier)(z), y) + gamma * reg


@dataclass(frozen=True)
class RepNormPayload:
    gamma: float  # the regulariser's weight (FedSAP's / DapperFL's gamma option)
    form: str = "squared"  # one of REP_FORMS (validated by the options that chose it)


@register_hook(HOOK)
class RepresentationNorm(ClientHook):
    """The base loss :func:`rep_norm_loss` with the payload's ``gamma`` and ``form``.

    Works on a sliced sub-network as is: a dropped channel's feature is exactly 0 in the masked model, so
    ||z|| over the sub-network's features is the same norm."""

    supports_sliced = True
    supports_compile = True  # its loss runs the network through the model it is given (the compiled view)
    Payload: ClassVar[type] = RepNormPayload
    payload: RepNormPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device,
                 sliced: SlicedModel | None = None) -> None:
        super().__init__(plan, model, layout, device, sliced)
        self.gamma, self.form = self.payload.gamma, self.payload.form

    def loss(self, model: MaskableModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return rep_norm_loss(model, x, y, self.gamma, self.form)
