#!/usr/bin/env python
"""Per-round framework overhead: the Ray and local backends against a plain-PyTorch loop.

For each number of virtual clients the same federated work is run three ways, in one
process, one after the other:

- ``reference``: a hand-written PyTorch FedAvg loop (below, :func:`run_reference`), no
  framework: per client, load the global weights, SGD over its samples for
  ``local_epochs`` with the same batch size and shuffling, then a weighted average. One
  process, clients one after another. It runs once per ``--reference-threads`` value
  (default: torch's default intra-op threads, i.e. all cores, and 1 thread), one JSON
  line each; ratios divide by the fastest of them (the best a plain single-process loop
  did on this machine in this invocation).
- ``local``: ``run_experiment`` with ``resources.backend=local`` (clients in threads,
  ``resources.torch_threads=1`` each, ``num_workers`` = each of ``--workers``).
- ``ray``: ``run_experiment`` with ``resources.backend=ray`` (one ``ClientWorker`` actor
  per worker, ``cpus_per_worker=1``, ``torch_threads=1``; the ServerActor aggregates).

The limit (issue 42): a framework line with W workers trains W clients at once, one thread each, so
the most it could do is what the plain loop does with W threads on the same cores; ``ratio_to_limit``
divides by the reference run with ``threads == W`` (``limit_threads``; the fastest reference when
that one was not run). The framework evaluates only the global model, on the last round
(``training.eval_deployed=false``: the reference evaluates nothing, and the deployed models'
evaluation is measured on its own by benchmarks/deployed_bn.py). ``--width`` scales the model
(``model.width_mult``: 0.25 is the laptop preset's ResNet10). ``backend_bytes_down``/``_up`` are
what the backend moved per timed round (``rounds.backend_bytes_*``: 0 in-process).

Compiled lines (issue 56): ``--compile off train`` runs every framework line once per mode
(``resources.compile``, the ``compile`` field), and with ``train`` the reference once more per thread count with
its model's forward through ``torch.compile`` (``compiled: true``): the plain compiled loop, the same hand-written
loop. Both compile with :func:`fedsap_ray.engine.compiled.compile_mode` of ``--device``, so on CUDA with CUDA
graphs (``reduce-overhead``). The compile happens in round 1, which is not timed, so it does not enter
``per_round_s``; ``round1_s`` (the start of the run's rounds to the end of round 1: the reference's whole first
round, the framework's start-up and first round) holds it instead. Dynamo keeps compiled graphs on the
model class's ``forward``, so in one process the first compiled line of a shape pays the compile and the later
ones find it. ``ratio_to_limit`` keeps dividing by the eager loop; ``ratio_to_compiled_limit`` divides by the
compiled loop on as many threads. ``--device cuda`` runs every line on the GPU (the Ray actors reserve
``1 / workers`` of it each).

Same model, same seeded initial weights, same synthetic data, same per-round seeds for
the batch order, FedAvg over the full model (lr 0.01, momentum 0.9, no weight decay).

Timing: ``time.perf_counter()`` at the end of every round (the framework's progress
callback; the reference loop's own round end); ``per_round_s = (t_last - t_round1) /
(rounds - 1)``, so process/Ray start-up, worker spawn and the first (warm-up) round are
excluded. Included in the framework numbers: everything a round does (plans,
dispatch, training, aggregation, the Parquet rewrite of the run's results). The
framework evaluates the global model on the last round whatever ``eval_every`` says;
the test set is ``--test-samples`` images (default 32), a few milliseconds.

Output: one JSON line per (clients, backend[, reference threads], repeat) on stdout (and in
``--out``), written once every backend of that client count and repeat has run; progress on
stderr.

Repeats: on shared cores one line's time moves by 10-30% between consecutive runs (docs/guides/performance.md),
more than the differences between systems, so ``--repeats R`` runs every line R times, repeat r in the order
rotated by r (each system in turn first and last), each repeat's ratios against that repeat's own references,
and ends with a summary per system on stderr: the median of the R per-round times, the median and range of its
R ratios to the limit, and for each framework line its ratio to local with the same workers (``ray`` /
``local``, repeat by repeat). ``repeat`` (0-based) is in every JSON line.

``ratio_vs_reference`` = per_round_s / the fastest reference's per_round_s at the same client count
and repeat, measured in the same invocation (``reference_threads`` names it;
``ratio_by_reference_threads`` gives the ratio against each). Same local training
is checked by ``train_loss_last``, which agrees across backends. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import fedsap_ray
from fedsap_ray.config import from_dict
from fedsap_ray.data.base import ClientSpec, DomainData, Federation, as_input
from fedsap_ray.models import build_model
from fedsap_ray.common.seeding import seed_for
from fedsap_ray.engine.compiled import compile_mode
from fedsap_ray.runtime.allocator import tune_malloc

BACKENDS = ("reference", "local", "ray")
COMPILE = ("off", "train")  # resources.compile values a framework line runs with (--compile)
IMAGE_MODELS = ("cnn_small", "cnn_cifar", "resnet10", "resnet18")
NUM_CLASSES = 10
INPUT_SHAPE = (3, 32, 32)
LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 0.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load1() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - platforms without getloadavg
        return None


# ----------------------------------------------------------------------------------------
# Data: seeded synthetic images, built straight into a Federation (no dataset cost)
# ----------------------------------------------------------------------------------------

def make_federation(n_clients: int, samples_per_client: int, test_samples: int, seed: int) -> Federation:
    """One domain "synthetic"; client c owns samples [c*spc, (c+1)*spc) of the pool.

    Images are uint8 noise plus a class-dependent colour offset, so the loss does move.
    """
    rng = np.random.default_rng(seed)

    def images(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, NUM_CLASSES, size=n, dtype=np.int64)
        x = rng.integers(0, 160, size=(n, *INPUT_SHAPE), dtype=np.int64)
        offset = (np.arange(NUM_CLASSES)[:, None] * np.array([9, 5, 3])[None, :]) % 96  # [classes, 3]
        x += offset[y][:, :, None, None]
        return x.astype(np.uint8), y

    n = n_clients * samples_per_client
    x, y = images(n)
    xt, yt = images(test_samples)
    clients = []
    for c in range(n_clients):
        idx = np.arange(c * samples_per_client, (c + 1) * samples_per_client, dtype=np.int64)
        clients.append(ClientSpec(client_id=c, domain="synthetic", indices=idx, pruning_ratio=0.0, capacity=1.0,
                                  tv_distance=0.0, label_counts=np.bincount(y[idx], minlength=NUM_CLASSES)))
    return Federation(dataset="synthetic_benchmark", domains=["synthetic"],
                      train={"synthetic": DomainData(torch.from_numpy(x), torch.from_numpy(y))},
                      test={"synthetic": DomainData(torch.from_numpy(xt), torch.from_numpy(yt))},
                      clients=clients, num_classes=NUM_CLASSES, input_kind="image", input_shape=INPUT_SHAPE,
                      notes="benchmarks/round_overhead.py: seeded synthetic uint8 images")


def make_config(args, n_clients: int, backend: str, workers: int, compile: str = "off"):
    return from_dict({
        "study": "round_overhead", "seed": args.seed, "preset": "custom",
        "data": {"num_clients": n_clients, "partition": "iid"},
        "capacity": {"scheme": "full"},
        "model": {"name": args.model, "width_mult": args.width},
        "training": {"rounds": args.rounds, "local_epochs": args.local_epochs, "batch_size": args.batch_size,
                     "lr": LR, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY,
                     "eval_every": 10 ** 9,  # only the last round evaluates (the framework always does)
                     "eval_deployed": False},  # the global model only (module docstring)
        "algorithm": {"name": "fedavg", "options": {"width": "full"}},
        "resources": {"backend": backend, "device": args.device, "num_workers": workers, "cpus_per_worker": 1.0,
                      "torch_threads": 1, "compile": compile,
                      # on CUDA each Ray actor reserves its share of the one GPU (without it Ray hides the GPU)
                      "gpus_per_worker": 1.0 / workers if backend == "ray" and args.device == "cuda" else 0.0},
    })


def initial_model(args):
    """The framework's initial model, built the same way (seed_for(seed, 0, -1, "model-init"))."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_for(args.seed, 0, -1, "model-init"))
        return build_model(args.model, num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE, width_mult=args.width)


