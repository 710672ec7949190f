"""Per-run checkpoints: the explicit ServerState after every round, written atomically.

Every random choice is seeded by (run seed, round, client, purpose) and the state is
explicit (docs/architecture.md#determinism), so a run resumed from round t's checkpoint produces the
same numbers as one that was never interrupted. The file is removed when the run
finishes.
"""
from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path
from typing import Any

from fedsap_ray.messages import ServerState


def path_for(out: Path, run_id: str) -> Path:
    return Path(out) / "checkpoints" / f"{run_id}.pkl"


def save(out: Path, run_id: str, state: ServerState, server_metrics: dict[str, Any]) -> None:
    path = path_for(out, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump({"state": state, "server": server_metrics}, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def load(out: Path, run_id: str) -> dict[str, Any]:
    path = path_for(out, run_id)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint for run {run_id} at {path}")
    with open(path, "rb") as f:
        return pickle.load(f)


def remove(out: Path, run_id: str) -> None:
    path_for(out, run_id).unlink(missing_ok=True)
