"""Which clients train in a round (:class:`Sampler`): one seeded draw, shaped by the simulated devices only when
asked, so every strategy that samples draws the same clients for the same seed and round."""
from __future__ import annotations

import numpy as np

from fedsap_ray.data import devices
from fedsap_ray.algorithms.memo import Memo
from fedsap_ray.algorithms.context import StrategyContext
from fedsap_ray.config.schema import ExperimentConfig
from fedsap_ray.common.seeding import rng_for


class Sampler:
    """A run's client sampling and its simulated devices; a strategy holds one as ``self.sampler``."""

    def __init__(self, cfg: ExperimentConfig, ctx: StrategyContext, memo: Memo) -> None:
        self.cfg, self.ctx, self.memo = cfg, ctx, memo

    def sample(self, t: int) -> list[int]:
        """Seeded uniform sample of ceil-free round(participation * N) clients (at least one), or under
        ``privacy.sampling=poisson`` each client with probability round(participation * N) / N.

        Simulated devices (:mod:`fedsap_ray.data.devices`) change it only when asked: with an availability
        below 1 the sample is drawn from the clients available in round ``t``, and under
        ``devices.policy=over_select`` it holds ``ceil(k * (1 + over_select))`` of them (the server
        aggregates the ``k`` that finish first). Otherwise the draw is exactly the one above."""
        n = len(self.ctx.federation.clients)
        k = devices.round_size(self.cfg, n)
        dev = self.cfg.devices
        if self.cfg.privacy.mode != "off" and self.cfg.privacy.sampling == "poisson":
            # privacy.sampling=poisson: each client joins with probability q = k / n on its own coin, so the
            # standard subsampled-Gaussian analysis applies (config/accountant.py); the sample may be empty
            coins = rng_for(self.cfg.seed, t, -1, "poisson-sample").random(n)
            return [int(i) for i in np.flatnonzero(coins < k / n)]
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
        """Every client's simulated device (:func:`fedsap_ray.data.devices.devices_for`), built once per run: the
        sampling here and the server's clock read the same list (a trace is read once)."""
        return self.memo("devices", None, lambda: devices.devices_for(
            self.cfg, [c.capacity for c in self.ctx.federation.clients]))
