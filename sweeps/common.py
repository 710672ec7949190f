"""The plain study loop the study scripts share: named variants x seeds, resumable, one process.

Run ids are deterministic (``<variant>-s<seed>``): a finished run is skipped and an
interrupted one resumes from its per-round checkpoint, so a study can be killed and
restarted at any point without losing or duplicating a run.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import pyarrow.parquet as pq

from fedsap_ray import checkpoint
from fedsap_ray.config import build_config
from fedsap_ray.experiment import run_experiment
from fedsap_ray.progress import ProgressPrinter


def run_variants(out: Path, variants: dict[str, list[str]], seeds: Sequence[int], *, preset: str,
                 extra: Sequence[str] = (), backend: str = "local", study: str = "study") -> None:
    """Run every (variant, seed) not finished yet in ``out``; progress on stderr."""
    out = Path(out)
    todo = [(v, s) for s in seeds for v in variants]
    for i, (variant, seed) in enumerate(todo, 1):
        run_id = f"{variant}-s{seed}"
        cfg = build_config(preset=preset, overrides=[*variants[variant], *extra, f"resources.backend={backend}",
                                                     f"study={study}"], seed=seed)
        status = run_status(out, run_id)
        if status == "finished":
            print(f"[{i}/{len(todo)}] {run_id}: finished earlier, skipped", file=sys.stderr)
            continue
        resume = status is not None and checkpoint.path_for(out, run_id).is_file()
        print(f"[{i}/{len(todo)}] {run_id}: {'resuming' if resume else 'running'}", file=sys.stderr)
        run_experiment(cfg, out, run_id=run_id, resume=resume, progress=ProgressPrinter(cfg.training.rounds))


def run_status(out: Path, run_id: str) -> str | None:
    """The ``runs`` row's status of a run in ``out`` (None: never started)."""
    f = Path(out) / "runs" / f"{run_id}.parquet"
    return pq.read_table(f).to_pylist()[0]["status"] if f.is_file() else None
