"""MOON (Li, He and Song, CVPR 2021, "Model-Contrastive Federated Learning"), full model.

Every client trains the whole model; the server aggregates by FedAvg (sample-weighted
mean, :func:`fedsap_ray.algorithms.aggregation.masked_weighted_average` with full masks). The local
loss of one mini-batch is (MOON Section 3.3, Eqs. 2-3 of arXiv 2103.16257; Algorithm 1 lines 14-17)

    l     = l_sup + mu * l_con,                    l_sup = cross-entropy
    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) ),

averaged over the batch, with sim the cosine similarity, z the representation of the model
being trained, z_glob that of the round's global model w^t (frozen) and z_prev that of the
client's previous local model w_i^{t-1} (frozen).

Representation: MOON's networks have a projection head (two linear layers) between the
encoder and the classifier and contrast its output. Our models have a fixed
encoder -> classifier layout (``fedsap_ray.models``) and the parameter layout may not change,
so we use the encoder output ``model.forward_features(x)`` as the representation. That is
also what the FPL code base, on which the DapperFL code the FedSAP paper follows is built,
does for its MOON baseline (WenkeHuang/RethinkFL ``models/moon.py`` contrasts ``net.features``).

Frozen models: both are built on the client from plan data, as deep copies of the scratch
model, with no gradients. How their BatchNorm layers normalise is ``algorithm.frozen_bn``
(docs/readings.md, "MOON's frozen models"; issue 43):

- ``train`` (default): with the statistics of the batch being contrasted, as a module in train
  mode does. This is what the code base papers/000 follows does: WenkeHuang/RethinkFL
  ``models/moon.py`` (the FPL code base the DapperFL code is built on; jyzgh/DapperFL ships no
  MOON module of its own) deep-copies the global and previous nets and never calls ``.eval()`` on
  them (``_train_net`` runs ``global_net.features`` and ``prev_net.features`` as they are;
  ``utils/training.py`` ``global_evaluate`` puts the global net back in its former mode,
  ``net.train(status)``, after testing), so they run in train mode during local training.
  Each frozen copy is put in eval mode (no dropout; our models have none) and its BatchNorm
  layers lose their running-statistics buffers
  (``running_mean``/``running_var``/``num_batches_tracked`` set to None): PyTorch's BatchNorm then
  normalises with the batch statistics (``torch.nn.modules.batchnorm._BatchNorm.forward``:
  ``bn_training`` is true when both running buffers are None) and has nothing to update, so no
  forward pass of a frozen copy can write statistics anywhere, let alone into the trained model or
  what is uploaded. The output equals train mode's (train-mode BatchNorm normalises with the batch
  statistics too; updating running statistics does not change the current output) and is a
  deterministic function of the weights and the batch.
- ``eval``: with the running statistics the copies received, i.e. the server's sample-weighted
  average over clients and domains (the frozen global model) or the client's own (previous model),
  as the official code does (QinbinLi/MOON ``main.py``: ``global_model.eval()``, previous nets
  ``.eval()``), whose CNN for CIFAR-10 at mu = 5 has no BatchNorm. Our reading before issue 43: on the
  ``laptop`` preset (ResNet10 with BatchNorm, four digit domains, mu = 5) seed 2 collapses to chance
  from round 2, the contrastive term pulling every client toward a representation normalised with
  statistics averaged across domains (issue 43 has the diagnosis).

Previous model: clients are stateless here (any worker may run any client), so the server
keeps every client's last trained model in ``ServerState.strategy_state["prev"]`` (client id ->
float32 flat vector, only for clients that have trained) and sends it as
the ``moon`` hook's payload ``prev``; it is not counted in ``bytes_down`` (a real MOON client keeps it
locally: shipping it is the simulator's cost of stateless clients, not MOON's). "Previous" means
the model of the client's last participation, as in the official code, whose model pool
holds each party's net as it was after its last local training.

A client with no previous model yet (its first participation) uses the global model as
previous, as the Flower baseline written by MOON's first author does
(adap/flower ``baselines/moon/moon/client.py``: ``prev_net = deepcopy(net)`` right after
loading the global parameters). Then z_prev = z_glob, l_con = log 2 for every input and its
gradient is zero: the first participation is plain cross-entropy. The official repository
(QinbinLi/MOON ``main.py``) reaches the same thing in round 1 differently (its model pool is
still empty, so the contrastive logits hold only the positive pair and l_con = 0); a party
first sampled in a later round would there contrast with its own never-trained initial net.
With full participation (the FedSAP protocol) every client is new in round 1 and the
readings coincide.

Defaults (``--set algorithm.<name>=``):

- ``tau = 0.5``: the temperature of MOON's experiments (Section 4.1), the official code's
  ``--temperature`` default and the DapperFL/FPL code's best_args for Digits and
  Office-Caltech.
- ``mu = 5``: MOON reports the best mu as 5 on CIFAR-10 and 1 on CIFAR-100/Tiny-ImageNet
  (Section 4.1; the Flower baseline's ``conf/cifar10.yaml`` mu 5, ``conf/cifar100.yaml`` mu 1).
  Our benchmarks (Digits, Office-Caltech10) have 10 classes like CIFAR-10, and the DapperFL
  code the FedSAP paper follows (jyzgh/DapperFL
  ``fedml_api/standalone/domain_generalization/utils/best_args.py``, inherited from
  WenkeHuang/RethinkFL ``utils/best_args.py``) runs MOON with mu = 5 on both Digits and
  Office-Caltech.

- ``frozen_bn = train``: see "Frozen models" above and docs/readings.md.

The local optimiser, epochs and learning rate come from the config like every baseline's.

Compute: ``macs_per_sample`` is one forward pass of the full model (what the client runs at
inference); training runs more per step: the trained model's forward pass plus, under ``no_grad``,
``forward_features`` (the encoder, no classifier) of the frozen global model and, from the second
participation on, of the frozen previous model (a first participation reuses z_glob as z_prev, so
two passes). ``train_macs`` = samples_seen x (full MACs + k x encoder MACs), k = 2 (1 at the first
participation); backward runs on the trained model only.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_choice, check_number
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState


HOOK = "moon"


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON Eq. 2, batch mean: cross-entropy of the logits [sim(z, z_glob), sim(z, z_prev)] / tau with target 0."""
    pos = F.cosine_similarity(z, z_glob, dim=-1)
    neg = F.cosine_similarity(z, z_prev, dim=-1)
    logits = torch.stack([pos, neg], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


FROZEN_BN = ("train", "eval")  # algorithm.frozen_bn: how the frozen copies' BatchNorm normalises (module docstring)


def _frozen_copy(model: MaskableModel, layout: ParamLayout, values: np.ndarray, bn: str) -> MaskableModel:
    """A gradient-free eval-mode copy of ``model`` holding ``values`` (a full flat vector); with ``bn="train"``
    its BatchNorm layers normalise with batch statistics and hold no running statistics (module docstring)."""
    if bn not in FROZEN_BN:
        raise ValueError(f"frozen_bn must be one of {', '.join(FROZEN_BN)}, got {bn!r}")
    frozen = copy.deepcopy(model)
    layout.load_into(frozen, values)
    frozen.eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    if bn == "train":
        for m in frozen.modules():
            if isinstance(m, _BatchNorm):  # no running buffers: batch statistics, nothing to update
                m.running_mean = None
                m.running_var = None
                m.num_batches_tracked = None
    return frozen


@dataclass(frozen=True)
class MoonPayload:
    mu: float  # weight of l_con (algorithm.mu)
    tau: float  # temperature (algorithm.tau)
    prev: np.ndarray | None = None  # the client's previous local model (float32, full layout); None: first time
    frozen_bn: str = "train"  # BatchNorm of the frozen copies (algorithm.frozen_bn)


@register_hook(HOOK)
class MoonObjective(ClientHook):
    """CE + mu * l_con (MOON Eq. 3) with frozen global and previous models built from the plan."""

    Payload: ClassVar[type] = MoonPayload
    payload: MoonPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device) -> None:
        super().__init__(plan, model, layout, device)
        self.mu, self.tau = self.payload.mu, self.payload.tau
        start = plan.start_vector()
        self.glob = _frozen_copy(model, layout, start, self.payload.frozen_bn).to(device)
        prev = self.payload.prev
        if prev is None:  # first participation: the global model is the previous one (module docstring)
            self.prev = None
        else:
            prev = np.asarray(prev)
            if prev.dtype != np.float32 or prev.shape != (layout.size,):  # wire check: an array that arrived
                raise ValueError(f"the moon payload's prev must be float32 of shape ({layout.size},), "
                                 f"got {prev.dtype} {prev.shape}")
            self.prev = _frozen_copy(model, layout, prev, self.payload.frozen_bn).to(device)

    def representations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_glob, z_prev) of a batch, without gradients."""
        with torch.no_grad():
            z_glob = self.glob.forward_features(x)
            z_prev = z_glob if self.prev is None else self.prev.forward_features(x)
        return z_glob, z_prev

    def contrastive(self, model: MaskableModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, l_con) of the model being trained on batch ``x``."""
        z = model.forward_features(x)
        z_glob, z_prev = self.representations(x)
        return z, model_contrastive_loss(z, z_glob, z_prev, self.tau)

    def loss(self, model: MaskableModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z, l_con = self.contrastive(model, x)
        logits = getattr(model, model.classifier)(z)
        return F.cross_entropy(logits, y) + self.mu * l_con


@register("moon")
class Moon(FedAvg):
    summary = "full model, FedAvg + model-contrastive loss (global vs previous local representation)"
    state_vectors = ("prev",)  # each client's previous local model

    @dataclass(frozen=True)
    class Options:
        mu: float = 5.0  # weight of l_con (MOON Eq. 3; 5 as in the DapperFL code for Digits/Office)
        tau: float = 0.5  # temperature (MOON Section 4.1)
        frozen_bn: str = "train"  # train: frozen copies' BN on batch statistics (papers/000's code base); eval: running stats

        def __post_init__(self) -> None:
            check_number("algorithm.mu", self.mu, 0)
            check_number("algorithm.tau", self.tau, 0, low_open=True)
            check_choice("algorithm.frozen_bn", self.frozen_bn, FROZEN_BN)

    def train_macs(self, plan: ClientPlan, result: ClientResult) -> int:
        """samples_seen x (full forward + k frozen encoder forwards), k = 2, or 1 with no previous model
        (module docstring, "Compute")."""
        k = 1 if plan.payload(HOOK).prev is None else 2
        return int(result.samples_seen) * (self.compute.mask_macs(None) + k * self.compute.encoder_macs())

    def init_state(self) -> ServerState:
        """The seeded template as w^0 and no previous local models yet."""
        state = super().init_state()
        state.strategy_state = {"prev": {}}
        return state

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict[str, Any]:
        prev = state.strategy_state["prev"].get(client_id)  # shared with the state, never mutated
        # a real MOON client keeps its previous model on the device: shipping it is a simulation
        # artefact (clients are stateless here), so it is not counted in bytes_down
        return {"hooks": (call(MoonObjective, mu=float(self.opts.mu), tau=float(self.opts.tau), prev=prev,
                                frozen_bn=self.opts.frozen_bn),)}

    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> dict[str, Any]:
        """Store each participant's trained model as its next previous model w_i^{t-1} (MOON Algorithm 1)."""
        prev = dict(state.strategy_state["prev"])
        for r in results:
            if r.values.size != params.size:
                raise ValueError(f"client {r.client_id}: full update has {r.values.size} values, model has {params.size}")
            prev[r.client_id] = np.array(r.values, dtype=np.float32, copy=True)
        extra = dict(state.strategy_state)
        extra["prev"] = prev
        return extra
