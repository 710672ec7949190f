"""Typed messages between server and clients (docs/architecture.md#one-round), checked when built.

Parameters travel as flat float32 numpy buffers laid out by
:class:`fedsap_ray.models.masks.ParamLayout`. A plan *names* the full-size vector its client starts from
(``params``: the server model, or the view of the client's group) and says which coordinates the
client holds (``mask``); the simulated protocol sends only those (``values`` is ``params[mask]``,
``bytes_down`` counts them and the packed mask). Many plans of a round name the same vector, so a
backend moves each distinct vector once per worker and round, with each plan's own part beside it
(:mod:`fedsap_ray.runtime.wire`, issue 42). Where a client's start mixes two shared vectors by a mask of its
own (FedSAP's Eq. 9: W_G, and its group's Private vector where that is fresher), the plan names both and
carries the mask (``overlay``), so neither the mix nor a copy of it travels per client. A result returns
only the coordinates it trained, in the same order, so byte counts are those of the real payload.

What a result holds (issue 43), the one contract every consumer reads: ``ClientResult.values`` are the
trained values at ``ClientResult.mask``'s coordinates, in coordinate order (``mask`` None: every
coordinate). The client sets ``mask`` to the plan's own mask object unless a client hook chose the upload
(DapperFL uploads its pruned model: ``ClientHook.upload_mask``); aggregation, the recorder, metrics,
device time and coverage read a result's coordinates from its ``mask``, never from the plan, and
:func:`check_results` checks the two agree at the boundary (``Server.round``, the backends' tests).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np


@dataclass(frozen=True)
class HookCall:
    """One client hook of a plan: its registered name and its typed payload (an instance of the hook's
    ``Payload`` frozen dataclass). Built by :func:`fedsap_ray.algorithms.hooks.call`."""

    name: str
    payload: Any


@dataclass(frozen=True)
class StartOverlay:
    """Coordinates a plan's start takes from a second shared vector: ``values[j]`` where ``where[j]``, the
    plan's ``params[j]`` elsewhere. Both vectors are shared between plans and never mutated; ``where`` is
    the client's own (it travels packed to bits, 1/32 of a vector). A checkpoint stores it by these fields
    under the plan's ``overlay``, never by its class name (:mod:`fedsap_ray.persist.messagetree`)."""

    values: np.ndarray  # float32 [n_params]
    where: np.ndarray  # bool [n_params]