# ----------------------------------------------------------------------------------------
# The plain-PyTorch reference
# ----------------------------------------------------------------------------------------

def train_client(model, params, global_state: dict, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator,
                 local_epochs: int, batch_size: int, forward=None) -> tuple[float, int]:
    """One client's local training as the reference does it: load the global weights, a fresh SGD
    (lr 0.01, momentum 0.9), ``local_epochs`` passes over a ``gen``-seeded permutation in batches of
    ``batch_size``. The trained weights stay in ``model``; returns (mean step loss, optimizer steps).
    ``forward`` computes ``model(x)`` (the model itself by default; the plain compiled loop passes its
    ``torch.compile``-d model). benchmarks/peers.py trains its Flower clients with it."""
    forward = model if forward is None else forward
    n = len(y)
    model.load_state_dict(global_state)
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    model.train()
    step_losses = []
    for _ in range(local_epochs):
        order = torch.randperm(n, generator=gen).to(x.device)
        for i in range(0, n, batch_size):
            idx = order[i:i + batch_size]
            if len(idx) < 2:  # same rule as the framework (BatchNorm needs two samples)
                continue
            opt.zero_grad()
            loss = F.cross_entropy(forward(x[idx]), y[idx])
            loss.backward()
            opt.step()
            step_losses.append(loss.item())
    return float(np.mean(step_losses)), len(step_losses)


