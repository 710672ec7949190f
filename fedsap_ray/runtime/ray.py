"""Ray backend (docs/architecture.md#backends): a ServerActor hosting the run, ClientWorker actors on GPU fractions.

- ``ServerActor`` hosts a :class:`~fedsap_ray.run.session.RunSession` (server state,
  strategy ``configure_round``/``aggregate``, evaluation, Parquet writer); it is pinned
  to the driver's node so results land in the driver's ``--out`` folder. The driver
  runs the one loop (:func:`fedsap_ray.run.driver.drive`) through :class:`RemoteSession`, each
  ``start``/``step``/``metrics``/``finish`` a call on the actor, and prints progress.
- ``ClientWorker`` actors are created with ``num_gpus=resources.gpus_per_worker`` and
  ``num_cpus=resources.cpus_per_worker``; each hosts many virtual clients. The training
  pools go into the object store once per run (numpy, zero-copy per node) and workers
  index into them. Plans carry only the covered coordinates as a flat float32 buffer.
  A worker trains on its CUDA device when there is one, else on CPU, always with
  ``resources.torch_threads`` intra-op threads (the numerics are then those of the
  local backend, whichever worker runs which client). A worker prepares each client's data
  once per run (:class:`~fedsap_ray.engine.client.PreparedData`, within its memory budget) and pays
  torch's optimizer start-up when it starts (:func:`~fedsap_ray.engine.client.warm_torch`), not in
  round 1 (issue 27; measured in :mod:`fedsap_ray.engine.client`'s docstring).
- Dispatch and fault tolerance (issue 42): a round's plans are shared among the workers longest
  first by expected work (:func:`~fedsap_ray.runtime.wire.longest_first`) and each worker gets its
  share in up to ``PIECES`` calls (``PIPELINE`` in flight, so results travel while the next piece trains),
  each a :class:`~fedsap_ray.runtime.wire.Batch`: every distinct parameter vector and mask of the
  round goes into the object store once and reaches a worker once, beside the plans' own parts
  (``rounds.backend_bytes_down``/``backend_bytes_up`` record what moved). A worker that dies is
  replaced once and every piece it held re-runs from its plans (plans are pure data, so the numbers
  are those of an uninterrupted run). A client that raises stops the run with a
  :class:`~fedsap_ray.engine.client.ClientError` naming the round and client.
"""
from __future__ import annotations

import math
import os
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.util.scheduling_strategies
import torch

from fedsap_ray.runtime import limits
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.engine import compiled
from fedsap_ray.engine.client import PreparedData, pick_device, to_device, train_client, warm_torch
from fedsap_ray.runtime.allocator import tune_malloc
from fedsap_ray.data.base import DomainData, Federation
from fedsap_ray.common.errors import CheckpointUnreadable, ClientError, ConfigError
from fedsap_ray.common.messages import ClientPlan, ClientResult
from fedsap_ray.models.space import MaskableModel
from fedsap_ray.runtime import reaper, wire
from fedsap_ray.runtime.address import check_reachable, given
from fedsap_ray.config.schema import ExperimentConfig
from fedsap_ray.run.driver import DriverCallback, drive_one
from fedsap_ray.run.session import RunOutcome, RunSession, SessionMetrics, WorkerInfo

_DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
# a worker's share of a round goes in up to PIECES calls, one per PIECE_BYTES of results it will send back, PIPELINE
# in flight: one piece's results travel while the next trains (one call per share sent all its results at once at
# the end); a share with little to send back stays one call, since pieces cost call latency (issue 42; the figures
# are in docs/guides/performance.md)
PIECES = 4
PIECE_BYTES = 32 << 20
PIPELINE = 2
NODE_CHARS = 12  # a node id's first hex digits, as clients.node and the progress line show it
# Plans and results of small models travel inline with the task instead of through the
# object store: the raylet's CPU per round fell to a fraction (benchmarks/round_overhead.py; docs/guides/performance.md).
_INLINE_BYTES = 1 << 20
#: The raylet settings of a Ray this project starts (``connect``, the tests' session Ray, the benchmarks; a
#: cluster's ``ray start`` gets the same through ``RAY_worker_niceness`` in ray_cluster.yaml). Ray starts its
#: worker processes at niceness 15 so that its control plane stays responsive; here the workers *are* the
#: job, and at 15 anything else on the node at the default 0 takes the cores from them: a round beside other
#: work ran far slower (benchmarks/round_overhead.py, issue 42; docs/guides/performance.md has the figures).
#: The raylet and GCS keep their fair share at 0.
SYSTEM_CONFIG = {"max_direct_call_object_size": _INLINE_BYTES, "worker_niceness": 0}
#: the driver's node id and its say in Inductor's cache folder (:func:`fedsap_ray.engine.compiled.cache_env`)
DriverCache = tuple[str, dict[str, str]]


