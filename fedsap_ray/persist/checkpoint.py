"""Per-run checkpoints: the explicit ServerState after every round, written atomically.

Every random choice is seeded by (run seed, round, client, purpose) and the state is
explicit (docs/architecture.md#determinism), so a run resumed from round t's checkpoint produces the
same numbers as one that was never interrupted. The file is removed when the run
finishes.

Format: ``OUT/checkpoints/<run_id>.npz``, an uncompressed npz of the state's arrays plus a JSON
skeleton for everything else (:mod:`fedsap_ray.persist.treecodec`, format version in the file), read with
``allow_pickle=False``, and a content digest over both, compared on every load: a checkpoint damaged or
edited after it was written (without the digest recomputed) is refused by name, never resumed to other
tables. A deliberate edit that recomputes the digest is taken on trust (its content is still checked
against the run: :mod:`fedsap_ray.persist.statecheck`); a checkpoint of format version 1, written before the
digest, is read without one (docs/guides/running.md#resuming-an-interrupted-run).

A results folder is often someone else's (a shared sweep, a bucket), and
reading a checkpoint must never run code from it, which unpickling would: the ``<run_id>.pkl``
checkpoints of older versions are therefore never opened; a resume that finds one is refused
and says how to start the run again.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedsap_ray.persist import treecodec
from fedsap_ray.common.errors import CheckpointUnreadable
from fedsap_ray.common.messages import ServerState
from fedsap_ray.persist.outdir import OutDir

SUFFIX = ".npz"
LEGACY_SUFFIX = ".pkl"  # pickled checkpoints of fedsap_ray before format version 1: refused, never read
KIND = "checkpoint"


def path_for(out: Path, run_id: str) -> Path:
    return Path(out) / "checkpoints" / f"{run_id}{SUFFIX}"


def legacy_path_for(out: Path, run_id: str) -> Path:
    """Where an older fedsap_ray left its pickled checkpoint (only ever checked for, never opened)."""
    return Path(out) / "checkpoints" / f"{run_id}{LEGACY_SUFFIX}"


def legacy_refusal(path: Path | str) -> str:
    """Why a pickled checkpoint is not resumed, and what to do instead (the tail of a ConfigError)."""
    return (f"{path} is a pickled checkpoint of an older fedsap_ray; it is not read, because unpickling a file "
            "can run any code it holds: start the run again with --run-id ID --overwrite (a sweep: in a new --out)")


def save(out: Path, run_id: str, state: ServerState, server_metrics: dict[str, Any],
         tables: list[str] | None = None, rows: dict[str, dict[int, int]] | None = None,
         engine: dict[str, Any] | None = None, privacy: dict[str, Any] | None = None) -> None:
    """Write the checkpoint atomically; ``tables``: the per-round tables the run has written
    so far, so a resume can tell a missing table file from one the run never had; ``rows``: per table,
    the rows of each round written so far (``RunWriter.counts``), so a resume can tell a lost or
    truncated part of any table (:func:`fedsap_ray.run.guard.check_resumable`); ``engine``: the asynchronous
    engine's state (:meth:`fedsap_ray.engine.asyncmode.AsyncServer.state_dict`, versioned in itself; a
    synchronous run's checkpoint has none); ``privacy``: the privacy mechanism's state
    (:meth:`fedsap_ray.engine.privacy.PrivateRounds.state_dict`; none without privacy). One tree: an array the state
    and the engine share (the
    model the clients started on this version downloaded, a mask) is stored once and read back as one.

    A value the format does not store raises :class:`~fedsap_ray.persist.treecodec.TreeTypeError` naming
    its key (before anything is written). On any failure (e.g. a full disk) the temporary file is
    removed: a half-written checkpoint the size of the model would otherwise keep the disk full
    (:func:`fedsap_ray.persist.atomic.atomic_write`, whose error names the file).
    """
    tree = {"state": {"round": int(state.round), "params": state.params, "strategy": state.strategy_state},
            "server": server_metrics, "tables": list(tables or [])}
    if rows is not None:
        tree["rows"] = {t: {int(r): int(n) for r, n in sorted(c.items())} for t, c in rows.items()}
    if engine is not None:
        tree["engine"] = engine
    if privacy is not None:
        tree["privacy"] = privacy
    with OutDir(out).atomic_write(path_for(out, run_id)) as f:
        treecodec.write(f, tree, header={"kind": KIND, "run_id": run_id, "round": int(state.round)})


#: Keys the strategy state of a checkpoint from before the typed round flow (issue 26) held that were
#: outputs of the round it was written after, not state: FedSAP's ``round_info`` and HAS-FL's ``adapted``.
#: The next round never read them, so dropping them resumes such a run exactly.
LEGACY_ROUND_KEYS = ("round_info", "adapted")


def load(out: Path, run_id: str) -> dict[str, Any]:
    """The checkpoint's dict (``state``: a :class:`ServerState`, ``server``, ``tables``; ``rows``, ``engine`` and
    ``privacy`` when it holds them; the engine's state is checked by the engine, against the run).

    Anything but a checkpoint this format wrote for this run raises :class:`CheckpointUnreadable`
    naming the file; nothing in the file is ever executed.
    """
    path = path_for(out, run_id)
    d = OutDir(out)
    if not d.is_file(path):
        legacy = legacy_path_for(out, run_id)
        if d.is_file(legacy):
            raise CheckpointUnreadable(legacy_refusal(legacy))
        raise FileNotFoundError(f"no checkpoint for run {run_id} at {path}")
    try:
        with d.open_read(path) as fh:
            header, tree = treecodec.read(fh)
        if header.get("kind") != KIND or header.get("run_id") != run_id:
            raise treecodec.TreeFormatError(f"a {header.get('kind')!r} file of run {header.get('run_id')!r}, "
                                            f"not the checkpoint of run {run_id!r}")
        st = tree["state"]
        if "strategy" not in st and "extra" in st:  # written before the strategy's state was renamed
            st["strategy"] = st.pop("extra")
            if type(st["strategy"]) is dict:  # per-round outputs that now travel in the round's records
                for key in LEGACY_ROUND_KEYS:
                    st["strategy"].pop(key, None)
        params = st["params"]
        if type(st["round"]) is not int or not isinstance(params, np.ndarray) or params.dtype != np.float32 \
                or params.ndim != 1 or type(st["strategy"]) is not dict:
            raise treecodec.TreeFormatError("the state is not a round number, a 1-D float32 parameter vector "
                                            "and a dict of strategy state")
        if type(tree["server"]) is not dict or type(tree["tables"]) is not list:
            raise treecodec.TreeFormatError("no server metrics or table list")
        if header.get("round", st["round"]) != st["round"]:
            raise treecodec.TreeFormatError(f"its header says round {header.get('round')!r}, its state round {st['round']!r}")
    except treecodec.DigestMismatch as e:
        raise CheckpointUnreadable(f"checkpoint {path} was changed after the run wrote it ({e}): damaged, or edited "
                                   "without its digest, so the run cannot continue from it") from e
    except (treecodec.TreeFormatError, KeyError, TypeError) as e:
        why = (str(e).strip().splitlines() or [""])[0]
        why = why[:100] + ("..." if len(why) > 100 else "")
        raise CheckpointUnreadable(f"checkpoint {path} is unreadable ({e.__class__.__name__}: {why}); it is truncated, "
                                   "damaged or not a fedsap_ray checkpoint, so the run cannot continue from it") from e
    out_ = {"state": ServerState(round=st["round"], params=params, strategy_state=st["strategy"]),
            "server": tree["server"], "tables": tree["tables"]}
    for key in ("rows", "engine", "privacy"):
        if key in tree:
            out_[key] = tree[key]
    return out_


def remove(out: Path, run_id: str) -> None:
    """Delete the run's checkpoint (and a pickled one an older version left: it can never be resumed)."""
    d = OutDir(out)
    d.unlink(path_for(out, run_id))
    d.unlink(legacy_path_for(out, run_id))


def run_ids_in(names: list[str]) -> set[str]:
    """The run ids of the checkpoint file names ``names`` (base names in a ``checkpoints`` folder)."""
    return {n[: -len(SUFFIX)] for n in names if n.endswith(SUFFIX) and not n.startswith(".")}


def remove_temp_files(out: Path, run_id: str) -> list[Path]:
    """Delete temporary checkpoints a killed writer of this run left (only while holding its claim)."""
    d = OutDir(out)
    folder = path_for(out, run_id).parent
    gone = [*d.glob(folder, f".{run_id}{SUFFIX}.*.tmp"), *d.glob(folder, f".{run_id}.pkl.*.tmp")]
    for f in gone:
        d.unlink(f)
    return gone
