"""In-process backend: the very same client code, several clients at a time in threads.

Each client trains with ``resources.torch_threads`` intra-op threads (1 by default) on
its own scratch model, and ``num_workers`` clients run concurrently (PyTorch releases
the GIL inside its kernels). A client's numbers depend only on its plan, its data and
the thread count, never on which thread ran it or in what order, so results equal
those of a sequential run and of the Ray backend. Errors carry round and client id.

What a client would otherwise pay again every round is paid once per run here (issue 27,
measured in :mod:`fedsap_ray.engine.client`'s docstring): each client's data is prepared once
(:class:`~fedsap_ray.engine.client.PreparedData`: gathered, normalised, on the device; the GPU copy
of issue 17 is part of it), the scratch models are put on the device at start, and
:func:`~fedsap_ray.engine.client.warm_torch` pays torch's optimizer start-up at start, not in round 1, and
:func:`~fedsap_ray.runtime.allocator.tune_malloc` keeps the C allocator from returning a round's memory to
the OS only to fault it in again.
"""
from __future__ import annotations

import copy
import queue
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.engine.client import PreparedData, default_workers, pick_device, to_device, train_client, warm_torch
from fedsap_ray.common.messages import ClientPlan, ClientResult
from fedsap_ray.runtime import wire
from fedsap_ray.runtime.allocator import tune_malloc


def ray_node() -> str:
    """The Ray node this process runs on when Ray is up in it (a sweep trial training its clients in-process,
    ``--workers-per-trial 0``), so ``clients.node`` says where a trial ran; ``'local'`` otherwise. Ray is read
    from ``sys.modules``, never imported: a plain local run does not load it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "local"
    from fedsap_ray.runtime.ray import NODE_CHARS

    return str(ray.get_runtime_context().get_node_id())[:NODE_CHARS]


class LocalBackend:
    name = "local"

    def __init__(self, device: str = "auto", num_workers: int | None = None, torch_threads: int = 1,
                 compile: str = "off") -> None:
        self.device = pick_device(device)
        self.compile = compile  # resources.compile (fedsap_ray.engine.compiled)
        self.torch_threads = torch_threads
        self.num_workers = num_workers or default_workers(torch_threads)
        self.ctx: RunContext | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._data: PreparedData | None = None  # each client's prepared data, built once per run
        self._samples: dict[int, int] = {}  # client id -> its training samples (the expected work of its plans)
        self.node = "local"
        self.moved = (0, 0)  # nothing crosses a process boundary: plans hand their vectors over by reference

    def start(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.node = ray_node()
        tune_malloc()  # keep freed memory in the process: a round's blocks are not faulted in again (allocator.py)
        torch.set_num_threads(self.torch_threads)
        warm_torch()
        self._data = PreparedData(ctx.federation.client_data, self.device)
        # one scratch model per concurrent client, on the device; the template stays untouched
        self._models: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(self.num_workers):
            model = copy.deepcopy(ctx.model)
            to_device(model, self.device)
            self._models.put(model)
        if self.num_workers > 1:
            self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="fedsap-client")
        self._samples = {c.client_id: c.n_samples for c in ctx.federation.clients}

    def _one(self, plan: ClientPlan) -> ClientResult:
        assert self.ctx is not None and self._data is not None
        model = self._models.get()
        try:
            result = train_client(plan, model, self.ctx.layout, self._data.get(plan.client_id), self.device,
                                  self.compile)
            result.node = self.node
            return result
        finally:
            self._models.put(model)

    def train(self, plans: dict[int, ClientPlan]) -> list[ClientResult]:
        """The round's clients, the longest expected work first (:func:`wire.expected_work`; ties: the lower
        client id): each free thread takes the next, so a long client never starts last while the other thread
        idles (greedy longest-first, as the Ray pool shares a round). Results in client-id order; which thread
        trained a client changes no number (module docstring)."""
        if self.ctx is None:
            raise RuntimeError("LocalBackend.train called before start()")
        ordered = sorted(plans.values(), key=lambda p: (-wire.expected_work(p, self._samples.get(p.client_id, 1)),
                                                        p.client_id))
        if self._pool is None:
            results = [self._one(p) for p in ordered]
        else:
            results = list(self._pool.map(self._one, ordered))
        return sorted(results, key=lambda r: r.client_id)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._data is not None:
            self._data.clear()
            self._data = None
        self.ctx = None