def synchronize(device: str) -> None:
    """Wait for the GPU's queued kernels, so a round's end is its work's end (nothing to wait for on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def run_reference(args, fed: Federation, threads: int, compiled: bool = False) -> dict:
    """FedAvg written by hand; returns round-end times and the per-round train loss. ``compiled``: the model's
    forward through ``torch.compile`` (the plain compiled loop; module docstring)."""
    torch.set_num_threads(threads)
    model = initial_model(args).to(args.device)
    params = list(model.parameters())
    forward = torch.compile(model, mode=compile_mode(args.device)) if compiled else model
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pool = fed.train["synthetic"]
    x_all = as_input(pool.x).to(args.device)  # normalised once, like a hand-written loop would
    y_all = pool.y.to(args.device)
    synchronize(args.device)
    ends, losses, compute, steps = [], [], [], []
    start = time.perf_counter()
    for t in range(1, args.rounds + 1):
        acc = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_state.items() if v.is_floating_point()}
        total, loss_sum, t_clients, n_steps = 0, 0.0, 0.0, 0
        for c in fed.clients:
            tc = time.perf_counter()
            lo, hi = int(c.indices[0]), int(c.indices[-1]) + 1
            x, y = x_all[lo:hi], y_all[lo:hi]
            n = len(y)
            gen = torch.Generator().manual_seed(seed_for(args.seed, t, c.client_id, "train"))
            mean_loss, client_steps = train_client(model, params, global_state, x, y, gen, args.local_epochs, args.batch_size,
                                                   forward)
            for k, v in model.state_dict().items():
                if k in acc:
                    acc[k].add_(v.detach(), alpha=float(n))
            total += n
            n_steps += client_steps
            loss_sum += n * mean_loss
            t_clients += time.perf_counter() - tc
        for k, v in acc.items():
            global_state[k] = (v / total).to(global_state[k].dtype)
        synchronize(args.device)
        ends.append(time.perf_counter())
        losses.append(loss_sum / total)
        compute.append(t_clients)
        steps.append(n_steps)
    return {"start": start, "ends": ends, "train_loss": losses, "client_compute": compute, "steps": steps}


# ----------------------------------------------------------------------------------------
# The framework backends
# ----------------------------------------------------------------------------------------

def start_local_ray() -> None:
    """A local Ray with the same settings as fedsap-ray's own (runtime/ray.py connect), one CPU per core."""
    import ray

    from fedsap_ray.runtime.ray import SYSTEM_CONFIG

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, _system_config=SYSTEM_CONFIG)


