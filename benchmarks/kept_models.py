"""What keeping a model costs a run, and loading one back (docs/guides/models.md).

Trains each method a few rounds in-process on a preset (FedSAP with ``algorithm.warmup=1``, so that its
clients hold private channels and deploy values of their own, the largest deployed parts), then times
``ModelKeeper.write`` (the global tensors, the clients' deployed parts, the JSON files; the first call also
takes the digests of the evaluated clients' training data, once per run) against the run's own round (its
fastest), and ``load_model`` of the narrowest evaluated client (the BN calibration on its data included).
Best of ``--repeats`` after the first call; sizes are the files' on disk (the JSON files included).

    python benchmarks/kept_models.py                              # laptop preset, FedAvg, HeteroFL, FedSAP, 3 rounds
    python benchmarks/kept_models.py --preset smoke --rounds 2 --algorithms fedsap
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from fedsap_ray.config import build_config
from fedsap_ray.results import kept_models, load_model
from fedsap_ray.runtime import make_backend
from fedsap_ray.run.session import RunSession


def timed(fn, repeats: int) -> tuple[float, float]:
    """(the first call's seconds, the best of ``repeats`` more): the first pays what is computed once per run."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[0], min(times[1:])


def measure(name: str, preset: str, rounds: int, repeats: int) -> str:
    """One table line: ``name`` trained ``rounds`` rounds on ``preset``, then its kept model timed."""
    extra = ["algorithm.warmup=1"] if name.startswith("fedsap") else []
    cfg = build_config(preset=preset, overrides=[f"algorithm.name={name}", f"training.rounds={rounds}",
                                                 "training.keep_model=final", *extra])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        session = RunSession(cfg, out, "bench", backend=make_backend(cfg))
        session.start()
        times = []
        for t in range(1, rounds + 1):
            t0 = time.perf_counter()
            session.step(t)
            times.append(time.perf_counter() - t0)
        state, rec, cj = session.state, session.recorder, session.base_row["config_json"]
        first, keep = timed(lambda: session.keeper.write("final", state, rec.primary_mode, rec.last_global, cj), repeats)
        narrow = min(session.keeper.deployed_clients, key=lambda c: session.ctx.federation.clients[c].capacity)
        _, load = timed(lambda: load_model(out, "bench", client=narrow), repeats)
        session.finish("finished")
        sizes = {p.name: p.stat().st_size for p in kept_models(out, "bench")}
    glob = sizes["final.safetensors"] + sizes["final.json"]
    dep = sizes["final.deployed.safetensors"] + sizes["final.deployed.json"]
    return (f"{name:<10} {min(times):>8.2f} {first:>8.3f} {keep:>8.3f} {load:>8.3f} {glob / 1e6:>10.2f} "
            f"{dep / 1e6:>12.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="laptop")
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "heterofl", "fedsap"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"{'algorithm':<10} {'round s':>8} {'1st keep':>8} {'keep s':>8} {'load s':>8} {'global MB':>10} "
          f"{'deployed MB':>12}")
    for name in args.algorithms:
        print(measure(name, args.preset, args.rounds, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
