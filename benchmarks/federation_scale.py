#!/usr/bin/env python
"""What a round costs as the federation grows and the round does not (issue 29).

For each federation size (``--clients``, default 1,000, 10,000 and 100,000) and each method, one
run on ``generated_blobs`` (fedsap_ray/data/generated.py) with 5 samples per client on average (the
training pool is capped at ``5 * N / 4`` per domain, split IID among the domain's clients; domains get
their clients at random, so 4 to 6 each) and ``--per-round`` clients sampled per round (default 100;
``training.participation = per_round / N``), the MLP at quarter width, one local epoch of one batch.
So every round does the same training work at every size; only the federation around it grows.

Each (size, method, backend) runs in a fresh child process, so its memory is its own:

- ``build_s``: building the Federation (dataset draw, partition, capacities, TV): grows with N by
  construction (it touches every client once), reported apart from the rounds;
- ``per_round_s``: the mean time of rounds 2..R-1 (``perf_counter`` at each round end, in the progress
  callback, less the callback's own bookkeeping: the checkpoint's size, the peak resets). Round 1 is
  warm-up, and the last round also evaluates every model and writes the ``allocations`` snapshot of
  the whole federation, so it is reported apart as ``last_round_s``;
- ``round_peak_mib``: each process's peak resident memory *during rounds 2..R* (its ``VmHWM``
  after the peak counter is reset at the end of round 1 by writing ``5`` to ``/proc/PID/clear_refs``;
  Linux >= 4.0). For Ray this is read for the driver, the server actor and every client worker;
- ``rss_after_build_mib``: the driver's resident memory once the federation is built;
- ``nodes``: the Ray nodes the clients trained on (``--nodes K`` starts a K-node cluster on this machine,
  one CPU a node, and the Ray lines run on it; its actors' memory is read from this machine's /proc);
- ``rows_per_round``: rows each results table gained in the last round; ``checkpoint_bytes``: the
  size of the run's checkpoint after the last checkpointed round (what every round rewrites).

``ratio_vs_smallest``: each measure over the same measure of the smallest federation in the same
invocation (same method, same backend): a cost that follows the round stays near 1.0.

    python benchmarks/federation_scale.py                                   # local, fedavg fedsap heterofl
    python benchmarks/federation_scale.py --clients 1000 100000 --backends local ray --out scale.jsonl
    python benchmarks/federation_scale.py --clients 1000 2000 --rounds 3 --methods fedavg   # a quick check
    python benchmarks/federation_scale.py --methods fedavg --backends ray --nodes 3 --out scale.jsonl   # 3 nodes here
    python benchmarks/federation_scale.py --table scale.jsonl                # the markdown table of a file
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SAMPLES_PER_CLIENT = 5
# FedSAP's DGA reads a ResNet layer (algorithm.dga_layer), so on the MLP it runs without regrouping
METHOD_SETTINGS = {"fedsap": ["algorithm.dga=none"]}


def _proc_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _ray_processes(anywhere: bool) -> dict[int, str]:
    """pid -> role ('server', 'worker') of the Ray actors: this driver's descendants named ray::<Actor>, or
    (``anywhere``: a cluster the driver joined, whose nodes run on this machine) every such process here."""
    from fedsap_ray.runtime import reaper

    roles = {}
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()] if anywhere \
        else reaper.descendants(os.getpid())
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]
        except OSError:
            continue
        if name.startswith("ray::ServerActor"):
            roles[pid] = "server"
        elif name.startswith("ray::ClientWorker"):
            roles[pid] = "worker"
    return roles


def overrides(n: int, per_round: int, rounds: int, method: str, backend: str, address: str | None = None) -> list[str]:
    return [f"algorithm.name={method}", "data.name=generated_blobs", "model.name=mlp", "model.width_mult=0.25",
            "data.partition=iid", "data.client_fraction=1.0", f"data.num_clients={n}",
            f"data.max_train_per_domain={SAMPLES_PER_CLIENT * n // 4}", "data.max_test_per_domain=200",
            f"training.participation={per_round / n}", f"training.rounds={rounds}", "training.local_epochs=1",
            f"training.batch_size={SAMPLES_PER_CLIENT}", f"training.eval_every={rounds}",
            f"training.deployed_every={rounds}", "training.eval_clients=32", f"resources.backend={backend}",
            "resources.num_workers=2", *METHOD_SETTINGS.get(method, []),
            *([f"resources.address={address}", "resources.cpus_per_worker=1"] if address else [])]


def child(n: int, per_round: int, rounds: int, method: str, backend: str, address: str | None) -> dict[str, Any]:
    """One run in this process; the measures above as a dict."""
    from fedsap_ray import results
    from fedsap_ray.config import build_config
    from fedsap_ray.data import build_federation
    from fedsap_ray.run.driver import DriverCallback
    from fedsap_ray.experiment import run_experiment

    cfg = build_config(preset="smoke", overrides=overrides(n, per_round, rounds, method, backend, address))
    t0 = time.perf_counter()
    fed = build_federation(cfg)
    build_s = time.perf_counter() - t0
    rss_after_build = _proc_kib(os.getpid(), "VmRSS")
    ends: list[float] = []  # perf_counter when round t ended (the callback's first act)
    resumed: list[float] = []  # ... and when the callback's own bookkeeping was done
    watched: dict[int, str] = {}  # pid -> role of the processes whose peak was reset after round 1
    peaks: dict[int, int] = {}
    ckpt: list[int] = []
    with tempfile.TemporaryDirectory() as out:
        def progress(summary: Any) -> None:
            ends.append(time.perf_counter())
            found = sorted(Path(out).rglob("*.npz"))
            if found:
                ckpt.append(sum(p.stat().st_size for p in found))
            if summary.round == 1:
                procs = {os.getpid(): "driver", **(_ray_processes(bool(address)) if backend == "ray" else {})}
                watched.update({p: r for p, r in procs.items() if _reset_peak(p)})
            resumed.append(time.perf_counter())

        class Watch(DriverCallback):  # the actors' peaks must be read before the run ends them
            def on_round(self, t: int, summaries: Any, metrics: Any) -> None:
                if t == rounds:
                    peaks.update({pid: kib for pid in watched if (kib := _proc_kib(pid, "VmHWM")) is not None})

        run_experiment(cfg, out, run_id="scale", federation=fed, progress=progress, callbacks=[Watch()])
        res = results.load(out)
        last = {name: int((getattr(res, name)["round"] == rounds).sum()) for name in ("rounds", "clients", "allocations")}
        nodes = sorted(res.clients["node"].unique())
    by_role: dict[str, list[float]] = {}
    for pid, kib in peaks.items():
        by_role.setdefault(watched[pid], []).append(round(kib / 1024, 1))
    # round t's time runs from the end of round t-1's bookkeeping to the end of round t
    round_s = [e - r for r, e in zip(resumed, ends[1:])]
    return {"clients": n, "per_round": per_round, "method": method, "backend": backend, "rounds": rounds,
            "nodes": nodes,
            "build_s": round(build_s, 3), "rss_after_build_mib": round((rss_after_build or 0) / 1024, 1),
            "per_round_s": round(sum(round_s[:-1]) / len(round_s[:-1]), 4),
            "last_round_s": round(round_s[-1], 4),
            "round_s": [round(x, 4) for x in round_s],
            "round_peak_mib": {k: sorted(v) for k, v in by_role.items()},
            "rows_per_round": last, "checkpoint_bytes": ckpt[-1] if ckpt else None,
            "samples_per_client": SAMPLES_PER_CLIENT}


def _peak(row: dict[str, Any], role: str) -> float | None:
    v = row["round_peak_mib"].get(role)
    return max(v) if v else None


def _where(row: dict[str, Any]) -> str:
    """The backend, with the nodes the clients trained on for Ray (node ids are 12 hex digits; 'local' is not one)."""
    nodes = [n for n in row.get("nodes", []) if n != "local"]
    return f"{row['backend']} ({len(nodes)} node{'s' if len(nodes) != 1 else ''})" if row["backend"] == "ray" else row["backend"]


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table docs/guides/large-sweeps.md shows: one line per (backend, method, size)."""
    lines = ["| backend | method | clients | build (s) | round (s) | x | last round (s) | peak MiB: driver | "
             "server | workers | x (largest) | checkpoint (MiB) | allocations rows, last round |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio, peaks = r.get("ratio_vs_smallest", {}), r["round_peak_mib"]
        worst = max((v for k, v in ratio.items() if k.startswith("peak_")), default=1.0)
        lines.append(
            f"| {_where(r)} | {r['method']} | {r['clients']:,} | {r['build_s']:.2f} | {r['per_round_s']:.3f} | "
            f"{ratio.get('per_round_s', 1.0):.2f} | {r['last_round_s']:.3f} | {_peak(r, 'driver') or 0:.0f} | "
            f"{_peak(r, 'server') or '-'} | {max(peaks['worker']) if 'worker' in peaks else '-'} | {worst:.2f} | "
            f"{(r['checkpoint_bytes'] or 0) / 2**20:.1f} | {r['rows_per_round']['allocations']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--methods", nargs="+", default=["fedavg", "fedsap", "heterofl"])
    p.add_argument("--backends", nargs="+", default=["local"], choices=["local", "ray"])
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    p.add_argument("--nodes", type=int, default=0,
                   help="Ray lines on a cluster of this many nodes started on this machine (ray.cluster_utils.Cluster, "
                        "1 CPU each, as tests/runtime/test_multinode.py); 0: a single local Ray")
    p.add_argument("--table", type=Path, default=None, help="print the markdown table of a JSON-lines file and exit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", default=None, help=argparse.SUPPRESS)  # the child joins the parent's cluster
    a = p.parse_args(argv)
    if a.table is not None:
        print(markdown([json.loads(line) for line in a.table.read_text().splitlines() if line.strip()]))
        return 0
    if a.rounds < 3:
        p.error(f"--rounds={a.rounds}: needs at least 3 (round 1 is warm-up, the last is timed apart)")
    if min(a.clients) < a.per_round:
        p.error(f"--clients={min(a.clients)}: each federation needs at least --per-round={a.per_round} clients")
    if a.child:
        print(json.dumps(child(a.clients[0], a.per_round, a.rounds, a.methods[0], a.backends[0], a.address)))
        return 0
    if a.nodes < 0:
        p.error(f"--nodes={a.nodes}: must be 0 (a local Ray) or a number of nodes")
    cluster = None
    if a.nodes and "ray" in a.backends:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        for _ in range(a.nodes - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    try:
        return _parent(a, cluster.address if cluster is not None else None)
    finally:
        if cluster is not None:
            cluster.shutdown()


def _parent(a: argparse.Namespace, address: str | None) -> int:
    smallest: dict[tuple[str, str], dict[str, Any]] = {}
    for backend in a.backends:
        for method in a.methods:
            for n in sorted(a.clients):
                print(f"[scale] {backend} {method} N={n:,} ...", file=sys.stderr, flush=True)
                join = ["--address", address] if address and backend == "ray" else []
                proc = subprocess.run([sys.executable, __file__, "--child", "--clients", str(n), "--per-round",
                                       str(a.per_round), "--rounds", str(a.rounds), "--methods", method, "--backends",
                                       backend, *join], capture_output=True, text=True,
                                      env={**os.environ, "RAY_ADDRESS": ""})
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                base = smallest.setdefault((backend, method), row)
                row["ratio_vs_smallest"] = {
                    "per_round_s": round(row["per_round_s"] / base["per_round_s"], 3),
                    "last_round_s": round(row["last_round_s"] / base["last_round_s"], 3),
                    **{f"peak_{r}": round(_peak(row, r) / _peak(base, r), 3)
                       for r in row["round_peak_mib"] if _peak(base, r)}}
                line = json.dumps(row)
                print(line, flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
