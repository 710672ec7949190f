"""FedSR (Nguyen, Torr and Lim, NeurIPS 2022, "FedSR: A Simple and Effective Domain
Generalization Method for Federated Learning"), full model.

Citation note: papers/000 (Table 1, Appendix A) names this baseline "FedSR (Caldarola et
al. 2022)", but its reference list gives Caldarola, Caputo and Ciccone, "Improving
generalization in federated learning by seeking flat minima" (ECCV 2022, FedSAM). The
method papers/000 Appendix A describes ("regularizing latent representations ... penalizes
domain-sensitive variations") is Nguyen et al.'s FedSR, which is what we implement.

FedSR learns a probabilistic representation z ~ p(z|x) = N(mu(x), diag sigma^2) and trains,
on each client, (FedSR Section 3; official code atuannguyen/FedSR ``src/methods/FedSR.py``)

    l = CE(classifier(z), y) + alpha_L2R * ||z||_2^2 + alpha_CMI * KL( N(mu(x), sigma^2) || N(r_mu[y], r_sigma[y]^2) )

averaged over the batch, with z drawn by reparameterisation z = mu(x) + sigma * eps,
eps ~ N(0, I) (one sample per input, as the official ``featurize``). The L2R term is the
L2-norm regulariser on the representation (Section 3.2, E||z||_2^2); the CMI term is the
upper bound of the conditional mutual information I(x; z | y) through a learnable
class-conditional reference distribution r(z|y) = N(r_mu[y], diag r_sigma[y]^2)
(Section 3.3), in closed form per dimension

    KL = log(r_sigma / sigma) + (sigma^2 + (mu - r_mu)^2) / (2 r_sigma^2) - 1/2,

summed over the d dimensions. The server aggregates by FedAvg (sample-weighted mean; ``weighting=count``:
unweighted, as the official code).

Scale and reference (``scale``, ``reference``; issue 13: the defaults are the official method):

- ``scale=input`` (default): the noise scale is predicted per input, as in the official code (its
  encoder head outputs 2d values, the second half through softplus is sigma(x)). Our encoder ->
  classifier parameter layout is fixed (``fedsap_ray.models``), so mu(x) = ``model.forward_features(x)``
  (the encoder output) and sigma(x) = softplus(W_s mu(x) + b_s) comes from an extra linear scale head
  (W_s [d, d], b_s [d], ``scale_w``/``scale_b``), trained with the model and averaged with sample
  weights like the model's encoder (the official code's head is part of the averaged network).
  ``scale=shared`` (our earlier reading): sigma = softplus(rho), one learnable vector rho [d] shared
  by every input, averaged across clients.
- ``reference=client`` (default): r_mu [C, d] and r_rho [C, d] (r_sigma = softplus(r_rho), as the
  official code) are each client's own parameters, never averaged: the official code keeps them
  outside the averaged network. Clients are stateless here, so the server holds them
  (``ServerState.strategy_state["r_mu"]``/``["r_rho"]``: client id -> array, initial values until a client first
  trains) and sends them in the hook's payload; a real client keeps them on the device, so they are not
  counted in ``side_bytes_down``, while returning them in ``ClientResult.stats`` shows in ``bytes_up``
  (2 C d floats, a simulation artefact). ``reference=averaged`` (our earlier reading): one reference
  shared by every client, averaged with sample weights like the model and counted both ways.
- The shared arrays (scale head or rho, and the averaged reference) live in ``ServerState.strategy_state``,
  travel in the hook's payload (counted in ``side_bytes_down``) and come back trained in
  ``ClientResult.stats`` (counted in bytes_up). The official code's extra learnable scale C on
  (mu, sigma) inside the KL is left out (not in the paper).
Other readings, to fit our fixed model layout:

- L2R (``l2r_form``): ``squared`` (default) is the paper's E||z||_2^2 (Section 3.2). The official code
  (atuannguyen/FedSR ``src/methods/FedSR.py``, ``Model.train_client``) computes ``z.norm(dim=1).mean()``, the
  batch mean of the unsquared norm: ``l2r_form=norm``. At the same alpha_L2R the two pull differently (the
  squared form's gradient is 2z, the norm's z/||z||, a unit vector), so on 512-d features the squared form is
  the much stronger one.
- Server weights (``weighting``): ``samples`` (default) is FedAvg's sample-weighted mean, as every full-model
  baseline of papers/000's Table 1. The official code averages the clients' networks unweighted
  (``src/methods/base.py`` ``Base.communicate``: sum over the clients / their number; each client there is a
  domain): ``weighting=count``, which applies to the model and to the averaged arrays (the scale head or rho,
  and the reference with ``reference=averaged``). With equal client sizes the two are the same.
- Also in the official code and not modelled: each local step draws one fresh random batch
  (``next(iter(loader))``, E steps a round) where our clients run epochs over a permutation; the optimiser is
  its own SGD with momentum 0.9 for r_mu, r_sigma and C.
- Evaluation uses the mean representation, i.e. the ordinary ``model(x)`` (the official code
  averages the softmax over 20 samples of z), so the default ``eval_sets`` applies.

Initial values: W_s = 0, b_s = 0 (or rho = 0): sigma = log 2 ~ 0.69 for every input at the start,
where the official code's softplus head starts for near-zero pre-activations; r_mu = 0 and r_rho = 1
(the official ``r_mu = zeros``, ``r_sigma = ones`` before softplus).

Compute: evaluation (and ``macs_per_sample``) runs the mean representation through the model; training
with ``scale=input`` also runs the scale head, d^2 more MACs per sample in ``train_macs``.

Client-side optimisation of the scale head (or rho), r_mu, r_rho: SGD with the plan's learning rate, momentum and
weight decay (the official code adds them as one more parameter group of the model's SGD),
one step after every model step; ``grad_clip`` clips the model's gradient only.

Defaults (``--set algorithm.<name>=``): ``alpha_l2r = 0.01`` and ``alpha_cmi = 0.001``, the
values the official README's PACS command uses (``--L2R_coeff 0.01 --CMI_coeff 0.001``; its
argparse defaults are 1e-2 and 5e-4). Neither papers/000 nor the DapperFL code the FedSAP
paper follows (jyzgh/DapperFL ``fedml_api/standalone/domain_generalization/utils/best_args.py``
lists only lr 0.01 and batch 64 for FedSR) gives other values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.algorithms.fedavg import WEIGHTINGS, FedAvg
from fedsap_ray.algorithms.hooks import ClientHook, call, register_hook
from fedsap_ray.algorithms.registry import register
from fedsap_ray.config.checks import check_choice, check_number
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState
from fedsap_ray.common.seeding import seed_for

RHO_INIT = 0.0  # sigma = softplus(0) = log 2 (module docstring)
R_MU_INIT = 0.0  # official code: r_mu = zeros
R_RHO_INIT = 1.0  # official code: r_sigma = ones, used through softplus
EXTRA_KEYS = ("rho", "r_mu", "r_rho")  # the extra learnable arrays of scale=shared, reference=averaged
SCALES = ("input", "shared")
REFERENCES = ("client", "averaged")
SCALE_KEYS = {"input": ("scale_w", "scale_b"), "shared": ("rho",)}  # the scale's arrays per option
REF_KEYS = ("r_mu", "r_rho")
HOOK = "fedsr"  # the client hook (plan.hooks)


L2R_FORMS = ("squared", "norm")  # squared: the paper's E||z||^2; norm: the official code's E||z||


def l2r_term(z: torch.Tensor, form: str = "squared") -> torch.Tensor:
    """FedSR Section 3.2: the batch mean of ||z||_2^2; ``form="norm"``: of ||z||_2, as the official code computes it."""
    if form == "norm":
        return z.norm(dim=1).mean()
    return z.pow(2).sum(dim=1).mean()


def gaussian_kl(mu: torch.Tensor, sigma: torch.Tensor, r_mu: torch.Tensor, r_sigma: torch.Tensor) -> torch.Tensor:
    """FedSR Section 3.3: batch mean of KL(N(mu, sigma^2) || N(r_mu, r_sigma^2)), summed over dimensions.

    ``mu``, ``r_mu``, ``r_sigma``: [B, d]; ``sigma``: [d] or [B, d] (broadcast).
    """
    kl = torch.log(r_sigma) - torch.log(sigma) + (sigma.pow(2) + (mu - r_mu).pow(2)) / (2 * r_sigma.pow(2)) - 0.5
    return kl.sum(dim=1).mean()


@dataclass(frozen=True)
class FedSRPayload:
    alpha_l2r: float  # algorithm.alpha_l2r
    alpha_cmi: float  # algorithm.alpha_cmi
    noise_seed: int  # seeds the reparameterisation noise (run seed, round, client)
    r_mu: np.ndarray  # the reference r(z|y): means [C, d] and
    r_rho: np.ndarray  # pre-softplus scales [C, d], float32
    scale_w: np.ndarray | None = None  # scale=input: the scale head's weight [d, d] and
    scale_b: np.ndarray | None = None  # bias [d]
    rho: np.ndarray | None = None  # scale=shared: the shared pre-softplus scale [d]
    l2r_form: str = "squared"  # algorithm.l2r_form


@register_hook(HOOK)
class FedSRObjective(ClientHook):
    """CE on a sampled z + alpha_L2R ||z||^2 + alpha_CMI KL(p(z|x) || r(z|y)); the scale (head or rho), r_mu and
    r_rho trained alongside. The scale is per input when the payload holds ``scale_w``/``scale_b``, else rho."""

    Payload: ClassVar[type] = FedSRPayload
    payload: FedSRPayload

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device) -> None:
        super().__init__(plan, model, layout, device)
        d = int(model.feature_dim)
        c = int(getattr(model, model.classifier).out_features)
        shapes = {"rho": (d,), "scale_w": (d, d), "scale_b": (d,), "r_mu": (c, d), "r_rho": (c, d)}
        self.scale = "input" if self.payload.scale_w is not None else "shared"
        self.extra_params: dict[str, nn.Parameter] = {}
        for key in (*SCALE_KEYS[self.scale], *REF_KEYS):
            arr = np.asarray(getattr(self.payload, key))
            if arr.dtype != np.float32 or arr.shape != shapes[key]:  # wire check: arrays that arrived
                raise ValueError(f"the fedsr payload's {key} must be float32 of shape {shapes[key]}, "
                                 f"got {arr.dtype} {arr.shape}")
            self.extra_params[key] = nn.Parameter(torch.from_numpy(arr.copy()).to(device))
        self.alpha_l2r, self.alpha_cmi = self.payload.alpha_l2r, self.payload.alpha_cmi
        self.gen = torch.Generator().manual_seed(int(self.payload.noise_seed))  # CPU draws: same on any device
        self.opt = torch.optim.SGD(list(self.extra_params.values()), lr=plan.lr, momentum=plan.momentum,
                                   weight_decay=plan.weight_decay)

    def sigma(self, mu: torch.Tensor) -> torch.Tensor:
        """sigma(x) = softplus(W_s mu(x) + b_s) [B, d] (scale=input), or softplus(rho) [d] (scale=shared)."""
        if self.scale == "shared":
            return F.softplus(self.extra_params["rho"])
        return F.softplus(F.linear(mu, self.extra_params["scale_w"], self.extra_params["scale_b"]))

    def terms(self, model: MaskableModel, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """The three loss terms of one batch (unweighted): ce, l2r, cmi (the last two only where weighted > 0)."""
        mu = model.forward_features(x)
        sigma = self.sigma(mu)
        eps = torch.randn(mu.shape, generator=self.gen).to(device=mu.device, dtype=mu.dtype)
        z = mu + sigma * eps  # reparameterised sample of N(mu(x), sigma^2)
        out = {"ce": F.cross_entropy(getattr(model, model.classifier)(z), y)}
        if self.alpha_l2r != 0.0:
            out["l2r"] = l2r_term(z, self.payload.l2r_form)
        if self.alpha_cmi != 0.0:
            r_mu = self.extra_params["r_mu"][y]
            r_sigma = F.softplus(self.extra_params["r_rho"])[y]
            out["cmi"] = gaussian_kl(mu, sigma, r_mu, r_sigma)
        return out

    def loss(self, model: MaskableModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=False)
        t = self.terms(model, x, y)
        loss = t["ce"]
        if "l2r" in t:
            loss = loss + self.alpha_l2r * t["l2r"]
        if "cmi" in t:
            loss = loss + self.alpha_cmi * t["cmi"]
        return loss

    def after_step(self, model: MaskableModel) -> None:
        self.opt.step()

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        return {k: p.detach().to("cpu", torch.float32).numpy().copy() for k, p in self.extra_params.items()}


@register("fedsr")
class FedSR(FedAvg):
    summary = "full model, probabilistic representation with L2R and CMI regularisers (Nguyen et al. 2022)"

    @dataclass(frozen=True)
    class Options:
        alpha_l2r: float = 0.01  # FedSR README (PACS): --L2R_coeff 0.01
        alpha_cmi: float = 0.001  # FedSR README (PACS): --CMI_coeff 0.001
        scale: str = "input"  # input: sigma(x) per input (official code); shared: one learned vector
        reference: str = "client"  # client: r(z|y) per client (official code); averaged: shared, FedAvg'd
        l2r_form: str = "squared"  # squared: the paper's E||z||^2; norm: the official code's E||z||
        weighting: str = "samples"  # samples: FedAvg's n_i weights; count: unweighted (the official code)

        def __post_init__(self) -> None:
            check_choice("algorithm.scale", self.scale, SCALES)
            check_choice("algorithm.reference", self.reference, REFERENCES)
            check_choice("algorithm.l2r_form", self.l2r_form, L2R_FORMS)
            check_choice("algorithm.weighting", self.weighting, WEIGHTINGS)
            for name in ("alpha_l2r", "alpha_cmi"):
                check_number(f"algorithm.{name}", getattr(self, name), 0)

    def __init__(self, ctx: RunContext, options: Any) -> None:
        super().__init__(ctx, options)
        self.feature_dim = int(ctx.model.feature_dim)
        self.num_classes = int(getattr(ctx.model, ctx.model.classifier).out_features)

    @property
    def shared_keys(self) -> tuple[str, ...]:
        """The arrays every client receives and the server averages (the scale; the reference if averaged)."""
        return SCALE_KEYS[self.opts.scale] + (REF_KEYS if self.opts.reference == "averaged" else ())

    def initial_reference(self) -> dict[str, np.ndarray]:
        d, c = self.feature_dim, self.num_classes
        return {"r_mu": np.full((c, d), R_MU_INIT, dtype=np.float32),
                "r_rho": np.full((c, d), R_RHO_INIT, dtype=np.float32)}

    def init_state(self) -> ServerState:
        """The seeded template, the scale (W_s = 0, b_s = 0 or rho = 0) and r_mu = 0, r_rho = 1 (module docstring);
        with reference=client no client has its own reference yet."""
        state = super().init_state()
        d = self.feature_dim
        extra: dict[str, Any] = ({"scale_w": np.zeros((d, d), dtype=np.float32), "scale_b": np.zeros(d, dtype=np.float32)}
                                 if self.opts.scale == "input" else {"rho": np.full(d, RHO_INIT, dtype=np.float32)})
        if self.opts.reference == "averaged":
            extra.update(self.initial_reference())
        else:
            extra.update(r_mu={}, r_rho={})  # client id -> its own reference (ServerState.strategy_state: numpy arrays)
        state.strategy_state = extra
        return state

    def client_reference(self, state: ServerState, client_id: int) -> dict[str, np.ndarray]:
        """The client's own r_mu, r_rho (reference=client): its last trained ones, the initial ones before."""
        if client_id in state.strategy_state["r_mu"]:
            return {k: state.strategy_state[k][client_id] for k in REF_KEYS}
        return self.initial_reference()

    def train_macs(self, plan: ClientPlan, result: ClientResult) -> int:
        """One forward pass of the model per sample, plus the d x d scale head with scale=input (module docstring)."""
        head = self.feature_dim ** 2 if self.opts.scale == "input" else 0
        return int(result.samples_seen) * (self.compute.mask_macs(None) + head)

    def extra_plan_fields(self, state: ServerState, client_id: int, t: int) -> dict[str, Any]:
        keys = self.shared_keys
        arrays: dict[str, Any] = {k: state.strategy_state[k] for k in keys}  # shared with the state, never mutated
        if self.opts.reference == "client":  # the client's own: kept on the device, not counted in bytes_down
            arrays.update(self.client_reference(state, client_id))
        hook = call(FedSRObjective, **arrays, alpha_l2r=float(self.opts.alpha_l2r),
                    alpha_cmi=float(self.opts.alpha_cmi), noise_seed=seed_for(self.cfg.seed, t, client_id, "fedsr-noise"),
                    l2r_form=self.opts.l2r_form)
        return {"hooks": (hook,), "side_bytes_down": int(sum(state.strategy_state[k].nbytes for k in keys))}

    def after_aggregate(self, state: ServerState, params: np.ndarray, results: list[ClientResult],
                        masks: dict[int, np.ndarray | None], t: int) -> dict[str, Any]:
        """The shared arrays: means of the clients' trained values weighted as the model (:meth:`client_weight`),
        in float64; with reference=client each participant's trained r_mu, r_rho are stored as its own."""
        total = float(sum(self.client_weight(r) for r in results))
        if total <= 0:
            return state.strategy_state
        extra = dict(state.strategy_state)
        if self.opts.reference == "client":
            init = self.initial_reference()
            for key in REF_KEYS:
                own = dict(state.strategy_state[key])
                for r in results:
                    v = r.stats.get(key)
                    if v is None or np.shape(v) != init[key].shape:
                        raise ValueError(f"client {r.client_id} in round {t}: stats[{key!r}] missing or of shape "
                                         f"{None if v is None else np.shape(v)}, expected {init[key].shape}")
                    own[r.client_id] = np.array(v, dtype=np.float32, copy=True)
                extra[key] = own
        for key in self.shared_keys:
            acc = np.zeros(state.strategy_state[key].shape, dtype=np.float64)
            for r in results:  # client-id order (FedAvg.aggregate sorts them)
                v = r.stats.get(key)
                if v is None or np.shape(v) != state.strategy_state[key].shape:
                    raise ValueError(f"client {r.client_id} in round {t}: stats[{key!r}] missing or of shape "
                                     f"{None if v is None else np.shape(v)}, expected {state.strategy_state[key].shape}")
                acc += self.client_weight(r) * np.asarray(v, dtype=np.float64)
            extra[key] = (acc / total).astype(np.float32)
        return extra
