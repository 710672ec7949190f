#!/usr/bin/env python
"""Peer benchmark: the same federated work in our backends, a plain PyTorch loop, Flower and pfl-research.

Issue 27. One invocation runs, for each configuration (``CLIENTSxSAMPLES``, all clients every round)
and each repeat, every system once, in an order that rotates from repeat to repeat:

- ``local``: ``run_experiment`` with ``resources.backend=local`` (benchmarks/round_overhead.py
  :func:`run_framework`; CPU-count clients at a time in threads, 1 torch thread each);
- ``ray``: the same with ``resources.backend=ray`` (one ClientWorker actor per CPU);
- ``reference``: the plain PyTorch FedAvg loop of round_overhead.py (:func:`run_reference`), one
  process, clients one after another, torch's default intra-op threads;
- ``flower``: Flower's Ray simulation (``flwr.simulation.start_simulation``), a ``NumPyClient``
  per virtual client training with round_overhead's :func:`train_client`, one actor per CPU
  (``client_resources={"num_cpus": 1}``, 1 torch thread each), ``FedAvg`` with every client every
  round and no evaluation;
- ``pfl``: pfl-research's ``FederatedAveraging`` on a ``SimulatedBackend``, its own PyTorch
  training loop (``PyTorchModel``, local SGD with momentum, central SGD lr 1 = plain averaging),
  one process;
- ``pfl-2p``: the same under ``torchrun --standalone --nproc_per_node 2`` (pfl's distributed
  simulation: each process trains half the cohort with 1 torch thread, the updates are
  all-reduced over gloo).

The work is that of round_overhead.py: the ``cnn_small`` network (60,362 parameters; Flower and
pfl run :class:`PlainCNNSmall`, the same layers as a bare ``nn.Module``), or with ``--model resnet10
--width W`` the papers' ResNet10 (Flower trains the framework's module; pfl is skipped), the same seeded initial
weights and synthetic images (:func:`make_federation`), 1 local epoch, batch 32, SGD lr 0.01
momentum 0.9, the same per-round batch order (``seed_for(seed, round, client, "train")``), no
evaluation in the timed rounds (ours evaluate 32 test images on the last round, a few ms).
``train_loss_last`` and ``steps_per_round`` show that the systems did the same work.

Each measurement runs in its own subprocess (``--worker``), so imports, Ray start-up and a crash
stay inside it. Flower and pfl run under ``--peer-python`` (default: this interpreter), because
``flwr[simulation]`` pins its own Ray and protobuf (benchmarks/README.md, `peers.py`). A system
whose package is missing is skipped: one JSON line with ``skipped`` (the reason).

Timing: ``per_round_s = (t_end(last round) - t_end(round 1)) / (rounds - 1)`` with
``time.perf_counter()`` at each round end, taken inside the subprocess (the system's own round-end
hook), so start-up and round 1 are excluded. ``ratio_vs_local`` divides by the ``local``
measurement of the same configuration and repeat. One JSON line per measurement on stdout (and in
``--out``), written when its configuration and repeat are done; progress on stderr.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import round_overhead as ro  # noqa: E402  (beside this file; imports fedsap_ray)

from fedsap_ray.data.base import as_input  # noqa: E402
from fedsap_ray.common.seeding import seed_for  # noqa: E402
from fedsap_ray.runtime.allocator import tune_malloc  # noqa: E402

SYSTEMS = ("local", "ray", "reference", "flower", "pfl", "pfl-2p")
PEERS = ("flower", "pfl", "pfl-2p")  # run by --peer-python
DEFAULT_CONFIGS = ("200x16", "50x64")
CNN_SMALL_PARAMS = 60_362
TEST_SAMPLES = 32
INSTALL_HINT = "pip install -e '.[bench]' into a peer venv passed as --peer-python (benchmarks/README.md, `peers.py`)"
# what each system needs importable in its interpreter, with the distribution whose version is recorded
NEEDS = {"local": ["torch"], "ray": ["ray"], "reference": ["torch"],
         "flower": ["flwr", "ray"], "pfl": ["pfl"], "pfl-2p": ["pfl"]}
DISTRIBUTION = {"local": "torch", "ray": "ray", "reference": "torch", "flower": "flwr", "pfl": "pfl", "pfl-2p": "pfl"}


def log(msg: str) -> None:
    ro.log(msg)


class PlainCNNSmall(nn.Module):
    """``cnn_small`` as a bare module: conv3x3(3->32)-ReLU-pool2, conv3x3(32->64)-ReLU-pool2,
    linear(4096->10); the parameter names (conv1, conv2, fc) are those of fedsap_ray's CNNSmall."""

    def __init__(self, num_classes: int = ro.NUM_CLASSES, input_shape: tuple[int, int, int] = ro.INPUT_SHAPE) -> None:
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * (h // 4) * (w // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def plain_initial_model(args, cls=PlainCNNSmall) -> nn.Module:
    """The framework's seeded initial weights: ``cnn_small``'s in a :class:`PlainCNNSmall` (or subclass); any other
    model (``--model resnet10``) is the framework's own module, which is a plain ``nn.Module`` to a peer."""
    if args.model != "cnn_small":
        return ro.initial_model(args)
    model = cls()
    model.load_state_dict(ro.initial_model(args).state_dict())  # strict: the same names and shapes
    n = sum(p.numel() for p in model.parameters())
    if n != CNN_SMALL_PARAMS:
        raise RuntimeError(f"PlainCNNSmall has {n} parameters, cnn_small {CNN_SMALL_PARAMS}")
    return model


def client_data(n_clients: int, samples_per_client: int, seed: int):
    """(normalised images, labels, ClientSpecs) of round_overhead's synthetic federation."""
    fed = ro.make_federation(n_clients, samples_per_client, TEST_SAMPLES, seed)
    pool = fed.train["synthetic"]
    return as_input(pool.x), pool.y, fed.clients


def client_slice(x_all, y_all, spec):
    lo, hi = int(spec.indices[0]), int(spec.indices[-1]) + 1
    return x_all[lo:hi], y_all[lo:hi]


def worker_args(ns) -> argparse.Namespace:
    """The namespace round_overhead's functions read, for one configuration."""
    return argparse.Namespace(seed=ns.seed, model=ns.model, width=ns.width, rounds=ns.rounds, local_epochs=ns.local_epochs,
                              batch_size=ns.batch_size, samples_per_client=ns.samples, test_samples=TEST_SAMPLES)


# ----------------------------------------------------------------------------------------
# Flower: a NumPyClient per virtual client; the data are built once per Ray actor
# ----------------------------------------------------------------------------------------

_ACTOR_CACHE: dict = {}


def _flower_state(cfg: dict):
    key = (int(cfg["clients"]), int(cfg["samples"]), int(cfg["seed"]))
    if _ACTOR_CACHE.get("key") != key:
        torch.set_num_threads(1)  # like our actors (resources.torch_threads=1)
        _ACTOR_CACHE.clear()
        shape = argparse.Namespace(model=str(cfg["model"]), width=float(cfg["width"]), seed=int(cfg["seed"]))
        _ACTOR_CACHE.update(key=key, data=client_data(*key), model=plain_initial_model(shape))
    return _ACTOR_CACHE


def flower_client_fn(context):
    from flwr.client import NumPyClient

    partition = int(context.node_config["partition-id"])

    class BenchClient(NumPyClient):
        def fit(self, parameters, config):
            state = _flower_state(config)
            model = state["model"]
            x_all, y_all, specs = state["data"]
            spec = specs[partition]
            x, y = client_slice(x_all, y_all, spec)
            names = list(model.state_dict())
            global_state = {k: torch.from_numpy(v) for k, v in zip(names, parameters)}
            gen = torch.Generator().manual_seed(seed_for(int(config["seed"]), int(config["round"]), spec.client_id, "train"))
            loss, steps = ro.train_client(model, list(model.parameters()), global_state, x, y, gen,
                                          int(config["epochs"]), int(config["batch_size"]))
            weights = [v.detach().numpy().copy() for v in model.state_dict().values()]
            return weights, len(y), {"loss": loss, "steps": steps}

    return BenchClient().to_client()


def run_flower(ns) -> dict:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    import flwr
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import start_simulation

    args = worker_args(ns)
    init = [v.detach().numpy().copy() for v in plain_initial_model(args).state_dict().values()]
    ends, losses, steps = [], [], []
    fit_config = {"clients": ns.clients, "samples": ns.samples, "seed": ns.seed, "epochs": ns.local_epochs,
                  "batch_size": ns.batch_size, "model": ns.model, "width": ns.width}

    class TimedFedAvg(FedAvg):
        def aggregate_fit(self, server_round, results, failures):
            if failures:
                raise RuntimeError(f"flower: {len(failures)} clients failed in round {server_round}: {failures[:1]}")
            out = super().aggregate_fit(server_round, results, failures)
            total = sum(r.num_examples for _, r in results)
            losses.append(sum(r.num_examples * float(r.metrics["loss"]) for _, r in results) / total)
            steps.append(sum(int(r.metrics["steps"]) for _, r in results))
            ends.append(time.perf_counter())
            return out

    n = ns.clients
    strategy = TimedFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_evaluate_clients=0,
                           min_available_clients=n, accept_failures=False,
                           initial_parameters=ndarrays_to_parameters(init),
                           on_fit_config_fn=lambda rnd: {**fit_config, "round": rnd})
    workers = os.cpu_count() or 1
    start_simulation(client_fn=flower_client_fn, num_clients=n, config=ServerConfig(num_rounds=ns.rounds),
                     strategy=strategy, client_resources={"num_cpus": 1, "num_gpus": 0.0},
                     ray_init_args={"address": "local", "num_cpus": workers, "include_dashboard": False,
                                    "ignore_reinit_error": True, "log_to_driver": False,
                                    "_node_ip_address": "127.0.0.1"})
    return {"ends": ends, "train_loss": losses, "steps": steps, "threads": 1, "workers": min(workers, n),
            "processes": 1, "version": flwr.__version__ if hasattr(flwr, "__version__") else dist_version("flwr")}


