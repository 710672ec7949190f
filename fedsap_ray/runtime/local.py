"""In-process backend: runs the very same client code one client after another.

Used by tests and for debugging; errors carry round and client id (DESIGN section 9).
"""
from __future__ import annotations

import copy

from fedsap_ray.algorithms.base import RunContext
from fedsap_ray.client import pick_device, train_client
from fedsap_ray.messages import ClientPlan, ClientResult


class LocalBackend:
    name = "local"

    def __init__(self, device: str = "auto") -> None:
        self.device = pick_device(device)
        self.ctx: RunContext | None = None

    def start(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.model = copy.deepcopy(ctx.model)  # scratch module; the template stays untouched

    def train(self, plans: dict[int, ClientPlan]) -> list[ClientResult]:
        if self.ctx is None:
            raise RuntimeError("LocalBackend.train called before start()")
        fed = self.ctx.federation
        return [train_client(plans[cid], self.model, self.ctx.layout, fed.client_data(cid), self.device)
                for cid in sorted(plans)]

    def close(self) -> None:
        self.ctx = None
