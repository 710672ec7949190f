"""What a round's evaluation costs against its training, and what the inference settings save (issue 42).

Trains a strategy in-process on a preset for a few rounds (the default job's: FedSAP on ``laptop``),
timing each round's training call, then times the round's evaluation as the server runs it: the
server's models (``evaluate_modes``, every round) and the deployed models (``evaluate_deployed``
with each client's own BN statistics, every ``training.deployed_every``-th round), once with the
inference settings of :mod:`fedsap_ray.engine.evaluate` (batches of ``INFER_BATCH``, BN folded into the
convolutions, channels-last: ``inference_module``) and once as before issue 42 (batches of 1024, the model
as it is, contiguous), interleaved ``--repeats`` times so both see the
same load. Prints per setting the median seconds, the figures (which must agree to float rounding),
and the default job's projected round / training ratio:
(rounds x train + rounds x server-model eval + rounds / deployed_every x deployed eval) / (rounds x train).

What bounds that ratio (issue 42): each part is also timed in CPU seconds (``time.process_time``, every
thread of this process), so the output says how many cores the evaluation kept busy and what the ratio
would be if its CPU seconds were spread perfectly over all cores (``floor``: no schedule of the same
arithmetic on these cores does better, short of running it during training, which keeps the cores busy
already). The arithmetic rates, one thread each, in GFLOP/s from :class:`torch.utils.flop_counter.FlopCounterMode`
(a multiply-add counts 2): the evaluation's forward pass (the server's model on one test domain, as
``evaluate`` runs it) and a plain training step of the same model (batch ``training.batch_size``, SGD), the
arithmetic local training is made of. Evaluation at or above training's rate has no framework cost left
to remove: its time is its arithmetic.

    python benchmarks/eval_speed.py                                   # FedSAP, laptop, 2 rounds, 3 repeats
    python benchmarks/eval_speed.py --algorithm heterofl --repeats 5
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from fedsap_ray import algorithms
from fedsap_ray.engine import evaluate as ev
from fedsap_ray.algorithms import Strategy
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.experiment import build_context
from fedsap_ray.runtime.local import LocalBackend
from fedsap_ray.engine.server import deployed_sample
from fedsap_ray.run.session import _scratch


@contextmanager
def before_issue_42() -> Iterator[None]:
    """Evaluation as it ran before: batches of 1024, the model as it is (no BN folded), every tensor contiguous."""
    batch, module = ev.INFER_BATCH, ev.inference_module

    def as_it_is(model: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, torch.memory_format]:
        model.to(device).to(memory_format=torch.contiguous_format)
        return model, torch.contiguous_format

    ev.INFER_BATCH, ev.inference_module = 1024, as_it_is  # type: ignore[assignment]
    try:
        yield
    finally:
        ev.INFER_BATCH, ev.inference_module = batch, module  # type: ignore[assignment]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def cpu_timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of every thread of this process, result) of ``fn()``."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def gflops(model: torch.nn.Module, x: torch.Tensor) -> float:
    """GFLOP of one forward pass of ``model`` on ``x`` (FlopCounterMode: a multiply-add counts 2)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    return counter.get_total_flops() / 1e9


