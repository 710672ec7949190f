"""Shared fixtures: where the real data files are, and small configs for fast runs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FEDSAP_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return SHARED_DATA


def shared_file(rel: str) -> Path:
    """Path of a file under ../shared/data, skipping the test (with the reason) when it is absent."""
    p = SHARED_DATA / rel
    if not p.exists():
        pytest.skip(f"real data file not found at {p} (set FEDSAP_SHARED_DATA to the folder holding it)")
    return p


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models: one intra-op thread avoids OpenMP spin-waits on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
