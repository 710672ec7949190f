"""In-process backend: the very same client code, several clients at a time in threads.

Each client trains with ``resources.torch_threads`` intra-op threads (1 by default) on
its own scratch model, and ``num_workers`` clients run concurrently (PyTorch releases
the GIL inside its kernels). A client's numbers depend only on its plan, its data and
the thread count, never on which thread ran it or in what order, so results equal
those of a sequential run and of the Ray backend. Errors carry round and client id.
"""
from __future__ import annotations

import copy
import queue
from concurrent.futures import ThreadPoolExecutor

import torch

from fedsap_ray.context import RunContext
from fedsap_ray.client import default_workers, on_device, pick_device, train_client
from fedsap_ray.data.base import DomainData
from fedsap_ray.messages import ClientPlan, ClientResult


class LocalBackend:
    name = "local"

    def __init__(self, device: str = "auto", num_workers: int | None = None, torch_threads: int = 1) -> None:
        self.device = pick_device(device)
        self.torch_threads = torch_threads
        self.num_workers = num_workers or default_workers(torch_threads)
        self.ctx: RunContext | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._data: dict[int, DomainData] = {}  # client id -> its data on the GPU (moved once; unused on CPU)

    def start(self, ctx: RunContext) -> None:
        self.ctx = ctx
        torch.set_num_threads(self.torch_threads)
        # one scratch model per concurrent client; the template stays untouched
        self._models: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(self.num_workers):
            self._models.put(copy.deepcopy(ctx.model))
        if self.num_workers > 1:
            self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="fedsap-client")

    def _one(self, plan: ClientPlan) -> ClientResult:
        assert self.ctx is not None
        model = self._models.get()
        try:
            return train_client(plan, model, self.ctx.layout, self._client_data(plan.client_id), self.device)
        finally:
            self._models.put(model)

    def _client_data(self, cid: int) -> DomainData:
        """The client's data; on a GPU moved there once, not every round (issue 17: no per-round copies)."""
        assert self.ctx is not None
        if self.device.type == "cpu":
            return self.ctx.federation.client_data(cid)
        if cid not in self._data:
            self._data[cid] = on_device(self.ctx.federation.client_data(cid), self.device)
        return self._data[cid]

    def train(self, plans: dict[int, ClientPlan]) -> list[ClientResult]:
        if self.ctx is None:
            raise RuntimeError("LocalBackend.train called before start()")
        ordered = [plans[cid] for cid in sorted(plans)]
        if self._pool is None:
            return [self._one(p) for p in ordered]
        return list(self._pool.map(self._one, ordered))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._data.clear()
        self.ctx = None