def arithmetic_rates(ctx, fed, state_params, batch_size: int, cpu: torch.device) -> tuple[float, float]:
    """(evaluation GFLOP/s, training GFLOP/s), one thread each: the server's model evaluated on the first test
    domain as ``evaluate`` runs it (best of 3), and plain SGD steps of the same model at ``batch_size`` (best of 3
    means of 10 steps; a step's arithmetic counted as 3 forward passes: forward, and backward's two products)."""
    model = copy.deepcopy(ctx.model)
    domain = next(iter(fed.test.values()))
    per_image = gflops(model.eval(), ev._batch(domain.x[:8], cpu, torch.contiguous_format)) / 8
    evals = [timed(lambda: ev.evaluate(model, ctx.layout, state_params, domain, cpu))[0] for _ in range(3)]
    data = fed.client_data(fed.clients[0].client_id)
    x = ev._batch(data.x[:batch_size], cpu, torch.contiguous_format)
    y = data.y[:batch_size]
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def steps(k: int) -> None:
        for _ in range(k):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    steps(2)  # warm-up: oneDNN's primitives for these shapes
    step = min(timed(lambda: steps(10))[0] / 10 for _ in range(3))
    return per_image * len(domain) / min(evals), 3 * per_image * len(x) / step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algorithm", default="fedsap")
    ap.add_argument("--preset", default="laptop")
    ap.add_argument("--rounds", type=int, default=2, help="rounds trained before the evaluation is timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = build_config(preset=args.preset, overrides=[f"algorithm.name={args.algorithm}", f"seed={args.seed}"])
    torch.set_num_threads(cfg.resources.torch_threads)
    fed = build_federation(cfg)
    ctx = build_context(cfg, fed)
    strat: Strategy = algorithms.get(cfg.algorithm.name)(ctx, cfg.algorithm.opts)
    backend = LocalBackend("cpu", torch_threads=cfg.resources.torch_threads)
    backend.start(ctx)
    state, train_s = strat.init_state(), []
    try:
        for t in range(1, args.rounds + 1):
            plans = strat.configure_round(state, t)
            secs, results = timed(lambda plans=plans: backend.train(plans))
            train_s.append(secs)
            state = strat.aggregate(state, plans, results, t).state  # type: ignore[arg-type]
    finally:
        backend.close()
    scratch, cpu = _scratch(ctx), torch.device("cpu")
    clients, _ = deployed_sample(ctx)
    domains = fed.eval_domains()  # evaluation-only ground truth, as the server reads it
    models = [ev.DeployedModel(c, fed.clients[c].domain, *strat.deployed_model(state, c)) for c in clients]
    bn = {c: fed.client_data(c) for c in clients}
    sets = strat.eval_sets(state, domains)

    def server() -> object:
        return ev.evaluate_modes(scratch, ctx.layout, sets, fed.test, cpu)

    def deployed() -> object:
        return ev.evaluate_deployed(scratch, ctx.layout, models, fed.test, cpu, fed.num_classes, bn_data=bn)

    secs: dict[tuple[str, str], list[float]] = {}
    cpu_secs: dict[tuple[str, str], list[float]] = {}
    figures: dict[tuple[str, str], object] = {}
    for _ in range(args.repeats):
        for setting in ("now", "before"):
            for part, fn in (("server models", server), ("deployed models", deployed)):
                if setting == "before":
                    with before_issue_42():
                        s, c, out = cpu_timed(fn)
                else:
                    s, c, out = cpu_timed(fn)
                secs.setdefault((setting, part), []).append(s)
                cpu_secs.setdefault((setting, part), []).append(c)
                figures[(setting, part)] = out
    train = statistics.median(train_s[1:] or train_s)
    print(f"{args.algorithm} on {args.preset}: training {train:.2f} s a round (median of rounds "
          f"{'2' if args.rounds > 1 else '1'}-{args.rounds}); evaluation, median of {args.repeats}:")
    rounds, every = cfg.training.rounds, cfg.training.deployed_every
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for setting in ("now", "before"):
        srv = statistics.median(secs[(setting, "server models")])
        dep = statistics.median(secs[(setting, "deployed models")])
        srv_cpu = statistics.median(cpu_secs[(setting, "server models")])
        dep_cpu = statistics.median(cpu_secs[(setting, "deployed models")])
        ratio = (rounds * train + rounds * srv + (rounds // every) * dep) / (rounds * train)
        floor = (rounds * train + (rounds * srv_cpu + (rounds // every) * dep_cpu) / cores) / (rounds * train)
        print(f"  {setting:<6} server models {srv:.3f} s ({srv_cpu:.3f} CPU s), deployed models {dep:.3f} s "
              f"({dep_cpu:.3f} CPU s): projected round / training over {rounds} rounds {ratio:.3f}, "
              f"floor on {cores} cores {floor:.3f}")
    rate_eval, rate_train = arithmetic_rates(ctx, fed, state.params, cfg.training.batch_size, cpu)
    print(f"  arithmetic, one thread: evaluation {rate_eval:.1f} GFLOP/s, a training step {rate_train:.1f} GFLOP/s")
    for part in ("server models", "deployed models"):
        same = figures[("now", part)] == figures[("before", part)]
        print(f"  {part}: figures {'identical' if same else 'differ (float rounding): ' + _diff(figures, part)}")
    return 0


def _diff(figures: dict, part: str) -> str:
    now, before = figures[("now", part)], figures[("before", part)]
    flat = lambda d: {k: v for k, v in _walk(d)}  # noqa: E731
    a, b = flat(now), flat(before)
    worst = max((abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in a if a[k] != b[k]), default=0.0)
    acc = sum(1 for k in a if k[-1] == 0 and a[k] != b[k])
    return f"largest relative difference {worst:.2e}, accuracies differing {acc}"


def _walk(d: object, path: tuple = ()) -> Iterator[tuple[tuple, float]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _walk(v, (*path, k))
    elif isinstance(d, tuple):
        for i, v in enumerate(d):
            yield (*path, i), float(v)


if __name__ == "__main__":
    raise SystemExit(main())
