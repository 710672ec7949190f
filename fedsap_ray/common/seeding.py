"""Every random choice draws from a generator seeded by (run seed, round, client, purpose).

That is what makes numbers independent of which worker runs which client, and of
the order clients run in (docs/architecture.md#determinism).
"""
from __future__ import annotations

import zlib

import numpy as np


def _purpose(purpose: str) -> int:
    return zlib.crc32(purpose.encode())


def seed_for(seed: int, round_: int, client: int, purpose: str) -> int:
    """A 63-bit integer seed for torch generators."""
    ss = np.random.SeedSequence([seed, round_ + 1, client + 2, _purpose(purpose)])
    return int(ss.generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)


def rng_for(seed: int, round_: int, client: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, round_ + 1, client + 2, _purpose(purpose)]))