def adopt_driver_cache(driver: DriverCache | None) -> None:
    """In an actor on the driver's node: compile into the driver's Inductor folder (the node's cache, as the
    local backend would), not the one the raylet's environment at ``ray.init`` names. Actors on other nodes
    keep their node's own (``FEDSAP_RAY_CACHE`` in that raylet's environment, docs/guides/cluster.md)."""
    if driver is not None and ray.get_runtime_context().get_node_id() == driver[0]:
        compiled.adopt_cache_env(driver[1])


def connect(address: str | None = None, *, dashboard: bool = False, log_to_driver: bool = True,
            import_paths: Sequence[str] = (), field: str = "resources.address") -> None:
    """Join ``address`` / ``RAY_ADDRESS``, or start a local Ray bound to 127.0.0.1: the one way this
    package and the sweeps reach Ray (a no-op when Ray is already initialised).

    A local Ray gets the dashboard only if ``dashboard``, carries plans and results below
    ``_INLINE_BYTES`` inline, prepends ``import_paths`` to the ``PYTHONPATH`` its workers
    inherit (the sweeps pass their source checkout, so workers import ``sweeps``), and is
    watched by :mod:`fedsap_ray.runtime.reaper` (a kill -9 of this driver must not leave Ray's
    agents behind).

    An address to join is checked first (:func:`fedsap_ray.runtime.address.check_reachable`: a malformed
    one, ``auto`` with no cluster, or one where nothing answers within seconds is a ``ConfigError`` naming
    ``field``, the option that gave it, or ``RAY_ADDRESS``); so is a failure of ``ray.init`` to join it.
    """
    if ray.is_initialized():
        return
    address, field = given(address, field)
    if address and address != "local":
        check_reachable(address, field)
        try:
            ray.init(address=address, log_to_driver=log_to_driver)
        except (ConnectionError, RuntimeError, TimeoutError) as e:
            first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
            raise ConfigError(f"invalid {field}={address!r}: Ray could not join the cluster there ({first}); "
                              "check the address its head node printed") from None
        return
    if import_paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*import_paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(include_dashboard=dashboard, _node_ip_address="127.0.0.1", dashboard_host="127.0.0.1",
             log_to_driver=log_to_driver, _system_config=SYSTEM_CONFIG)
    reaper.start()


@contextmanager
def local_ray(**connect_kwargs: Any) -> Iterator[None]:
    """Ray for the block: :func:`connect` (``connect_kwargs``) when none is running, and a shutdown after the
    block when this started it (a tool running many Ray runs in one process: the golden-number check)."""
    started = not ray.is_initialized()
    connect(**connect_kwargs)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def pool_size(cfg: ExperimentConfig, num_clients: int, cluster: dict[str, float] | None = None) -> int:
    """Workers to start: ``resources.num_workers``, else what the cluster's CPUs/GPUs hold, at most one per client."""
    r = cfg.resources
    if r.num_workers is not None:
        return r.num_workers
    cluster = ray.cluster_resources() if cluster is None else cluster
    fits = [math.floor(cluster.get("CPU", 0.0) / r.cpus_per_worker + 1e-9)]
    if r.gpus_per_worker > 0:
        gpus = cluster.get("GPU", 0.0)
        if gpus <= 0:
            raise ConfigError(f"invalid resources.gpus_per_worker={r.gpus_per_worker}: the Ray cluster has no GPUs; "
                              "use 0 for CPU workers")
        fits.append(math.floor(gpus / r.gpus_per_worker + 1e-9))
    n = min(min(fits), num_clients)
    if n < 1:
        raise ConfigError(f"invalid resources.cpus_per_worker={r.cpus_per_worker}: no worker fits the cluster "
                          f"({cluster.get('CPU', 0)} CPUs)")
    return n