def run_framework(args, fed: Federation, backend: str, workers: int, compile: str = "off") -> dict:
    from fedsap_ray import results
    from fedsap_ray.experiment import run_experiment

    cfg = make_config(args, len(fed.clients), backend, workers, compile)
    ends, losses = [], []
    start = time.perf_counter()

    def progress(summary) -> None:
        ends.append(time.perf_counter())
        losses.append(float(summary.train_loss))

    with tempfile.TemporaryDirectory(prefix=f"fedsap-bench-{backend}-") as out:
        outcome = run_experiment(cfg, out, run_id=f"bench-{backend}-{len(fed.clients)}", progress=progress,
                                 federation=fed)
        if outcome.status != "finished":
            raise RuntimeError(f"{backend} run ended with status {outcome.status}")
        res = results.load(out)
    clients, rounds = res.clients, res.rounds
    compute = clients.groupby("round")["wall_s"].sum().sort_index().tolist()
    # per round, the training seconds of the busiest worker (its clients' wall_s summed): beside the round's time,
    # it tells a slow worker (busiest ~ round) from an uneven share or idle gaps (busiest well under the round)
    busiest = clients.groupby(["round", "worker"])["wall_s"].sum().groupby("round").max().sort_index().tolist()
    out = {"start": start, "ends": ends, "train_loss": losses, "client_compute": compute, "busiest_worker": busiest,
           "workers_seen": int(clients["worker"].nunique())}
    if "compile" in clients:  # what the compiled-forward cache did, over the whole run (issue 56)
        out["compile_outcomes"] = {str(k): int(v) for k, v in clients["compile"].value_counts().sort_index().items()}
    if "backend_bytes_down" in rounds:  # not in a checkout before issue 42 (this file can measure one: PYTHONPATH)
        moved = rounds[rounds["round"] > 1].groupby("round")[["backend_bytes_down", "backend_bytes_up"]].first()
        out.update(bytes_down=int(moved["backend_bytes_down"].mean()), bytes_up=int(moved["backend_bytes_up"].mean()))
    return out


# ----------------------------------------------------------------------------------------

