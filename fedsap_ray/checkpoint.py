"""Per-run checkpoints: the explicit ServerState after every round, written atomically.

Every random choice is seeded by (run seed, round, client, purpose) and the state is
explicit (docs/architecture.md#determinism), so a run resumed from round t's checkpoint produces the
same numbers as one that was never interrupted. The file is removed when the run
finishes.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from fedsap_ray.atomic import atomic_write
from fedsap_ray.errors import CheckpointUnreadable
from fedsap_ray.messages import ServerState


def path_for(out: Path, run_id: str) -> Path:
    return Path(out) / "checkpoints" / f"{run_id}.pkl"


def save(out: Path, run_id: str, state: ServerState, server_metrics: dict[str, Any],
         tables: list[str] | None = None) -> None:
    """Write the checkpoint atomically; ``tables``: the per-round tables the run has written
    so far, so a resume can tell a missing table file from one the run never had.

    On any failure (e.g. a full disk) the temporary file is removed: a half-written
    checkpoint the size of the model would otherwise keep the disk full.
    """
    with atomic_write(path_for(out, run_id)) as f:
        pickle.dump({"state": state, "server": server_metrics, "tables": list(tables or [])}, f,
                    protocol=pickle.HIGHEST_PROTOCOL)


def load(out: Path, run_id: str) -> dict[str, Any]:
    """The checkpoint's dict (``state``, ``server``, ``tables``: absent in older checkpoints).

    A file that cannot be unpickled raises :class:`CheckpointUnreadable` naming it.
    """
    path = path_for(out, run_id)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint for run {run_id} at {path}")
    try:
        with open(path, "rb") as f:
            ck = pickle.load(f)
        if not isinstance(ck, dict) or not isinstance(ck.get("state"), ServerState):
            raise ValueError("not a fedsap_ray checkpoint")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError,
            KeyError, MemoryError) as e:
        raise CheckpointUnreadable(f"checkpoint {path} is unreadable ({e.__class__.__name__}: {e}); it is truncated "
                                   "or damaged, so the run cannot continue from it") from e
    return ck


def remove(out: Path, run_id: str) -> None:
    path_for(out, run_id).unlink(missing_ok=True)


def remove_temp_files(out: Path, run_id: str) -> list[Path]:
    """Delete temporary checkpoints a killed writer of this run left (only while holding its claim)."""
    import glob

    gone = list(Path(path_for(out, run_id).parent).glob(f".{glob.escape(run_id)}.pkl.*.tmp"))
    for f in gone:
        f.unlink(missing_ok=True)
    return gone