def check_cluster(cfg: ExperimentConfig, num_clients: int, cluster: dict[str, float] | None = None) -> None:
    """On the driver, before any actor starts: the cluster can host the workers, and has a GPU
    when ``resources.device=cuda`` (otherwise the run would fail in round 1, not as bad input)."""
    cluster = ray.cluster_resources() if cluster is None else cluster
    if cfg.resources.device == "cuda" and cluster.get("GPU", 0.0) <= 0:
        raise ConfigError("invalid resources.device='cuda': the Ray cluster has no GPUs; use auto or cpu")
    pool_size(cfg, num_clients, cluster)  # ConfigError naming the resource that does not fit
    limits.check_cluster_resources(cfg, num_clients, cluster)


@ray.remote
class ClientWorker:
    """Hosts many virtual clients; holds no state that could change a number (a replacement is identical)."""

    def __init__(self, name: str, model: MaskableModel, layout, pools: dict[str, tuple[np.ndarray, np.ndarray]],
                 client_index: dict[int, tuple[str, np.ndarray]], device: str, torch_threads: int,
                 compile: str = "off", driver: DriverCache | None = None) -> None:
        if compile in compiled.TRAIN_MODES:
            adopt_driver_cache(driver)
        self.malloc_tuned = tune_malloc() is not None  # allocator.py: a worker spent 24% of its CPU in page faults
        torch.set_num_threads(torch_threads)
        warm_torch()
        self.name, self.compile = name, compile
        self.model, self.layout = model, layout
        self.pools = pools  # zero-copy views into the object store
        self.client_index = client_index
        self.device = pick_device(device)
        to_device(self.model, self.device)
        self._on_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # domain -> its pool on the GPU
        self.data = PreparedData(self._client_data, self.device)  # each client's, built once per run
        gpu_ids = ray.get_gpu_ids()
        self.gpu_id = int(gpu_ids[0]) if gpu_ids else None
        self.node = ray.get_runtime_context().get_node_id()[:NODE_CHARS]

    def info(self) -> WorkerInfo:
        pg = ray.util.get_current_placement_group()
        return WorkerInfo(name=self.name, gpu_id=self.gpu_id, pid=os.getpid(), device=str(self.device),
                          placement_group=pg.id.hex() if pg is not None else None, node=self.node,
                          malloc_tuned=self.malloc_tuned)

    def _client_data(self, client_id: int) -> DomainData:
        domain, idx = self.client_index[client_id]
        x, y = self.pools[domain]
        if self.device.type == "cpu":
            return DomainData(torch.from_numpy(np.ascontiguousarray(x[idx])),
                              torch.from_numpy(np.ascontiguousarray(y[idx])))
        # a domain's pool goes to the device once; each client's rows are gathered there
        if domain not in self._on_device:
            self._on_device[domain] = (torch.from_numpy(np.array(x)).to(self.device),
                                       torch.from_numpy(np.array(y)).to(self.device))
        xd, yd = self._on_device[domain]
        at = torch.as_tensor(idx, dtype=torch.long, device=self.device)
        return DomainData(xd[at], yd[at])

    def train(self, plan: ClientPlan) -> ClientResult:
        result = train_client(plan, self.model, self.layout, self.data.get(plan.client_id), self.device, self.compile)
        result.worker, result.gpu_id, result.node = self.name, self.gpu_id, self.node
        return result

    def train_batch(self, batch: wire.Batch, *arrays: np.ndarray) -> list[ClientResult]:
        """The worker's share of a round, in the batch's order; ``arrays`` are the batch's shared vectors and
        packed masks (object-store references resolved by Ray, zero-copy on this node)."""
        return [wire.strip_result(self.train(plan), plan) for plan in batch.plans(arrays)]


def _loss_line(node: str) -> str:
    """One line for a dead worker, naming its node: ``node X lost`` when the cluster has marked the node dead
    too (removed or crashed), else ``worker on node X lost`` (the worker alone, or a node not yet marked)."""
    alive = {n["NodeID"][:NODE_CHARS] for n in ray.nodes() if n.get("Alive")}
    return f"node {node} lost" if node not in alive else f"worker on node {node} lost"


