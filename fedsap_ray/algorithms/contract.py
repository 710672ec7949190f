"""The strategy contract (docs/architecture.md#strategies): what the round engine asks of a federated method.

:class:`Strategy` reads in one screen: what a method declares (class attributes), the two methods it must write
(:meth:`~Strategy.configure_round`, :meth:`~Strategy.aggregate`) and the defaults it may override. Everything else a
method uses is a named helper it holds (``self.memo``: :class:`~fedsap_ray.algorithms.memo.Memo`, ``self.compute``:
:class:`~fedsap_ray.algorithms.compute.Compute`, ``self.sampler``: :class:`~fedsap_ray.algorithms.sampling.Sampler`)
or calls (:mod:`fedsap_ray.algorithms.schedule`: the plan's optimiser settings; :mod:`fedsap_ray.algorithms.records`:
the clients' rows; :mod:`fedsap_ray.algorithms.declarations`: its columns across its bases;
:mod:`fedsap_ray.algorithms.statetree`: its state in a checkpoint).

A strategy is built with a :class:`RunContext` (config, federation, model template,
parameter layout) and then only sees explicit :class:`ServerState` objects, so state
can be checkpointed and a restarted actor cannot change a number.

What a strategy may know is what a real server could know: it keeps a :class:`StrategyContext`
whose federation is a :class:`~fedsap_ray.data.base.FederationView` (client ids, sample counts,
capacities; no true domain, no label distribution). Ground truth reaches only evaluation (the
:class:`~fedsap_ray.data.base.EvalDomains` argument of :meth:`Strategy.eval_models`, used to pick each domain's
model, never to train), the recording side (:class:`fedsap_ray.results.recorder.Recorder`: ``true_domain``,
``tv_distance``, ``ari_domain``), and a control that declares it needs it (:meth:`Strategy.needs_oracle`: FedSAP's
``dga=oracle``, which then gets ``ctx.oracle``, :class:`~fedsap_ray.algorithms.context.OracleInputs`).

A strategy's own metrics are declared, not hard-coded in the core: :attr:`Strategy.columns` lists
the extra columns (name, Arrow type, one-line doc) it writes to each per-round table, and
:mod:`fedsap_ray.results.schema` builds every table's schema from the core columns plus the
union of the registered strategies' declarations. :meth:`Strategy.writes` says whether a run with given options
fills them: what docs/reference/results.md lists a method under, so a method that declares columns it never fills
(inherited ones) overrides it from what decides the writing (FedAvg's allocations).

A round's data flows one way: :meth:`Strategy.aggregate` returns a
:class:`~fedsap_ray.common.messages.RoundOutput` (the new state and every row the strategy computed), and
after it the server asks only for the models to evaluate (:meth:`Strategy.eval_sets`,
:meth:`Strategy.deployed_model`). The deployed model is the one the client would run on its device once the round
is over (the ``deployed`` eval mode, :mod:`fedsap_ray.engine.evaluate`): the global model by default; sub-model methods
return the model and mask the client would receive next
(:class:`~fedsap_ray.algorithms.channel_subsets.ChannelSubsetStrategy`), FedSAP its Eq. 9 model at its active
channels, FedSPU its personal model, DapperFL its pruned model. It must not change ``state``.

Honest compute (issue 13), the defaults of the per-client columns: ``params_trained`` counts the trainable
parameters (BN running statistics not counted) the plan covers, all of them when ``plan.mask`` is None (DapperFL's
full-model first epoch overrides it); ``train_macs`` is the forward multiply-accumulates executed in local training,
sum over steps of (samples in the step's batch) x (per-sample forward MACs of the network run in that step) x
(forward passes per step), backward passes not counted (about 2x the forward on the trained part): by default one
forward pass of the sub-model the plan covers per sample (:meth:`~fedsap_ray.algorithms.compute.Compute.mask_macs`),
overridden by strategies whose clients run more (MOON's frozen models, DapperFL's full-model epoch, FedSPU's frozen
neurons). ``assigned_width`` is the width the strategy assigned the plan's client for its round, as planned, beside
``capacity_used`` (what the sub-model it trained realised: a channel count's rounding, FedSAP's per-layer budget);
sub-model methods override its default 1.0 with their p_i or kappa_i.

:attr:`Strategy.supports_async` (an asynchronous reading, ``devices.mode=async``: :mod:`fedsap_ray.engine.asyncmode`,
docs/readings.md), :attr:`Strategy.supports_privacy` (``privacy.*``: it uploads only its update, its masks depend on
no client's data; docs/readings.md#privacy) and :attr:`Strategy.confound_variants` (the rows of sweeps/capacity_confound.py ``--variants``:
variant name -> the overrides besides ``algorithm.name``) are read from the class's own body only, never inherited:
a subclass with round-synchronous state (MOON's previous models, HAS-FL's adaptation steps) is refused until it
declares a reading of its own, and a sub-model method joins the study by declaring its row, without editing the sweep.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedsap_ray.algorithms.compute import Compute
from fedsap_ray.algorithms.declarations import declared_columns
from fedsap_ray.algorithms.memo import Memo
from fedsap_ray.algorithms.sampling import Sampler
from fedsap_ray.common.columns import Column
from fedsap_ray.algorithms.context import RunContext, StrategyContext
from fedsap_ray.data.base import EvalDomains
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundOutput, ServerState


class Strategy(ABC):
    """A federated method as the round engine sees it: what it declares, the two methods it must write and the
    defaults it may override (the module docstring says each default in full)."""

    # --- declared (class attributes) ---------------------------------------------------------------------
    name: ClassVar[str]  # its registry name (set by @register)
    summary: ClassVar[str] = ""  # one line for ``fedsap-ray algorithms``
    # the extra columns it writes, by table ("rounds", "clients", "layers", "allocations"); a subclass declares only
    # its own (declarations.declared_columns adds its bases'); its RoundRecords hold only core and declared columns
    columns: ClassVar[Mapping[str, tuple[Column, ...]]] = {}
    # per table whose declared columns it writes only under some options, one setting under which it does (FedAvg:
    # allocations at width=capacity): the results reference names it, tests/docs/test_results_writers.py runs it
    writes_with: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    @dataclass(frozen=True)
    class Options:  # its fields are the ``--set algorithm.<field>=`` options, checked in __post_init__
        pass

    State: ClassVar[type | None] = None  # the dataclass of ``ServerState.strategy_state`` (None: a dict)
    # fields a dict state gains after round 1: a resume accepts them, and refuses any other field the initial state
    # lacks (fedsap_ray.persist.statecheck)
    state_keys: ClassVar[tuple[str, ...]] = ()
    # state fields holding model-sized vectors, directly or one per client or group id: a resume refuses a
    # checkpoint where one has another length (fedsap_ray.persist.statecheck)
    state_vectors: ClassVar[tuple[str, ...]] = ()
    # option defaults per config preset, beneath the user's: a method scales its own schedules to a preset's round
    # budget (fedsap_ray.config.apply_algorithm_defaults)
    preset_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    supports_async: ClassVar[bool] = False  # it has an asynchronous reading (own body only: module docstring)
    # its clients upload only their update and its masks depend on no client's data: the privacy section applies
    # (own body only, as supports_async; docs/readings.md#privacy)
    supports_privacy: ClassVar[bool] = False
    confound_variants: ClassVar[Mapping[str, tuple[str, ...]]] = {}  # its capacity-confound rows (own body only)

    def __init__(self, ctx: RunContext, options: Any) -> None:
        """Keeps the run as a strategy may see it, the config, the options and the helpers it holds."""
        self.ctx: StrategyContext = ctx.strategy_context(oracle=self.needs_oracle(options))
        self.cfg = ctx.cfg
        self.opts = options
        self.memo = Memo()  # values pure in the run's model and federation
        self.compute = Compute(self.ctx, self.memo)  # MAC counts of sub-models
        self.sampler = Sampler(self.cfg, self.ctx, self.memo)  # a round's clients, the run's devices

    # --- must ----------------------------------------------------------------------------------------------
    @abstractmethod
    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        """The plans of round t (docs/architecture.md#one-round), keyed by client id."""

    @abstractmethod
    def aggregate(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                  t: int) -> RoundOutput:
        """The state after round t and every row the strategy computed (:class:`~fedsap_ray.common.messages.RoundRecords`),
        from the clients' results; ``plans`` are the round's, as :meth:`configure_round` returned them for ``state``."""

    # --- may (the defaults) ----------------------------------------------------------------------------------
    def init_state(self) -> ServerState:
        """The state before round 1: the template's weights (seeded when the model was built), no strategy state."""
        return ServerState(round=0, params=self.ctx.layout.flatten(self.ctx.model))

    def eval_models(self, state: ServerState, domains: EvalDomains) -> dict[str, np.ndarray]:
        """Parameters to evaluate on each test domain (one shared global model)."""
        return {d: state.params for d in domains.names}

    def eval_sets(self, state: ServerState, domains: EvalDomains) -> dict[str, dict[str, np.ndarray]]:
        """Models to evaluate, by ``eval_mode``; the first mode drives global/best accuracy."""
        return {"global": self.eval_models(state, domains)}

    def deployed_model(self, state: ServerState, client_id: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(full-size parameters, parameter mask or None) client ``client_id`` runs after the round (the global model)."""
        return state.params, None

    def assigned_width(self, plan: ClientPlan) -> float:
        """The ``assigned_width`` column: the width assigned the plan's client for its round (1.0: the full model)."""
        return 1.0

    def params_trained(self, plan: ClientPlan, result: ClientResult) -> int:
        """The ``params_trained`` column: trainable parameters the client updated (every one the plan covers)."""
        trainable = self.ctx.trainable
        return int((trainable if plan.mask is None else plan.mask & trainable).sum())

    def train_macs(self, plan: ClientPlan, result: ClientResult) -> int:
        """The ``train_macs`` column: forward MACs of local training (samples seen x the covered sub-model's)."""
        return int(result.samples_seen) * self.compute.mask_macs(plan.mask)

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """Its declared per-client columns and refinements of core ones (``macs_per_sample``); ``state``: after."""
        return {}

    @classmethod
    def needs_oracle(cls, options: Any) -> bool:
        """Whether a run with ``options`` is a control that uses ground truth (False for every method)."""
        return False

    @classmethod
    def async_support(cls, options: Any) -> str | None:
        """None when a run with ``options`` can train asynchronously, else why not (default: :attr:`supports_async`)."""
        if vars(cls).get("supports_async", False):
            return None
        return ("its server state is round-synchronous or its asynchronous reading is not written "
                "(docs/readings.md#asynchronous-training)")

    @classmethod
    def privacy_support(cls, options: Any) -> str | None:
        """None when a run with ``options`` can train under ``privacy`` (its clients upload their update and
        nothing else, and its masks depend on no client's data), else why not (default: :attr:`supports_privacy`)."""
        if vars(cls).get("supports_privacy", False):
            return None
        return ("its clients upload more than their update, or its masks are chosen from what they upload, and no "
                "mechanism covers that (docs/readings.md#privacy)")

    @classmethod
    def writes(cls, table: str, options: Any) -> bool:
        """Whether a run with ``options`` writes its declared ``table`` columns (default: it declares some)."""
        return bool(declared_columns(cls, table))
