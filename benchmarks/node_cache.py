"""What a trial pays to get its dataset: a fresh load in every process vs the node-local cache, and
what the content check of the cache costs beside it.

Every Tune trial is a new worker process. Without the node cache each one decodes the
dataset again (``load_splits``: for the embedded dataset, inflating its compressed
``.npz`` cache; for real datasets, decoding JPEG/PNG/idx files) and holds its own copy.
With :func:`fedsap_ray.data.node_cache.shared_splits` the first process writes ``.npy``
files once and every later one memory-maps them. Measured in the same invocation, each
in ``--processes`` fresh subprocesses (the cost a trial sees), for the given preset:

- ``fresh``: ``build_federation(cfg)`` (what a trial did before),
- ``node_cache``: ``build_federation(cfg, shared_splits(cfg))`` with the entry built
  beforehand (the cost every trial after the first sees),

plus the resident memory each process ends with (``maxrss``, which counts the pages of the
maps the process read, though the node's page cache holds them once for every process, and
``anon``: the anonymous memory, what the process holds of its own), and ``check_s``: the seconds of
``data_s`` spent comparing the cache's content digests (:func:`fedsap_ray.data.cachefile.verify`:
sha256 over every array, once per process; for ``fresh`` the embedded file's members as read,
for ``node_cache`` the entry's maps, which pulls their pages in). Medians over the processes.
One JSON line on stdout.

    python benchmarks/node_cache.py                              # laptop preset (embedded dataset)
    python benchmarks/node_cache.py --preset confound_laptop     # real MNIST from ../shared/data
    python benchmarks/node_cache.py --check-threads 1            # the check on one thread
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import statistics

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from fedsap_ray.config import build_config
from fedsap_ray.data import cachefile
from fedsap_ray.data.federation import build_federation
from fedsap_ray.data.node_cache import shared_splits
checks = []
verify = cachefile.verify
def timed_verify(*a, **k):  # the content check, timed where every cache calls it
    t = time.perf_counter()
    try:
        return verify(*a, **k)
    finally:
        checks.append(time.perf_counter() - t)
cachefile.verify = timed_verify
if sys.argv[4] != "default":
    cachefile.MAX_THREADS = int(sys.argv[4])
t_import = time.perf_counter()
cfg = build_config(preset=sys.argv[1], seed=0)
fed = build_federation(cfg, shared_splits(cfg, sys.argv[3])) if sys.argv[2] == "node_cache" else build_federation(cfg)
n = sum(len(v) for v in fed.train.values())
data_s = time.perf_counter() - t_import
anon_mb = 0.0  # what the process holds of its own: RSS also counts the file pages of the maps it read
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("Anonymous:"):
        anon_mb = int(line.split()[1]) / 1024
print(json.dumps({"data_s": data_s, "check_s": sum(checks), "checks": len(checks), "samples": n,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "anon_mb": anon_mb}))
"""


def measure(mode: str, preset: str, cache: str, n: int, threads: str) -> dict:
    runs = []
    for _ in range(n):
        out = subprocess.run([sys.executable, "-c", CHILD, preset, mode, cache, threads], capture_output=True,
                             text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"data_s_median": statistics.median(r["data_s"] for r in runs),
            "check_s_median": statistics.median(r["check_s"] for r in runs),
            "check_share_median": statistics.median(r["check_s"] / r["data_s"] for r in runs),
            "checks": runs[0]["checks"],
            "maxrss_mb_median": statistics.median(r["maxrss_mb"] for r in runs),
            "anon_mb_median": statistics.median(r["anon_mb"] for r in runs), "samples": runs[0]["samples"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="laptop")
    p.add_argument("--processes", type=int, default=5)
    p.add_argument("--check-threads", default="default",
                   help="threads the digest check may use (fedsap_ray.data.cachefile.MAX_THREADS; default: the code's)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        subprocess.run([sys.executable, "-c", CHILD, args.preset, "node_cache", cache, args.check_threads], check=True,
                       capture_output=True)  # the first trial on the node builds the entry
        fresh = measure("fresh", args.preset, cache, args.processes, args.check_threads)
        cached = measure("node_cache", args.preset, cache, args.processes, args.check_threads)
    print(json.dumps({"preset": args.preset, "processes": args.processes, "check_threads": args.check_threads,
                      "fresh": fresh, "node_cache": cached,
                      "time_ratio": cached["data_s_median"] / fresh["data_s_median"],
                      "rss_ratio": cached["maxrss_mb_median"] / fresh["maxrss_mb_median"],
                      "anon_ratio": cached["anon_mb_median"] / fresh["anon_mb_median"]}))


if __name__ == "__main__":
    main()