@dataclass
class ClientPlan:
    client_id: int
    round: int
    # float32 [n_params]: the full-size vector the client starts from at its covered coordinates (the server
    # model, or its group's view); shared between plans and never mutated (a backend may move it once per worker)
    params: np.ndarray
    mask: np.ndarray | None  # bool [n_params]: covered coordinates (None: the full model)
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float | None = None
    max_steps_per_epoch: int | None = None
    seed: int = 0  # seeds batch order etc.: derived from (run seed, round, client, purpose)
    submodel: str = "sliced"  # sliced | masked: how the client trains its sub-model (training.submodel)
    capacity_used: float = 1.0  # the trained width: fraction of channels active (the realised p_i / kappa_i)
    # the client hooks that customise local training, in calling order, each with its typed payload
    # (fedsap_ray.algorithms.hooks); pure data, so any worker can run any client
    hooks: tuple[HookCall, ...] = ()
    # bytes of protocol state the real algorithm would also send each way (e.g. SCAFFOLD's control
    # variates c - c_i down and Delta c_i up), counted in bytes_down / the clients' bytes_up
    side_bytes_down: int = 0
    side_bytes_up: int = 0
    # where the start takes coordinates from a second vector (StartOverlay; None: params alone)
    overlay: StartOverlay | None = None

    def __post_init__(self) -> None:
        if self.params.dtype != np.float32 or self.params.ndim != 1:
            raise TypeError(f"ClientPlan(client {self.client_id}, round {self.round}): params must be a 1-D float32 array")
        if self.mask is not None:
            if self.mask.dtype != np.bool_ or self.mask.ndim != 1:
                raise TypeError(f"ClientPlan(client {self.client_id}, round {self.round}): mask must be a 1-D bool array")
            if self.mask.size != self.params.size:
                raise ValueError(
                    f"ClientPlan(client {self.client_id}, round {self.round}): mask has {self.mask.size} "
                    f"coordinates but params has {self.params.size}")
        if self.overlay is not None:
            o = self.overlay
            if o.values.dtype != np.float32 or o.values.shape != self.params.shape or o.where.dtype != np.bool_ \
                    or o.where.shape != self.params.shape:
                raise TypeError(f"ClientPlan(client {self.client_id}, round {self.round}): overlay needs a float32 "
                                f"vector and a bool mask of {self.params.size} coordinates each")
        if self.submodel not in ("sliced", "masked"):
            raise ValueError(f"ClientPlan(client {self.client_id}, round {self.round}): submodel must be "
                             f"'sliced' or 'masked', got {self.submodel!r}")
        if self.local_epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"ClientPlan(client {self.client_id}, round {self.round}): bad optimiser settings")

    def payload(self, hook: Any) -> Any:
        """The payload of the plan's hook ``hook`` (a registered name, or a hook class); KeyError if absent."""
        name = hook if isinstance(hook, str) else hook.name
        for c in self.hooks:
            if c.name == name:
                return c.payload
        raise KeyError(f"ClientPlan(client {self.client_id}, round {self.round}) has no client hook {name!r}")

    @cached_property
    def covered(self) -> int:
        """How many coordinates the client holds (the size of :attr:`values`)."""
        return self.params.size if self.mask is None else int(np.count_nonzero(self.mask))

    @cached_property
    def source(self) -> np.ndarray:
        """The full-size vector the client starts from: ``params``, with the overlay's coordinates where it
        has one (computed once per plan; ``params`` itself, read only, without one)."""
        o = self.overlay
        return self.params if o is None else np.where(o.where, o.values, self.params)

    @property
    def values(self) -> np.ndarray:
        """The coordinates the simulated server sends, ``source[mask]`` (``params`` itself, not a copy, for the
        full model without overlay). A masked plan's values are a new array on every call: consumers that only
        need the full-size start vector use :meth:`start_vector`."""
        return self.source if self.mask is None else self.source[self.mask]

    def start_vector(self) -> np.ndarray:
        """The full-size vector the client loads: ``source`` at covered coordinates, 0 elsewhere (``params``
        itself for the full model without overlay: read only, never written)."""
        return self.source if self.mask is None else np.where(self.mask, self.source, np.float32(0.0))

    @property
    def bytes_down(self) -> int:
        """Bytes the server sends: the covered values plus the packed coverage mask when there is one."""
        return int(4 * self.covered + (0 if self.mask is None else (self.mask.size + 7) // 8) + self.side_bytes_down)


@dataclass
class ClientResult:
    client_id: int
    round: int
    values: np.ndarray  # float32: trained parameters at the plan's covered coordinates
    n_samples: int
    train_loss: float
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    wall_s: float = 0.0
    worker: str = "local"
    gpu_id: int | None = None
    node: str = "local"  # the Ray node the worker ran on (clients.node)
    steps: int = 0  # optimizer steps taken over all local epochs (SCAFFOLD's K)
    samples_seen: int = 0  # samples in the batches of those steps (train_macs: Strategy.train_macs)
    # the coordinates ``values`` holds, in order (None: every coordinate): the plan's mask object, or the one a
    # client hook chose for the upload (module docstring)
    mask: np.ndarray | None = None
    compile: str = "off"  # what the training forward was (fedsap_ray.engine.compiled.OUTCOMES; clients.compile)

    def __post_init__(self) -> None:
        if self.values.dtype != np.float32 or self.values.ndim != 1:
            raise TypeError(f"ClientResult(client {self.client_id}, round {self.round}): values must be a 1-D float32 array")
        if self.n_samples < 0 or self.samples_seen < 0:
            raise ValueError(f"ClientResult(client {self.client_id}, round {self.round}): n_samples or samples_seen < 0")

    @property
    def bytes_up(self) -> int:
        return int(self.values.nbytes + sum(np.asarray(v).nbytes for v in self.stats.values()))


def check_results(plans: Mapping[int, ClientPlan], results: Sequence[ClientResult], strategy: str) -> None:
    """The boundary check of what a result holds (module docstring): each result answers a plan of the round, its
    ``mask`` (if any) is a bool vector of the plan's model size, and ``values`` has one value per coordinate it
    covers (every coordinate without one). A mismatch names the round, the client, the strategy and the field."""
    for r in results:
        plan = plans.get(r.client_id)
        where = f"round {r.round}, client {r.client_id} ({strategy})"
        if plan is None:
            raise ValueError(f"{where}: a result for a client with no plan this round")
        size = plan.params.size
        if r.mask is None:
            if r.values.size != size:
                raise ValueError(f"{where}: ClientResult.values holds {r.values.size} values but ClientResult.mask is "
                                 f"None (every coordinate: {size})")
            continue
        if r.mask.dtype != np.bool_ or r.mask.shape != (size,):
            raise ValueError(f"{where}: ClientResult.mask must be a bool vector of the model's {size} coordinates, "
                             f"got {r.mask.dtype} {r.mask.shape}")
        covered = plan.covered if r.mask is plan.mask else int(np.count_nonzero(r.mask))
        if r.values.size != covered:
            raise ValueError(f"{where}: ClientResult.values holds {r.values.size} values but ClientResult.mask covers "
                             f"{covered} coordinates")


@dataclass
class ServerState:
    """Explicit, serialisable server state returned by every round (checkpointable)."""

    round: int
    params: np.ndarray  # float32 [n_params], the global model
    # what the strategy keeps between rounds besides the global model: its own state (a dict, or the dataclass its
    # ``Strategy.State`` declares); only the strategy reads it, checkpoints store it (fedsap_ray.persist.treecodec)
    strategy_state: Any = field(default_factory=dict)


@dataclass(frozen=True)
class RoundRecords:
    """What a strategy computed in one round for the results tables, returned by ``aggregate``.

    Only core and declared columns (``Strategy.columns``); the recorder
    (:mod:`fedsap_ray.results.recorder`) adds the round, the ground truth and the evaluation.
    """

    rounds: Mapping[str, Any] = field(default_factory=dict)  # this round's declared ``rounds`` columns
    # per client that trained: its compute (params_trained, macs_per_sample, train_macs) and declared columns
    clients: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    layers: Sequence[Mapping[str, Any]] = ()  # ``layers`` rows (without ``round``)
    allocations: Sequence[Mapping[str, Any]] = ()  # ``allocations`` rows (without ``round`` and ``tv_distance``)
    # the group label of every client when the strategy (re)formed client groups this round (the recorder
    # scores them against the true domains: ``rounds.ari_domain``)
    groups: np.ndarray | None = None
    # the strategy's part of the progress line: a str.format template over the round's columns (its own and
    # the recorder's ``ari_domain``), e.g. "  DGA {n_groups} groups (ARI domains {ari_domain:.2f})"
    progress: str = ""


@dataclass(frozen=True)
class RoundOutput:
    """``Strategy.aggregate``'s value: the new server state and the round's records (nothing else is pulled)."""

    state: ServerState
    records: RoundRecords

    @classmethod
    def unchanged(cls, state: ServerState, t: int) -> RoundOutput:
        """A round that changed no parameter (no client's update reached the model): the state renumbered to
        round ``t``, no records."""
        return cls(dataclasses.replace(state, round=t), RoundRecords())

    def with_client_rows(self, rows: Mapping[int, dict[str, Any]]) -> RoundOutput:
        """The same output with these clients' rows added to its ``clients`` records (a straggler's: what it
        spent, though its update was left out)."""
        return dataclasses.replace(self, records=dataclasses.replace(self.records,
                                                                     clients={**self.records.clients, **rows}))