class RayWorkerPool:
    """The Backend used inside the ServerActor: dynamic dispatch of plans to ClientWorkers."""

    name = "ray"

    def __init__(self, cfg: ExperimentConfig, driver: DriverCache | None = None) -> None:
        self.cfg, self.driver = cfg, driver
        self.workers: list[Any] = []
        self.restarts = 0
        self._spawned = 0
        self.nodes: list[str] = []  # the node of each worker slot, once it has started
        self._losses: list[str] = []  # what was lost since the last take_losses(), one line each
        self.moved = (0, 0)  # bytes the last train() sent to the workers and got back (rounds.backend_bytes_*)
        self._samples: dict[int, int] = {}

    def start(self, ctx: RunContext) -> None:
        fed: Federation = ctx.federation
        pools = {d: (v.x.numpy(), v.y.numpy()) for d, v in fed.train.items()}
        self._init_args = (ray.put(ctx.model), ray.put(ctx.layout), ray.put(pools),
                           ray.put({c.client_id: (c.domain, c.indices) for c in fed.clients}))
        self.run_tag = f"fedsap-{ctx.cfg.config_hash()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"  # unique per pool
        n = pool_size(self.cfg, len(fed.clients))
        self.workers = [self._spawn() for _ in range(n)]
        self.nodes = [i.node for i in ray.get([w.info.remote() for w in self.workers])]  # fail fast if one cannot start
        self._samples = {c.client_id: c.n_samples for c in fed.clients}

    def _spawn(self) -> Any:
        r = self.cfg.resources
        name = f"{self.run_tag}-w{self._spawned}"
        self._spawned += 1
        return ClientWorker.options(name=name, num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_worker).remote(
            name, *self._init_args, r.device, r.torch_threads, r.compile, self.driver)

    def worker_info(self) -> list[WorkerInfo]:
        info = ray.get([w.info.remote() for w in self.workers])
        self.nodes = [i.node for i in info]
        return info

    def take_losses(self) -> list[str]:
        """What died since the last call, one line per node (``node 3c38abb3a1f0 lost``, ``worker on node ...
        lost``): the progress line shows it; the clients a lost worker held re-ran on its replacement."""
        out, self._losses = list(dict.fromkeys(self._losses)), []
        return out

    def train(self, plans: dict[int, ClientPlan]) -> list[ClientResult]:
        """Each worker's share of the round (longest first) in up to ``PIECES`` calls, ``PIPELINE`` in flight, so
        one piece's results travel back while the next trains; each distinct shared array is put in the object
        store once and counted once per worker. A dead worker is replaced once and its pieces re-run on the
        replacement. ``moved`` holds the round's bytes each way."""
        ordered = [plans[cid] for cid in sorted(plans)]
        shares = wire.longest_first(ordered, [self._work(p) for p in ordered], len(self.workers))
        shared = wire.RoundArrays()
        todo: dict[int, deque[wire.Batch]] = {}
        for w, share in enumerate(shares):
            todo[w] = deque(wire.pack(piece, shared) for piece in wire.pieces(share, PIECES, PIECE_BYTES))
        refs = [ray.put(a) for a in shared.arrays]  # each distinct array in the object store once
        received: dict[int, set[int]] = {w: set() for w in todo}  # shared arrays a worker already holds
        down = up = 0
        generation = [0] * len(self.workers)
        inflight: dict[Any, tuple[int, int, wire.Batch]] = {}  # ref -> (worker, generation, piece)
        results: dict[int, ClientResult] = {}

        def send(w: int, piece: wire.Batch) -> None:
            nonlocal down
            down += wire.batch_bytes(piece, shared, received[w])
            ref = self.workers[w].train_batch.remote(piece, *[refs[k] for k in piece.keys])
            inflight[ref] = (w, generation[w], piece)

        for w, pieces in todo.items():
            for _ in range(min(PIPELINE, len(pieces))):
                send(w, pieces.popleft())
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1)
            for ref in ready:
                w, gen, piece = inflight.pop(ref)
                try:
                    got = ray.get(ref)
                except _DEAD:  # the worker died: replace it (once) and re-run its pieces from their plans
                    if gen == generation[w]:
                        self._losses.append(_loss_line(self.nodes[w] if w < len(self.nodes) else "?"))
                        self.workers[w] = self._spawn()
                        generation[w] += 1
                        self.restarts += 1
                        received[w] = set()
                    send(w, piece)
                    continue
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    msg = str(cause) if isinstance(cause, ClientError) else (
                        f"a client of worker {w} failed in round {ordered[0].round}: {cause.__class__.__name__}: {cause}")
                    for other in inflight:
                        ray.cancel(other, force=False)
                    raise ClientError(msg) from None
                up += wire.payload_bytes(got)
                for r in got:
                    results[r.client_id] = wire.restore_result(r, plans[r.client_id])
                if got and w < len(self.nodes):
                    self.nodes[w] = got[-1].node  # a replacement's node is known from its first results
                if todo[w]:
                    send(w, todo[w].popleft())
        self.moved = (down, up)
        return [results[cid] for cid in sorted(results)]

    def _work(self, plan: ClientPlan) -> float:
        return wire.expected_work(plan, self._samples.get(plan.client_id, 1))

    def close(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # already gone
                pass
        self.workers = []


@ray.remote(num_cpus=0)
class ServerActor:
    """Hosts the run's :class:`RunSession` next to the driver; see the module docstring."""

    def __init__(self, cfg: ExperimentConfig, out: str, run_id: str, federation: Federation | None,
                 resume: bool = False, driver: DriverCache | None = None) -> None:
        tune_malloc()  # the server's aggregation and evaluation allocate round-sized blocks too (allocator.py)
        if cfg.resources.compile in compiled.EVAL_MODES:  # the server evaluates: its compiles, the driver's folder
            adopt_driver_cache(driver)
        self.pool = RayWorkerPool(cfg, driver)
        self.refused: Exception | None = None
        try:
            self.session = RunSession(cfg, out, run_id, federation=federation, backend=self.pool, resume=resume)
        except (ConfigError, CheckpointUnreadable) as e:  # bad input (e.g. a resume's checkpoint): the driver's to raise
            self.refused = e

    def refusal(self) -> Exception | None:
        """Why the session was refused when it was built (None: it was built), for the driver to raise as itself."""
        return self.refused

    def start(self) -> int:
        return self.session.start()

    def step(self, t: int):
        return self.session.step(t)

    def metrics(self, workers: bool = False) -> SessionMetrics:
        return self.session.metrics(workers)

    def finish(self, status: str, error: str | None = None) -> RunOutcome:
        return self.session.finish(status, error)


class RemoteSession:
    """The RunSession interface the driver loop needs, each call executed on the ServerActor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def start(self) -> int:
        return ray.get(self.actor.start.remote())

    def step(self, t: int):
        return ray.get(self.actor.step.remote(t))

    def metrics(self, workers: bool = False) -> SessionMetrics:
        return ray.get(self.actor.metrics.remote(workers))

    def finish(self, status: str, error: str | None = None) -> RunOutcome:
        return ray.get(self.actor.finish.remote(status, error))


def run_on_ray(cfg: ExperimentConfig, out: Path, run_id: str, *, callbacks: Sequence[DriverCallback] = (),
               federation: Federation | None = None, resume: bool = False) -> RunOutcome:
    """Driver side of ``--backend ray``: the one driver loop, each session call remote.

    The federation is built here (so missing files fail fast, before any actor starts)
    and shipped once through the object store.
    """
    from fedsap_ray.data import build_federation

    fed = federation if federation is not None else build_federation(cfg)
    started = not ray.is_initialized()
    connect(cfg.resources.address, dashboard=cfg.resources.dashboard)
    check_cluster(cfg, len(fed.clients))
    here = ray.get_runtime_context().get_node_id()
    pin = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=here, soft=False)
    driver = (here, compiled.cache_env())
    actor = ServerActor.options(scheduling_strategy=pin).remote(cfg, str(out), run_id, fed, resume, driver)
    refused = ray.get(actor.refusal.remote())
    if refused is not None:  # the session's own refusal, one line (exit 2), not the actor's death and a traceback
        ray.kill(actor)
        if started:  # a command that ends on this refusal leaves no Ray thread running into the interpreter's exit
            ray.shutdown()
        raise refused
    try:
        return drive_one(RemoteSession(actor), cfg.training.rounds, callbacks)
    finally:
        ray.kill(actor)