def summarise(args, backend: str, n_clients: int, run: dict, threads: int, workers: int, load_before,
              compile: str = "off") -> dict:
    ends = run["ends"]
    if len(ends) != args.rounds:
        raise RuntimeError(f"{backend}: {len(ends)} round ends recorded, expected {args.rounds}")
    timed = args.rounds - 1
    round_s = np.diff(ends)
    return {
        "backend": backend,
        "clients": n_clients,
        "samples_per_client": args.samples_per_client,
        "local_epochs": args.local_epochs,
        "batch_size": args.batch_size,
        "model": args.model,
        "width": args.width,
        "rounds": args.rounds,
        "timed_rounds": timed,
        "per_round_s": round(float((ends[-1] - ends[0]) / timed), 4),
        "round1_s": round(float(ends[0] - run["start"]), 4) if "start" in run else None,  # the compile is in it
        "round_s": [round(float(s), 4) for s in round_s],  # rounds 2..R, one entry each
        "ratio_vs_reference": None,  # filled in once the reference of this client count is known
        "client_compute_s": round(float(np.mean(run["client_compute"][1:])), 4),  # per round, summed over clients
        "busiest_worker_s": round(float(np.mean(run["busiest_worker"][1:])), 4) if "busiest_worker" in run else None,
        "train_loss_last": round(float(run["train_loss"][-1]), 5),
        "threads": threads,  # torch intra-op threads of each training thread/process
        "workers": workers,  # clients trained concurrently
        "backend_bytes_down": run.get("bytes_down"),  # per timed round (framework lines)
        "backend_bytes_up": run.get("bytes_up"),
        "device": args.device,
        # the framework's resources.compile, and for the reference whether its forward was compiled
        **({"compiled": compile != "off"} if backend == "reference" else {"compile": compile}),
        "compile_mode": compile_mode(args.device) if compile != "off" else None,  # torch.compile's mode
        "compile_outcomes": run.get("compile_outcomes"),  # clients.compile's counts (framework lines)
        "torch": torch.__version__,
        "fedsap_ray": fedsap_ray.__version__,
        "cpu_count": os.cpu_count(),
        "load1_before": load_before,
        "load1_after": load1(),
        "steps_per_client": args.local_epochs * sum(1 for i in range(0, args.samples_per_client, args.batch_size)
                                                    if min(args.batch_size, args.samples_per_client - i) >= 2),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[10, 50, 200], help="virtual client counts")
    p.add_argument("--samples-per-client", type=int, default=64)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="rounds per run (>= 2; round 1 is warm-up, not timed)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--model", default="cnn_small", choices=IMAGE_MODELS)
    p.add_argument("--width", type=float, default=1.0, help="model.width_mult (0.25: the laptop preset's ResNet10)")
    p.add_argument("--backends", default="reference,local,ray",
                   help="comma-separated subset of " + ",".join(BACKENDS))
    p.add_argument("--out", type=Path, default=None, help="also write the JSON lines to this file")
    p.add_argument("--workers", type=int, nargs="+", default=[os.cpu_count() or 1],
                   help="concurrent clients of the local and Ray backends (each with 1 torch thread), one line each")
    default_threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    p.add_argument("--reference-threads", type=int, nargs="+", default=default_threads,
                   help="torch intra-op thread counts to run the reference loop with, one JSON line each "
                        "(default: torch's default, i.e. all cores, and 1); ratios divide by the fastest")
    p.add_argument("--test-samples", type=int, default=32, help="held-out images (evaluated on the last round only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every line, interleaved with the order rotated each repeat; a median summary at the end")
    p.add_argument("--compile", nargs="+", default=["off"], choices=COMPILE,
                   help="resources.compile of the framework lines, one line each; with train the reference also runs "
                        "compiled (its forward through torch.compile), one more line per thread count")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where every line trains (cuda: the compiled lines use CUDA graphs)")
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        p.error(f"--backends: unknown {bad}; choose from {', '.join(BACKENDS)}")
    args.backends = [b for b in BACKENDS if b in backends]  # the reference first: the others divide by it
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (round 1 is not timed)")
    for name in ("samples_per_client", "local_epochs", "batch_size", "test_samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(w < 1 for w in args.workers):
        p.error("--workers: every count must be >= 1")
    args.workers = list(dict.fromkeys(args.workers))  # a count given twice is one line (per repeat)
    if not 0 < args.width <= 4:
        p.error("--width must be in (0, 4]")
    if any(t < 1 for t in args.reference_threads):
        p.error("--reference-threads: every count must be >= 1")
    args.reference_threads = list(dict.fromkeys(args.reference_threads))
    if any(c < 1 for c in args.clients):
        p.error("--clients: every count must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    args.compile = [c for c in COMPILE if c in args.compile]  # eager first: the compiled lines divide by it
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    return args


def emit(row: dict, sink) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if sink:
        sink.write(line + "\n")
        sink.flush()


def run_line(args, fed: Federation, n: int, backend: str, count: int, rep: int, compile: str = "off") -> dict:
    """One measurement: the reference on ``count`` threads, or a framework backend with ``count`` workers;
    ``compile``: the framework's resources.compile, or for the reference ``train`` = its forward compiled."""
    before = load1()
    t0 = time.perf_counter()
    if backend == "reference":
        threads, workers = count, 1
        run = run_reference(args, fed, threads, compiled=compile != "off")
    else:
        threads, workers = 1, min(count, n)
        run = run_framework(args, fed, backend, workers, compile)
    row = summarise(args, backend, n, run, threads, workers, before, compile)
    row["repeat"] = rep
    log(f"  clients {n:4d}  {backend:9s} {'compiled' if compile != 'off' else 'eager':8s} threads {threads} "
        f"workers {workers}  "
        f"{row['per_round_s']:8.3f} s/round  loss {row['train_loss_last']:.4f}  "
        f"(total {time.perf_counter() - t0:.1f}s, load {before} -> {row['load1_after']})"
        + (f"  [repeat {rep + 1}/{args.repeats}]" if args.repeats > 1 else ""))
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each line's ratios against the references of the same repeat (module docstring): the eager loop's, and
    the compiled loop's where it ran."""
    refs = {r["threads"]: r["per_round_s"] for r in rows if r["backend"] == "reference" and not r.get("compiled")}
    compiled = {r["threads"]: r["per_round_s"] for r in rows if r["backend"] == "reference" and r.get("compiled")}
    for row in rows if compiled else ():
        at = row["workers"] if row["backend"] != "reference" else row["threads"]
        row["compiled_limit_threads"] = at if at in compiled else min(compiled, key=compiled.__getitem__)
        row["ratio_to_compiled_limit"] = round(row["per_round_s"] / compiled[row["compiled_limit_threads"]], 3)
    if not refs:
        return
    best = min(refs.values())
    for row in rows:
        row["ratio_vs_reference"] = round(row["per_round_s"] / best, 3)
        row["reference_threads"] = min(refs, key=refs.get)  # the reference the ratio divides by
        row["ratio_by_reference_threads"] = {str(t): round(row["per_round_s"] / s, 3) for t, s in refs.items()}
        at = row["workers"] if row["backend"] != "reference" else row["threads"]
        row["limit_threads"] = at if at in refs else row["reference_threads"]
        row["ratio_to_limit"] = round(row["per_round_s"] / refs[row["limit_threads"]], 3)


Job = tuple[str, int, str]  # (backend, reference threads or workers, compile)


def log_summary(lines: list[tuple[Job, dict]], jobs: list[Job], n: int) -> None:
    """Medians over the repeats, with each ratio's range (min-max): what a reader compares systems by.
    ``lines``: (job, row) per measurement."""
    log(f"  clients {n}: medians of {len(lines) // len(jobs)} repeats (range)")
    for job in jobs:
        mine = [r for j, r in lines if j == job]
        line = (f"    {job[0]:9s} {'compiled' if job[2] != 'off' else 'eager':8s} "
                f"{'threads' if job[0] == 'reference' else 'workers'} {job[1]}  "
                f"{statistics.median(r['per_round_s'] for r in mine):8.3f} s/round")
        for key, label in (("ratio_to_limit", "limit"), ("ratio_to_compiled_limit", "compiled limit")):
            ratios = [r[key] for r in mine if key in r]
            if ratios:
                line += f"  {label} x{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        if job[0] not in ("reference", "local") and ("local", job[1], job[2]) in jobs:
            local = {r["repeat"]: r["per_round_s"] for j, r in lines if j == ("local", job[1], job[2])}
            vs = [r["per_round_s"] / local[r["repeat"]] for r in mine]
            line += f"  local x{statistics.median(vs):.3f} ({min(vs):.3f}-{max(vs):.3f})"
        log(line)


def main(argv=None) -> int:
    args = parse_args(argv)
    sink = args.out.open("w") if args.out else None
    # the local backend tunes the C allocator of the process it runs in (fedsap_ray.runtime.allocator), which is
    # this one: tune it before anything runs, so the reference loop runs with the same allocator whatever the
    # order (FEDSAP_RAY_MALLOC=default: glibc's defaults for every system, the Ray workers included)
    malloc = tune_malloc()
    if "ray" in args.backends:
        start_local_ray()
    log(f"round_overhead: malloc {'tuned' if malloc else 'glibc defaults'}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load {load1()}, "
        f"backends {','.join(args.backends)}, clients {args.clients}, rounds {args.rounds}, "
        f"reference threads {args.reference_threads}, compile {args.compile}, device {args.device}")
    try:
        for n in args.clients:
            fed = make_federation(n, args.samples_per_client, args.test_samples, args.seed)
            jobs: list[Job] = []
            if "reference" in args.backends:
                jobs += [("reference", t, c) for c in args.compile for t in args.reference_threads]
            jobs += [(b, w, c) for w in args.workers for c in args.compile for b in args.backends if b != "reference"]
            every: list[tuple[Job, dict]] = []
            for rep in range(args.repeats):
                order = jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]  # rotated: no system always first or last
                done = {(b, k, c): run_line(args, fed, n, b, k, rep, c) for b, k, c in order}
                rows = [done[job] for job in jobs]  # the lines in their usual order, whatever ran first
                add_ratios(rows)
                for row in rows:
                    emit(row, sink)
                if any(r["backend"] == "reference" for r in rows):
                    log("  ratios to the limit (the plain eager loop on as many threads as workers): " + ", ".join(
                        f"{r['backend']}{'+compiled' if r.get('compiled') or r.get('compile', 'off') != 'off' else ''}"
                        f"({r['threads']}t x {r['workers']}w) {r.get('ratio_to_limit')}" for r in rows))
                every += [(job, done[job]) for job in jobs]
            if args.repeats > 1:
                log_summary(every, jobs, n)
    finally:
        if sink:
            sink.close()
        if "ray" in args.backends:
            import ray

            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
