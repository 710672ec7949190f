"""The plain study loop the study scripts share: named variants x seeds, resumable.

Run ids are deterministic (``<variant>-s<seed>``): a finished run is skipped and an
interrupted one resumes from its per-round checkpoint, so a study can be killed and
restarted at any point without losing or duplicating a run. ``jobs > 1`` runs that many
runs at once in worker processes (each run writes only its own files); every run keeps
``resources.torch_threads`` intra-op threads, so the numbers do not depend on ``jobs``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from dataclasses import replace
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Sequence

import pyarrow.parquet as pq

from fedsap_ray import checkpoint
from fedsap_ray.config import ExperimentConfig, build_config
from fedsap_ray.experiment import run_experiment
from fedsap_ray.progress import ProgressPrinter


def run_variants(out: Path, variants: dict[str, list[str]], seeds: Sequence[int], *, preset: str,
                 extra: Sequence[str] = (), backend: str = "local", study: str = "study", jobs: int = 1) -> None:
    """Run every (variant, seed) not finished yet in ``out``; progress on stderr."""
    out = Path(out)
    todo: list[tuple[str, ExperimentConfig, bool]] = []
    for variant, seed in [(v, s) for s in seeds for v in variants]:
        run_id = f"{variant}-s{seed}"
        cfg = build_config(preset=preset, overrides=[*variants[variant], *extra, f"resources.backend={backend}",
                                                     f"study={study}"], seed=seed)
        status = run_status(out, run_id)
        if status == "finished":
            print(f"{run_id}: finished earlier, skipped", file=sys.stderr)
            continue
        todo.append((run_id, cfg, status is not None and checkpoint.path_for(out, run_id).is_file()))
    if jobs <= 1:
        for i, (run_id, cfg, resume) in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] {run_id}: {'resuming' if resume else 'running'}", file=sys.stderr)
            run_experiment(cfg, out, run_id=run_id, resume=resume, progress=ProgressPrinter(cfg.training.rounds))
        return
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(_run_quietly, cfg, str(out), run_id, resume): run_id for run_id, cfg, resume in todo}
        for done, fut in enumerate(as_completed(futures), 1):
            fut.result()  # a failed run stops the study with its error (its runs row says failed)
            print(f"[{done}/{len(todo)}] {futures[fut]}: finished ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


def _run_quietly(cfg: ExperimentConfig, out: str, run_id: str, resume: bool) -> str:
    """One run in a worker process; its clients train one after another (the processes fill the cores)."""
    if cfg.resources.backend == "local":
        cfg = replace(cfg, resources=replace(cfg.resources, num_workers=1))
    run_experiment(cfg, Path(out), run_id=run_id, resume=resume, progress=None)
    return run_id


def run_status(out: Path, run_id: str) -> str | None:
    """The ``runs`` row's status of a run in ``out`` (None: never started)."""
    f = Path(out) / "runs" / f"{run_id}.parquet"
    return pq.read_table(f).to_pylist()[0]["status"] if f.is_file() else None


def study_main(argv: Sequence[str] | None, *, doc: str, variants: dict[str, list[str]], study: str,
               default_preset: str, smoke: Sequence[str], report: Callable[[Path], str]) -> int:
    """The command line every study script shares: parse, run what is missing, print the study's table."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", default=f"runs/{study}")
    p.add_argument("--preset", default=default_preset)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument("--jobs", type=int, default=1, help="runs at once in worker processes (local backend)")
    p.add_argument("--smoke-test", action="store_true", help="smoke preset, one seed, tiny model")
    args = p.parse_args(argv)
    preset, seeds, extra = args.preset, args.seeds, list(args.overrides)
    if args.smoke_test:
        preset, seeds, extra = "smoke", seeds[:1], extra + list(smoke)
    out = Path(args.out)
    run_variants(out, {v: variants[v] for v in args.variants}, seeds, preset=preset, extra=extra,
                 backend=args.backend, jobs=args.jobs, study=study)
    print(report(out))
    return 0
