"""FedSAP's Table 5 ablation (aggregation path x layer-budget rule) plus heterogeneous FedAvg,
over several seeds, on any preset (default: the embedded ``laptop`` preset).

    python sweeps/fedsap_table5.py --out runs/table5 --seeds 0 1 2
    python sweeps/fedsap_table5.py --smoke-test           # seconds: every variant, one seed, tiny

Runs one after another in this process (or on Ray with --backend ray). Run ids are
deterministic (``<variant>-s<seed>``): a finished run is skipped and an interrupted one
resumes from its checkpoint, so the script can be killed and restarted at any point
without losing or duplicating a run. Prints the table (``analysis.fedsap``) at the end.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `analysis` from a source checkout

from analysis.fedsap import load_table, to_markdown  # noqa: E402
from fedsap_ray import checkpoint  # noqa: E402
from fedsap_ray.config import build_config  # noqa: E402
from fedsap_ray.experiment import run_experiment  # noqa: E402
from fedsap_ray.progress import ProgressPrinter  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "fedsap": ["algorithm.name=fedsap"],
    "fedsap-uniform": ["algorithm.name=fedsap", "algorithm.adaptive_layer_budget=0"],
    "single-adaptive": ["algorithm.name=fedsap", "algorithm.sgp=false"],
    "single-uniform": ["algorithm.name=fedsap", "algorithm.sgp=false", "algorithm.adaptive_layer_budget=0"],
    "fedavg-het": ["algorithm.name=fedavg", "algorithm.width=capacity"],
}
SMOKE = ["training.rounds=3", "data.max_test_per_domain=60", "model.width_mult=0.0625"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/fedsap_table5")
    p.add_argument("--preset", default="laptop")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument("--smoke-test", action="store_true", help="smoke preset, one seed, tiny model")
    args = p.parse_args(argv)
    preset, seeds, extra = args.preset, args.seeds, list(args.overrides)
    if args.smoke_test:
        preset, seeds, extra = "smoke", seeds[:1], extra + SMOKE
    out = Path(args.out)
    todo = [(v, s) for s in seeds for v in args.variants]
    for i, (variant, seed) in enumerate(todo, 1):
        run_id = f"{variant}-s{seed}"
        cfg = build_config(preset=preset, overrides=[*VARIANTS[variant], *extra, f"resources.backend={args.backend}",
                                                     "study=fedsap_table5"], seed=seed)
        status = _status(out, run_id)
        if status == "finished":
            print(f"[{i}/{len(todo)}] {run_id}: finished earlier, skipped", file=sys.stderr)
            continue
        resume = status is not None and checkpoint.path_for(out, run_id).is_file()
        print(f"[{i}/{len(todo)}] {run_id}: {'resuming' if resume else 'running'}", file=sys.stderr)
        run_experiment(cfg, out, run_id=run_id, resume=resume, progress=ProgressPrinter(cfg.training.rounds))
    print(to_markdown(load_table(out)))
    return 0


def _status(out: Path, run_id: str) -> str | None:
    f = out / "runs" / f"{run_id}.parquet"
    return pq.read_table(f).to_pylist()[0]["status"] if f.is_file() else None


if __name__ == "__main__":
    raise SystemExit(main())
