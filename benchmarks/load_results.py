"""How long loading a sweep's results takes: per-file loop vs one dataset scan vs after compaction.

Builds ``--runs`` per-run results (every table, ``--rounds`` rounds: ``--domains`` + 1
rounds rows, ``--clients`` clients and allocations rows and 4 layers rows per client per
round) in a temporary folder with :func:`fedsap_ray.results.write_atomic`, exactly as
runs write them, then times, in the same invocation:

- ``per_file``: the reader ``results.load`` used before (a Python loop of one
  ``pq.read_table`` per file, kept below as the reference),
- ``dataset``: ``results.load`` (one multi-threaded pyarrow dataset scan per table),
- ``compacted``: ``results.load`` after ``results.compact`` (one file per table); the
  compaction itself is timed once as ``compact_s``.

Each is the best of ``--repeat`` loads (warm page cache: the files were just written).
All three give the same frames (checked, order-insensitive). One JSON line on stdout.

    python benchmarks/load_results.py                 # 2000 runs x 25 rounds
    python benchmarks/load_results.py --runs 200      # quick check
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from fedsap_ray import __version__, results

TABLES = ("runs", *results.DATA_TABLES)
KEYS = {"runs": ["run_id"], "rounds": ["run_id", "round", "domain"], "clients": ["run_id", "round", "client_id"],
        "layers": ["run_id", "round", "client_id", "layer"], "allocations": ["run_id", "round", "client_id"]}


def old_read_table(path: Path, table: str) -> pd.DataFrame:
    """The reference: results.read_table before the dataset scan (one read per file, then concat)."""
    folder = Path(path) / table
    files = sorted(f for f in folder.glob("*.parquet") if not f.name.startswith((".", "_"))) if folder.is_dir() else []
    sch = results.schema(table)
    if not files:
        return sch.empty_table().to_pandas()
    parts = []
    for f in files:
        t = pq.read_table(f)
        for field in sch:  # files from older schema versions: add the missing columns as nulls
            if field.name not in t.column_names:
                t = t.append_column(field, pa.nulls(len(t), field.type))
        parts.append(t.select(sch.names).cast(sch))
    return pa.concat_tables(parts).to_pandas()


def old_load(path: Path) -> dict[str, pd.DataFrame]:
    return {t: old_read_table(path, t) for t in TABLES}


def new_load(path: Path) -> dict[str, pd.DataFrame]:
    res = results.load(path)
    return {t: res[t] for t in TABLES}


def build(out: Path, runs: int, rounds: int, domains: int, clients: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    t0 = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    doms = [f"d{k}" for k in range(domains)] + [results.GLOBAL_DOMAIN]
    for i in range(runs):
        run_id = f"{i:08x}-{rng.integers(1 << 30):08x}"
        base = {"schema_version": results.SCHEMA_VERSION, "run_id": run_id}
        acc = rng.random((rounds, len(doms)))
        rows = {
            "runs": [{**base, "study": "bench", "algorithm": "fedsap", "dataset": "digits", "model": "cnn_small",
                      "seed": i, "num_clients": clients, "rounds": rounds, "rounds_done": rounds, "status": "finished",
                      "config_json": json.dumps({"seed": i, "pad": "x" * 1500}), "started_at": t0,
                      "finished_at": t0, "wall_s": float(rng.random()), "final_global_accuracy": float(acc[-1, -1])}],
            "rounds": [{**base, "round": t + 1, "domain": d, "eval_mode": "global", "evaluated": True,
                        "accuracy": float(acc[t, k]), "loss": float(acc[t, k] * 2), "n_test": 500,
                        "global_accuracy": float(acc[t, -1]), "bytes_up": int(1e6), "round_wall_s": 1.0,
                        "frozen_params": 0} for t in range(rounds) for k, d in enumerate(doms)],
            "clients": [{**base, "round": t + 1, "client_id": c, "true_domain": doms[c % domains],
                         "capacity_used": float(rng.random()), "n_samples": 100, "train_loss": float(rng.random()),
                         "worker": "local", "wall_s": 0.1} for t in range(rounds) for c in range(clients)],
            "layers": [{**base, "round": t + 1, "client_id": c, "layer": f"layer{k}", "channels": 64,
                        "keep_ratio": float(rng.random()), "n_global": 30, "n_private": 10, "n_dropped": 24}
                       for t in range(rounds) for c in range(clients) for k in range(4)],
            "allocations": [{**base, "round": t + 1, "client_id": c, "capacity_max": 1.0, "p": float(rng.random()),
                             "adapted": False} for t in range(rounds) for c in range(clients)],
        }
        for table, r in rows.items():
            results.write_atomic(results.to_table(table, r), out / table / f"{run_id}.parquet")


def timed(fn, path: Path, repeat: int) -> tuple[float, dict[str, pd.DataFrame]]:
    best, res = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        res = fn(path)
        best = min(best, time.perf_counter() - t)
    return best, res


def same(a: dict[str, pd.DataFrame], b: dict[str, pd.DataFrame]) -> None:
    """The same rows and values; ``b`` may add columns (``results.load`` derives the runs' ``config.*`` columns)."""
    for t in TABLES:
        pd.testing.assert_frame_equal(a[t].sort_values(KEYS[t]).reset_index(drop=True),
                                      b[t][list(a[t].columns)].sort_values(KEYS[t]).reset_index(drop=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--domains", type=int, default=4)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="build the folder here (default: a temporary folder, removed at the end)")
    a = p.parse_args(argv)
    out = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="fedsap_load_"))
    try:
        t = time.perf_counter()
        build(out, a.runs, a.rounds, a.domains, a.clients, a.seed)
        build_s = time.perf_counter() - t
        files = sum(1 for _ in out.glob("*/*.parquet"))
        size = sum(f.stat().st_size for f in out.glob("*/*.parquet"))
        print(f"built {files} files in {build_s:.1f}s under {out}", file=sys.stderr)
        load1 = os.getloadavg()[0]
        ref_s, ref = timed(old_load, out, a.repeat)
        new_s, new = timed(new_load, out, a.repeat)
        same(ref, new)
        t = time.perf_counter()
        counts = results.compact(out)
        compact_s = time.perf_counter() - t
        comp_s, comp = timed(new_load, out, a.repeat)
        same(ref, comp)
        rows = {t: len(ref[t]) for t in TABLES}
        print(json.dumps({
            "runs": a.runs, "rounds": a.rounds, "files": files, "rows": rows,
            "bytes_per_run": size // max(a.runs, 1),
            "bytes_after_compact": sum(f.stat().st_size for f in out.glob("*/*.parquet")),
            "per_file_s": round(ref_s, 3), "dataset_s": round(new_s, 3), "compacted_s": round(comp_s, 3),
            "compact_s": round(compact_s, 3), "files_after_compact": sum(1 for _ in out.glob("*/*.parquet")),
            "ratio_dataset_vs_per_file": round(new_s / ref_s, 3),
            "ratio_compacted_vs_per_file": round(comp_s / ref_s, 4),
            "speedup_dataset": round(ref_s / new_s, 1), "speedup_compacted": round(ref_s / comp_s, 1),
            "compact_counts": counts, "repeat": a.repeat, "cpu_count": os.cpu_count(),
            "load1_before": round(load1, 2), "load1_after": round(os.getloadavg()[0], 2),
            "pyarrow": pa.__version__, "pandas": pd.__version__, "fedsap_ray": __version__,
        }))
    finally:
        if not a.dir:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
