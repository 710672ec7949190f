"""The Strategy contract (docs/architecture.md#strategies) and the pieces every strategy shares.

A strategy is built with a :class:`RunContext` (config, federation, model template,
parameter layout) and then only sees explicit :class:`ServerState` objects, so state
can be checkpointed and a restarted actor cannot change a number.

What a strategy may know is what a real server could know: it keeps a :class:`StrategyContext`
whose federation is a :class:`~fedsap_ray.data.base.FederationView` (client ids, sample counts,
capacities; no true domain, no label distribution). Ground truth reaches only evaluation (the
:class:`~fedsap_ray.data.base.EvalDomains` argument of :meth:`Strategy.eval_models`), the recording
side (:class:`fedsap_ray.results.recorder.Recorder`: ``true_domain``, ``tv_distance``, ``ari_domain``), and a
control that declares it needs it (:meth:`Strategy.needs_oracle`: FedSAP's ``dga=oracle``).

A strategy's own metrics are declared, not hard-coded in the core: :attr:`Strategy.columns` lists
the extra columns (name, Arrow type, one-line doc) it writes to each per-round table, and
:mod:`fedsap_ray.results.schema` builds every table's schema from the core columns plus the
union of the registered strategies' declarations.

A round's data flows one way: :meth:`Strategy.aggregate` returns a
:class:`~fedsap_ray.messages.RoundOutput` (the new state and every row the strategy computed), and
after it the server asks only for the models to evaluate (:meth:`Strategy.eval_sets`,
:meth:`Strategy.deployed_model`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import pyarrow as pa

from fedsap_ray import devices
from fedsap_ray.columns import Column
from fedsap_ray.context import RunContext, StrategyContext
from fedsap_ray.data.base import EvalDomains
from fedsap_ray.messages import ClientPlan, ClientResult, RoundOutput, RoundRecords, ServerState
from fedsap_ray.models import model_macs, weight_uses
from fedsap_ray.seeding import rng_for, seed_for

T = TypeVar("T")


# clients-table columns of the strategies that report where a client's channels went (declared, shared)
CHANNEL_COUNT_COLUMNS: tuple[Column, ...] = (
    Column("n_global", pa.int64(), "channels trained on the Global (shared, aggregated) path"),
    Column("n_private", pa.int64(), "channels trained on a Private path (kept by a group or the client)"),
    Column("n_dropped", pa.int64(), "channels not trained"),
)


class Strategy(ABC):
    """Base class: client sampling, learning-rate schedule and plan defaults."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""  # one line for ``fedsap-ray algorithms``
    # The extra columns this class writes, by table ("rounds", "clients", "layers", "allocations"); a
    # subclass declares only its own (declared_columns adds its bases'). The RoundRecords it returns from
    # aggregate may hold only core and declared columns.
    columns: ClassVar[Mapping[str, tuple[Column, ...]]] = {}
    # Per table whose declared columns this class writes only under some options, one option setting under which
    # it writes them (FedAvg: allocations at width=capacity): the results reference names it, and
    # tests/docs/test_results_writers.py runs it. A subclass whose Options lack those fields inherits nothing of it.
    writes_with: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    @dataclass(frozen=True)
    class Options:
        pass

    # the dataclass of ``ServerState.strategy_state`` (None: a dict); checkpoints store its fields (state_tree)
    State: ClassVar[type | None] = None
    # fields a dict state gains after its first round (absent from init_state): a resume accepts them in a
    # checkpoint, and refuses any other field the initial state lacks (fedsap_ray.statecheck)
    state_keys: ClassVar[tuple[str, ...]] = ()
    # fields of the state that hold model-sized vectors (as long as the parameter vector), directly or one per
    # client or group id: a resume refuses a checkpoint where one has another length (fedsap_ray.statecheck)
    state_vectors: ClassVar[tuple[str, ...]] = ()
    # option defaults per config preset, beneath the user's options: a method scales its own schedules (a
    # warm-up, an adaptation interval) to a preset's round budget (fedsap_ray.config.apply_algorithm_defaults)
    preset_options: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    def __init__(self, ctx: RunContext, options: Any) -> None:
        self.ctx: StrategyContext = ctx.strategy_context(oracle=self.needs_oracle(options))
        self.cfg = ctx.cfg
        self.opts = options
        self._memo: dict[str, OrderedDict[Hashable, Any]] = {}  # see memo()

    # --- contract ---------------------------------------------------------------
    def init_state(self) -> ServerState:
        """Initial global model: the template's weights (seeded when the model was built)."""
        return ServerState(round=0, params=self.ctx.layout.flatten(self.ctx.model))

    @abstractmethod
    def configure_round(self, state: ServerState, t: int) -> dict[int, ClientPlan]:
        """The plans of round t (docs/architecture.md#one-round), keyed by client id."""

    @abstractmethod
    def aggregate(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult],
                  t: int) -> RoundOutput:
        """The server state after round t, from the clients' results, and the round's records
        (:class:`~fedsap_ray.messages.RoundRecords`: every table's rows the strategy computed, the client groups
        it formed, its part of the progress line). ``plans`` are the round's plans, as
        :meth:`configure_round` returned them for ``state``."""

    # Whether this class has an asynchronous reading (devices.mode=async, fedsap_ray.asyncmode; docs/readings.md):
    # read from the class's own body only, never inherited, so a subclass with round-synchronous state
    # (MOON's previous models, HAS-FL's adaptation steps) is refused until it declares a reading of its own
    supports_async: ClassVar[bool] = False
    # This class's rows of the capacity-confound study (sweeps/capacity_confound.py --variants): variant name ->
    # the overrides besides ``algorithm.name``. Read from the class's own body only (a subclass does not inherit
    # its base's rows), so a sub-model method joins the study by declaring its row, without editing the sweep.
    confound_variants: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    @classmethod
    def async_support(cls, options: Any) -> str | None:
        """None when a run with ``options`` can train asynchronously, else why not (one clause, for the
        refusal that names the method). The default reads :attr:`supports_async` from the class's own body."""
        if vars(cls).get("supports_async", False):
            return None
        return ("its server state is round-synchronous or its asynchronous reading is not written "
                "(docs/readings.md#asynchronous-training)")

    @classmethod
    def needs_oracle(cls, options: Any) -> bool:
        """Whether a run with ``options`` is a control that uses ground truth (it then gets
        ``ctx.oracle``, :class:`~fedsap_ray.context.OracleInputs`); False for every method."""
        return False

    @classmethod
    def declared_columns(cls, table: str) -> list[Column]:
        """The extra ``table`` columns this strategy writes: its own :attr:`columns` and its bases'."""
        out: dict[str, Column] = {}
        for klass in reversed(cls.__mro__):
            for col in vars(klass).get("columns", {}).get(table, ()):
                if col.name in out and out[col.name].type != col.type:
                    raise ValueError(f"{cls.__name__}: {table}.{col.name} is declared as {out[col.name].type} by a "
                                     f"base class and as {col.type} by {klass.__name__}")
                out[col.name] = col  # a subclass may re-describe a column it inherits, not retype it
        return list(out.values())

    @classmethod
    def writes(cls, table: str, options: Any) -> bool:
        """Whether a run with ``options`` writes this class's declared ``table`` columns (for ``layers`` and
        ``allocations``: writes rows at all). What docs/reference/results.md lists a method under, so a method
        that declares columns it never fills (inherited ones) overrides it from what decides the writing.
        Default: it declares some."""
        return bool(cls.declared_columns(table))

    @classmethod
    def writes_under(cls, table: str) -> dict[str, Any] | None:
        """The options under which a run writes this class's declared ``table`` columns: ``{}`` (its defaults),
        its :attr:`writes_with` setting, or None (never: the results reference does not list it there)."""
        if cls.writes(table, cls.Options()):
            return {}
        setting = dict(cls.writes_with.get(table, {}))
        if not setting:
            return None
        try:
            opts = cls.Options(**setting)
        except TypeError:  # its Options lack those fields (a channel-subset method under FedAvg's setting)
            return None
        return setting if cls.writes(table, opts) else None

    def eval_models(self, state: ServerState, domains: EvalDomains) -> dict[str, np.ndarray]:
        """Parameters to evaluate on each test domain (one shared global model by default).

        ``domains`` is evaluation-only ground truth (the test domains and which clients' data came
        from each): use it to pick each domain's model, never to train."""
        return {d: state.params for d in domains.names}

    def eval_sets(self, state: ServerState, domains: EvalDomains) -> dict[str, dict[str, np.ndarray]]:
        """Models to evaluate, by ``eval_mode``; the first mode drives global/best accuracy (``domains``:
        as in :meth:`eval_models`)."""
        return {"global": self.eval_models(state, domains)}

    def deployed_model(self, state: ServerState, client_id: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(full-size parameters, parameter mask or None) of the model client ``client_id`` would run on its
        device once the round that produced ``state`` is over (the ``deployed`` eval mode,
        :mod:`fedsap_ray.evaluate`).

        Default: the global model, whole (full-model methods). Sub-model methods return the model and
        mask the client would receive next (:class:`~fedsap_ray.algorithms.channel_subsets.SubModelStrategy`),
        FedSAP its Eq. 9 model at its active channels, FedSPU its personal model, DapperFL its pruned
        model. Must not change ``state``.
        """
        return state.params, None

    def client_columns(self, state: ServerState, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """Declared per-client columns (h_hat, channel counts, ...) and refinements of core ones
        (``macs_per_sample``), for :meth:`client_records`; ``state`` is the state after the round."""
        return {}

    def client_records(self, state: ServerState, plans: Mapping[int, ClientPlan],
                       results: list[ClientResult]) -> dict[int, dict[str, Any]]:
        """``RoundRecords.clients``: per client that trained, what it spent (:meth:`params_trained`,
        :meth:`mask_macs` of its plan, :meth:`train_macs`) and :meth:`client_columns` (which may refine
        ``macs_per_sample``); ``state`` is the state after the round."""
        out = {}
        for r in results:
            plan = plans[r.client_id]
            out[r.client_id] = {**self.spent(plan, r), **self.client_columns(state, plan, r)}
        return out

    def spent(self, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
        """What one client-round spent (``params_trained``, ``macs_per_sample``, ``train_macs``) and the width it
        was assigned (``assigned_width``), whether or not it was aggregated (a straggler's compute is counted too:
        fedsap_ray.devices): the columns every client row has, whichever way it was recorded."""
        return {"params_trained": self.params_trained(plan, result), "macs_per_sample": self.mask_macs(plan.mask),
                "train_macs": self.train_macs(plan, result), "assigned_width": self.assigned_width(plan)}

    def assigned_width(self, plan: ClientPlan) -> float:
        """The ``assigned_width`` column: the width the strategy assigned the plan's client for its round, as planned,
        beside ``capacity_used`` (what the sub-model it trained realised: a channel count's rounding, FedSAP's
        per-layer budget). Default 1.0: the full model; sub-model methods override it with their p_i or kappa_i."""
        return 1.0

    def output(self, state: ServerState, plans: Mapping[int, ClientPlan], results: list[ClientResult]) -> RoundOutput:
        """The :class:`RoundOutput` of a round whose only records are its clients' (:meth:`client_records`)."""
        return RoundOutput(state, RoundRecords(clients=self.client_records(state, plans, results)))

    # --- checkpoints: the strategy's own state as a tree the code-free format stores ----------
    def state_tree(self, strategy_state: Any) -> dict[str, Any]:
        """``strategy_state`` as a dict of storable values (:mod:`fedsap_ray.treecodec`): its fields when it
        is the dataclass :attr:`State` declares, else the dict itself."""
        if self.State is not None:
            return {f.name: getattr(strategy_state, f.name) for f in dataclasses.fields(self.State)}
        return strategy_state

    def state_from_tree(self, tree: dict[str, Any]) -> Any:
        """Inverse of :meth:`state_tree` (a checkpoint's strategy state back as :attr:`State`)."""
        return self.State(**tree) if self.State is not None else tree

    # --- honest compute (issue 13): what the client really trained and ran ------------------
    def params_trained(self, plan: ClientPlan, result: ClientResult) -> int:
        """The ``params_trained`` column: trainable parameters (BN running statistics not counted) the client updated.

        Default: every coordinate the plan covers (all of them when ``plan.mask`` is None). A strategy
        whose client updates something else (DapperFL's full-model first epoch) overrides it.
        """
        trainable = self.ctx.trainable
        return int((trainable if plan.mask is None else plan.mask & trainable).sum())

    def train_macs(self, plan: ClientPlan, result: ClientResult) -> int:
        """The ``train_macs`` column: forward multiply-accumulates executed in local training, all epochs.

        sum over steps of (samples in the step's batch) x (per-sample forward MACs of the network run in
        that step) x (forward passes per step); backward passes are not counted (about 2x the forward on
        the trained part). Default: one forward pass of the sub-model the plan covers per sample,
        ``result.samples_seen * mask_macs(plan.mask)``; strategies whose clients run more override it
        (MOON's frozen models, DapperFL's full-model epoch, FedSPU's frozen neurons).
        """
        return int(result.samples_seen) * self.mask_macs(plan.mask)

    def mask_macs(self, mask: np.ndarray | None) -> int:
        """Multiply-accumulates per sample of the sub-model a parameter mask covers (papers/003 Table 1).

        Sum over weight tensors of (covered entries) x (applications per sample): exactly
        :func:`fedsap_ray.models.model_macs` of the channel masks the coverage came from
        (tests/algorithms/test_feddrop.py), and it also counts sub-models a channel mask alone cannot
        describe (NeFL's skipped residual branches). ``None``: the full model (memoised).
        """
        if mask is None:
            return self.memo("full_model_macs", None,
                             lambda: int(model_macs(self.ctx.model, self.ctx.federation.input_shape, None)))
        uses = weight_uses(self.ctx.model, self.ctx.federation.input_shape)
        layout = self.ctx.layout
        return int(sum(int(np.count_nonzero(layout.slice(w, mask))) * n for w, n in uses.items()))

    def encoder_macs(self) -> int:
        """Per-sample MACs of ``model.forward_features`` alone: the full model minus its classifier's weights.

        What a frozen model run for its representation costs (MOON's global and previous models).
        """
        uses = weight_uses(self.ctx.model, self.ctx.federation.input_shape)
        head = self.ctx.model.classifier + "."
        layout = self.ctx.layout
        cls = sum(int(np.prod(layout.shapes[layout.names.index(w)])) * n for w, n in uses.items() if w.startswith(head))
        return self.mask_macs(None) - int(cls)

    # --- shared helpers ---------------------------------------------------------
    def memo(self, table: str, key: Hashable, compute: Callable[[], T], *, maxsize: int | None = None) -> T:
        """``compute()``, computed once per ``(table, key)`` for this strategy and kept: the one cache for
        values that are pure functions of the run's fixed model and federation (MAC counts, sub-model
        masks and geometry), so caching them can never change a number. ``maxsize``: keep at most
        that many entries of ``table`` (large values such as parameter masks), least recently used
        dropped first."""
        entries = self._memo.setdefault(table, OrderedDict())
        if key in entries:
            entries.move_to_end(key)
            return entries[key]
        value = entries[key] = compute()
        if maxsize is not None and len(entries) > maxsize:
            entries.popitem(last=False)
        return value

    def sample_clients(self, t: int) -> list[int]:
        """Seeded uniform sample of ceil-free round(participation * N) clients (at least one).

        Simulated devices (:mod:`fedsap_ray.devices`) change it only when asked: with an availability
        below 1 the sample is drawn from the clients available in round ``t``, and under
        ``devices.policy=over_select`` it holds ``ceil(k * (1 + over_select))`` of them (the server
        aggregates the ``k`` that finish first). Otherwise the draw is exactly the one above."""
        n = len(self.ctx.federation.clients)
        k = devices.round_size(self.cfg, n)
        dev = self.cfg.devices
        if dev.policy != "over_select" and dev.availability >= 1 and dev.trace is None:
            if k >= n:
                return list(range(n))
            rng = rng_for(self.cfg.seed, t, -1, "sample")
            return sorted(int(i) for i in rng.choice(n, size=k, replace=False))
        pool = devices.available(self.cfg, self.devices(), t)
        if not pool:  # refused before round 1 (devices.empty_round); kept for callers that skip the session
            raise devices.no_client_error(self.cfg, t)
        m = min(devices.selection_size(self.cfg, k), len(pool))
        if m >= len(pool):
            return pool
        rng = rng_for(self.cfg.seed, t, -1, "sample")
        return sorted(int(pool[i]) for i in rng.choice(len(pool), size=m, replace=False))

    def devices(self) -> list[devices.Device]:
        """Every client's simulated device (:func:`fedsap_ray.devices.devices_for`), built once per run: the
        sampling here and the server's clock read the same list (a trace is read once)."""
        return self.memo("devices", None, lambda: devices.devices_for(
            self.cfg, [c.capacity for c in self.ctx.federation.clients]))

    def lr_at(self, t: int) -> float:
        """Learning rate of round t (1-based): lr * decay^(t-1) (papers/003 section 4.1)."""
        tr = self.cfg.training
        return tr.lr * tr.lr_decay ** (t - 1)

    def plan_kwargs(self, t: int, client_id: int) -> dict[str, Any]:
        tr = self.cfg.training
        return dict(
            client_id=client_id, round=t, local_epochs=tr.local_epochs, batch_size=tr.batch_size,
            lr=self.lr_at(t), momentum=tr.momentum, weight_decay=tr.weight_decay, grad_clip=tr.grad_clip,
            max_steps_per_epoch=tr.max_steps_per_epoch, seed=seed_for(self.cfg.seed, t, client_id, "train"),
            submodel=tr.submodel,
        )