# ----------------------------------------------------------------------------------------
# pfl-research: FederatedAveraging on a SimulatedBackend, 1 process or torchrun
# ----------------------------------------------------------------------------------------

class PflCNNSmall(PlainCNNSmall):
    """pfl's PyTorchModel needs ``loss`` and ``metrics`` on the module; ``loss`` also tallies the
    step losses (pfl reports none without evaluation) for the same-work check."""

    def __init__(self) -> None:
        super().__init__()
        self.tally = [0.0, 0]  # sum of step losses, steps

    def loss(self, x, y, eval=False):
        self.train()
        loss = F.cross_entropy(self(x), y)
        self.tally[0] += loss.item()  # the reference also reads every step's loss
        self.tally[1] += 1
        return loss

    @torch.no_grad()
    def metrics(self, x, y, eval=False):
        from pfl.metrics import Weighted

        self.eval()
        return {"loss": Weighted(float(F.cross_entropy(self(x), y, reduction="sum")), len(y))}


def run_pfl(ns) -> dict:
    os.environ.setdefault("PFL_PYTORCH_DEVICE", "cpu")
    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops import pytorch_ops
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    world = pytorch_ops.distributed.world_size if pytorch_ops.distributed else 1
    args = worker_args(ns)
    module = plain_initial_model(args, PflCNNSmall)
    x_all, y_all, specs = client_data(ns.clients, ns.samples, ns.seed)
    current = {"round": 1}

    def make_dataset(user_id):
        # the reference's batch order: the round's seeded permutation, batches taken in order
        spec = specs[int(user_id)]
        x, y = client_slice(x_all, y_all, spec)
        gen = torch.Generator().manual_seed(seed_for(ns.seed, current["round"], spec.client_id, "train"))
        order = torch.randperm(len(y), generator=gen)
        return Dataset(raw_data=(x[order], y[order]), user_id=str(user_id))

    ends, losses, steps = [], [], []

    class Clock(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            tally = torch.tensor(module.tally, dtype=torch.float64)
            if world > 1:
                torch.distributed.all_reduce(tally)
            module.tally[:] = [0.0, 0]
            losses.append(float(tally[0] / max(tally[1], 1)))
            steps.append(int(tally[1]))
            current["round"] += 1
            ends.append(time.perf_counter())
            return False, Metrics()

    data = FederatedDataset(make_dataset, get_user_sampler("minimize_reuse", list(range(ns.clients))))
    model = PyTorchModel(model=module,
                         local_optimizer_create=functools.partial(torch.optim.SGD, momentum=ro.MOMENTUM,
                                                                  weight_decay=ro.WEIGHT_DECAY),
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    # evaluation_frequency larger than the rounds: pfl evaluates only in round 1 (not timed)
    algorithm_params = NNAlgorithmParams(central_num_iterations=ns.rounds, evaluation_frequency=10 ** 9,
                                         train_cohort_size=ns.clients, val_cohort_size=0)
    train_params = NNTrainHyperParams(local_num_epochs=1, local_learning_rate=ro.LR, local_batch_size=ns.batch_size)
    FederatedAveraging().run(algorithm_params=algorithm_params, backend=SimulatedBackend(training_data=data, val_data=data),
                             model=model, model_train_params=train_params,
                             model_eval_params=NNEvalHyperParams(local_batch_size=ns.batch_size),
                             callbacks=[Clock()], send_metrics_to_platform=False)
    return {"ends": ends, "train_loss": losses, "steps": steps, "threads": torch.get_num_threads(),
            "workers": world, "processes": world, "version": getattr(pfl, "__version__", None) or dist_version("pfl")}


# ----------------------------------------------------------------------------------------
# our backends and the plain loop (round_overhead.py)
# ----------------------------------------------------------------------------------------

def run_ours(ns) -> dict:
    args = worker_args(ns)
    fed = ro.make_federation(ns.clients, ns.samples, TEST_SAMPLES, ns.seed)
    if ns.worker == "reference":
        threads = torch.get_num_threads()  # --threads, else torch's default
        run = ro.run_reference(args, fed, threads)
        return {**run, "threads": threads, "workers": 1, "processes": 1, "version": torch.__version__}
    workers = min(os.cpu_count() or 1, ns.clients)
    if ns.worker == "ray":
        ro.start_local_ray()
    run = ro.run_framework(args, fed, ns.worker, workers)
    per_client = sum(1 for i in range(0, ns.samples, ns.batch_size) if min(ns.batch_size, ns.samples - i) >= 2)
    run["steps"] = [ns.local_epochs * per_client * ns.clients] * len(run["ends"])  # the framework's rule, not counted
    version = torch.__version__
    if ns.worker == "ray":
        import ray

        version = ray.__version__
        ray.shutdown()
    return {**run, "threads": 1, "workers": workers, "processes": 1, "version": version}


def worker_main(ns) -> int:
    if ns.worker == "reference":
        tune_malloc()  # the limit at its best: the allocator our backends run with (fedsap_ray.runtime.allocator)
    if ns.threads and ns.worker in ("reference", "pfl"):
        torch.set_num_threads(ns.threads)
    runner = {"flower": run_flower, "pfl": run_pfl, "pfl-2p": run_pfl}.get(ns.worker, run_ours)
    run = runner(ns)
    if int(os.environ.get("RANK", "0")) == 0:  # torchrun: rank 0 reports
        keep = ("ends", "train_loss", "steps", "threads", "workers", "processes", "version")
        Path(ns.result).write_text(json.dumps({k: run.get(k) for k in keep}))
    return 0


# ----------------------------------------------------------------------------------------
# the driver: probe, interleave, summarise
# ----------------------------------------------------------------------------------------

def dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


PROBE = ("import importlib.util, json, sys; from importlib.metadata import version\n"
         "mods = sys.argv[1:]\n"
         "missing = [m for m in mods if importlib.util.find_spec(m) is None]\n"
         "print(json.dumps({'missing': missing, 'versions': {m: version(m) for m in mods if m not in missing}}))")


def probe(python: str, modules: list[str]) -> tuple[str | None, dict]:
    """(None, versions) when ``python`` can import every module, else (the reason, {})."""
    try:
        out = subprocess.run([python, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120, check=True)
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        return f"{python} cannot be probed: {err}", {}
    if info["missing"]:
        what = " and ".join(info["missing"])
        return f"{what} {'is' if len(info['missing']) == 1 else 'are'} not installed for {python}: {INSTALL_HINT}", {}
    return None, info["versions"]


def parse_config(text: str) -> tuple[int, int]:
    try:
        clients, samples = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a configuration is CLIENTSxSAMPLES, e.g. 200x16") from None
    if clients < 1 or samples < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: needs >= 1 client and >= 2 samples per client")
    return clients, samples


def worker_command(system: str, python: str, ns, clients: int, samples: int, result: str) -> list[str]:
    tail = [str(Path(__file__).resolve()), "--worker", system, "--clients", str(clients), "--samples", str(samples),
            "--rounds", str(ns.rounds), "--batch-size", str(ns.batch_size), "--seed", str(ns.seed), "--result", result,
            "--model", ns.model, "--width", str(ns.width), "--local-epochs", str(ns.local_epochs)]
    if ns.threads:
        tail += ["--threads", str(ns.threads)]
    if system == "pfl-2p":
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *tail]
    return [python, *tail]


def measure(system: str, python: str, ns, clients: int, samples: int) -> dict:
    """Run one measurement in a subprocess; the raw run, or {"failed": why}."""
    env = dict(os.environ)
    # the Ray actors of Flower import flower_client_fn from this file by module name
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("RAY_ADDRESS", None)  # never join a running cluster (a study's)
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix=f"peers-{system}-") as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = worker_command(system, python, ns, clients, samples, result)
        logfile = os.path.join(tmp, "worker.log")
        t0 = time.perf_counter()
        with open(logfile, "w") as out:
            try:
                proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                      timeout=ns.timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = time.perf_counter() - t0
        tail = Path(logfile).read_text(errors="replace").splitlines()[-25:]
        if ns.verbose or rc != 0:
            log(f"    [{system} worker output, last lines]\n      " + "\n      ".join(tail))
        if rc != 0 or not os.path.exists(result):
            return {"failed": f"exit {rc}: " + " | ".join(line.strip() for line in tail[-3:]), "command": shlex.join(cmd)}
        run = json.loads(Path(result).read_text())
    run.update(t_spawn=t0, wall_s=wall, command=shlex.join(cmd))
    return run


def make_row(system: str, ns, clients: int, samples: int, repeat: int, position: int, run: dict,
             load_before, load_after, python: str) -> dict:
    base = {"system": system, "config": f"{clients}x{samples}", "clients": clients, "samples_per_client": samples,
            "repeat": repeat, "position": position, "rounds": ns.rounds, "load1_before": load_before,
            "load1_after": load_after}
    if "failed" in run:
        return {**base, "failed": run["failed"], "command": run["command"]}
    ends = run["ends"]
    if len(ends) != ns.rounds:
        return {**base, "failed": f"{len(ends)} round ends recorded, expected {ns.rounds}", "command": run["command"]}
    timed = ns.rounds - 1
    return {
        **base,
        "timed_rounds": timed,
        "per_round_s": round((ends[-1] - ends[0]) / timed, 4),
        "round_s": [round(b - a, 4) for a, b in zip(ends, ends[1:])],  # rounds 2..R
        "ratio_vs_local": None,  # filled in once the local measurement of this config and repeat is known
        "startup_s": round(ends[0] - run["t_spawn"], 3),  # subprocess spawn to the end of round 1
        "wall_s": round(run["wall_s"], 3),
        "train_loss_last": round(float(run["train_loss"][-1]), 5),
        "steps_per_round": run["steps"][-1] if run.get("steps") else None,
        "threads": run["threads"], "workers": run["workers"], "processes": run["processes"],
        "version": run["version"],
        "model": ns.model, "width": ns.width, "params": model_params(ns), "local_epochs": ns.local_epochs,
        "batch_size": ns.batch_size,
        "lr": ro.LR, "momentum": ro.MOMENTUM, "seed": ns.seed,
        "python": python, "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "command": run["command"],
    }


def model_params(ns) -> int:
    """Parameters of the benchmarked model (``cnn_small``: 60,362; ResNet10 at width 1.0: 4,903,242)."""
    return sum(p.numel() for p in ro.initial_model(worker_args(ns)).parameters())


def emit(row: dict, sink) -> None:
    ro.emit(row, sink)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", type=parse_config, nargs="+", default=None, metavar="CLIENTSxSAMPLES",
                   help="federations to run, all clients every round (default: 200x16 50x64)")
    p.add_argument("--rounds", type=int, default=6, help="rounds per measurement (>= 2; round 1 is not timed)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per system and configuration, interleaved")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--peer-python", default=sys.executable,
                   help="interpreter that runs flower, pfl and pfl-2p (a venv with the bench extra)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON lines to this file")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--model", default="cnn_small", choices=("cnn_small", "resnet10"),
                   help="the network every system trains (resnet10: the papers'; pfl runs cnn_small only)")
    p.add_argument("--width", type=float, default=1.0, help="model.width_mult (0.25: the laptop preset's ResNet10)")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads of the one-process systems (reference, pfl); 0: torch's default "
                        "(all cores). The others run 1 thread per client worker")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a measurement is killed")
    p.add_argument("--verbose", action="store_true", help="print the tail of every worker's output")
    # internal: one measurement in this process
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--clients", type=int, help=argparse.SUPPRESS)
    p.add_argument("--samples", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    systems = [s.strip() for s in ns.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        p.error(f"--systems: unknown {bad}; choose from {', '.join(SYSTEMS)}")
    ns.systems = [s for s in SYSTEMS if s in systems]
    ns.configs = ns.configs or [parse_config(c) for c in DEFAULT_CONFIGS]
    if ns.rounds < 2:
        p.error("--rounds must be >= 2 (round 1 is not timed)")
    if ns.repeats < 1 or ns.batch_size < 1 or ns.threads < 0 or ns.local_epochs < 1:
        p.error("--repeats, --batch-size and --local-epochs must be >= 1, --threads >= 0")
    if not 0 < ns.width <= 4:
        p.error(f"--width must be in (0, 4], got {ns.width}")
    return ns


def summary(rows: list[dict]) -> None:
    done = [r for r in rows if "per_round_s" in r]
    for config in dict.fromkeys(r["config"] for r in done):
        log(f"summary {config}: median per-round s (median ratio vs local), loss, steps/round")
        for system in SYSTEMS:
            mine = [r for r in done if r["config"] == config and r["system"] == system]
            if not mine:
                continue
            ratios = [r["ratio_vs_local"] for r in mine if r["ratio_vs_local"] is not None]
            ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
            log(f"  {system:9s} {statistics.median(r['per_round_s'] for r in mine):8.3f} s ({ratio})  "
                f"loss {mine[-1]['train_loss_last']:.4f}  steps {mine[-1]['steps_per_round']}  "
                f"n={len(mine)}  {mine[-1]['version']}")


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.worker:
        return worker_main(ns)
    pythons = {s: (ns.peer_python if s in PEERS else sys.executable) for s in ns.systems}
    sink = ns.out.open("w") if ns.out else None
    rows: list[dict] = []
    try:
        runnable = []
        for system in ns.systems:
            reason, versions = probe(pythons[system], NEEDS[system])
            if reason is None and system == "pfl-2p" and (os.cpu_count() or 1) < 2:
                reason = "pfl-2p needs 2 CPUs"
            if reason is None and system in ("pfl", "pfl-2p") and ns.model != "cnn_small":
                reason = f"pfl runs cnn_small only here (its model wrapper PflCNNSmall), not {ns.model}"
            if reason:
                log(f"peers: skipping {system}: {reason}")
                emit({"system": system, "skipped": reason}, sink)
            else:
                runnable.append(system)
                log(f"peers: {system:9s} {DISTRIBUTION[system]} {versions.get(DISTRIBUTION[system])} ({pythons[system]})")
        log(f"peers: {ns.model} width {ns.width}, {ns.local_epochs} local epoch(s), "
            f"configs {[f'{c}x{s}' for c, s in ns.configs]}, rounds {ns.rounds}, repeats {ns.repeats}, "
            f"{os.cpu_count()} CPUs, load {ro.load1()}")
        for repeat in range(ns.repeats):
            for ci, (clients, samples) in enumerate(ns.configs):
                shift = (repeat + ci) % max(len(runnable), 1)
                order = runnable[shift:] + runnable[:shift]
                block = []
                for position, system in enumerate(order):
                    before = ro.load1()
                    run = measure(system, pythons[system], ns, clients, samples)
                    row = make_row(system, ns, clients, samples, repeat, position, run, before, ro.load1(), pythons[system])
                    block.append(row)
                    if "failed" in row:
                        log(f"  {clients}x{samples} r{repeat} {system:9s} FAILED: {row['failed']}")
                    else:
                        log(f"  {clients}x{samples} r{repeat} {system:9s} {row['per_round_s']:8.3f} s/round  "
                            f"loss {row['train_loss_last']:.4f}  steps/round {row['steps_per_round']}  "
                            f"start-up {row['startup_s']:.1f}s  load {before} -> {row['load1_after']}")
                local = next((r["per_round_s"] for r in block if r["system"] == "local" and "per_round_s" in r), None)
                for row in block:
                    if local and "per_round_s" in row:
                        row["ratio_vs_local"] = round(row["per_round_s"] / local, 3)
                    emit(row, sink)
                rows.extend(block)
        summary(rows)
    finally:
        if sink:
            sink.close()
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:  # run the worker from the module "peers", so Ray actors can import what it sends
        import peers

        sys.exit(peers.main())
    sys.exit(main())
