#!/usr/bin/env python
"""Issue 56's probe: one client's training step, eager against ``torch.compile`` (Inductor), before any of it
is wired into the rounds.

The step is the client loop's (``fedsap_ray/engine/client.py``, ``_loop``) without hooks: ``zero_grad``, the
forward, cross-entropy, backward, the gradients masked to a nested half-width sub-model's coordinates
(masked mode: the full-size model with the other coordinates at zero), SGD with momentum 0.9 and weight
decay 5e-4 (eager: only the forward/backward is compiled, as ``resources.compile=train`` does). Batch 32,
one intra-op thread, synthetic CIFAR-shaped data.

Subcommands (each prints one JSON line):

- ``step``: two copies of the model from the same seed, one eager and one ``torch.compile``-d. The first
  compiled step's seconds are the compile (``compile_s``; cold when ``TORCHINDUCTOR_CACHE_DIR`` is empty,
  warm when a previous process filled it); both then train ``--steps`` steps on the same batches and
  ``max_abs_diff`` is the largest difference of any parameter or buffer; then ``--repeats`` interleaved
  blocks of ``--block`` steps each time the steady state (``step_ratio`` = compiled / eager, medians).
- ``shapes``: the sliced sub-models of ``--widths`` (one dense network per width, as the sliced mode
  trains): per-width static compiles (one ``torch.compile`` each: seconds and recompiles), one
  ``dynamic=True`` compile serving every width (seconds per new width and steady step time), and the
  padded alternative (the full-width model masked to each width: one shape, eager and compiled).
- ``all``: ``step`` for ``--model`` cold and warm (two fresh processes on one fresh cache folder).
- ``agree``: whole runs (smoke preset, FedAvg, ``--set`` overrides after) on one federation: eager, eager
  again (must differ by 0), ``resources.compile=train``, and as the control of float reordering eager with
  ``resources.torch_threads=2``: each one's seconds and the largest difference of every loss and accuracy
  column of ``rounds`` from the first eager run.
- ``methods``: every registered method on a tiny federation (``cnn_small``, 4 clients, 3 rounds of two epochs),
  eager and with ``resources.compile=train`` under Dynamo's ``eager`` backend (Dynamo's tracing, guards and
  graph breaks, no code generation, so the arithmetic is eager's): whether every column of ``rounds`` and
  ``clients`` but the wall-clock ones is equal, and the ``clients.compile`` outcomes (a method whose hooks fall
  back shows ``fallback``). One JSON line per method.

Run: ``nice -n 19 python benchmarks/compile_probe.py all --model resnet10 --width 0.25``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fedsap_ray.models import build_model
from fedsap_ray.models.masks import ParamLayout, TorchMask, apply_mask_, mask_grads_, nested_channel_masks, param_mask

SHAPE = (3, 32, 32)


def make(name: str, width: float, channels: dict[str, int] | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, num_classes=10, input_shape=SHAPE, width_mult=width, channels=channels)


def batches(n: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn((batch, *SHAPE), generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def stepper(model: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], grad_mask: TorchMask | None,
            layout: ParamLayout) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    opt = torch.optim.SGD(list(model.parameters()), lr=0.01, momentum=0.9, weight_decay=5e-4)
    model.train()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        if grad_mask is not None:
            mask_grads_(model, layout, grad_mask)
        opt.step()
        return loss.detach()
    return step


def masked(model: Any, p: float) -> tuple[TorchMask, ParamLayout]:
    layout = ParamLayout.from_model(model)
    mask = param_mask(model.channel_space(), layout, nested_channel_masks(model.channel_space(), p))
    apply_mask_(model, layout, mask)
    return TorchMask.build(model, layout, mask), layout


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compiles() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def cmd_step(a: argparse.Namespace) -> dict[str, Any]:
    eager_m, comp_m = make(a.model, a.width), make(a.model, a.width)
    gm, layout = masked(eager_m, a.mask_p)
    gm_c, _ = masked(comp_m, a.mask_p)
    data = batches(max(a.steps, a.block), 32)
    eager = stepper(eager_m, eager_m, gm, layout)
    compiled_fwd = torch.compile(comp_m, dynamic=False, backend=a.backend)
    comp = stepper(comp_m, compiled_fwd, gm_c, layout)
    first_eager = timed(lambda: eager(*data[0]))
    compile_s = timed(lambda: comp(*data[0]))
    diff1 = differences(eager_m, comp_m)
    for x, y in data[1:a.steps]:
        eager(x, y)
        comp(x, y)
    diff = differences(eager_m, comp_m)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for r in range(a.repeats):  # interleaved, order rotated
        for kind in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            fn = eager if kind == "eager" else comp
            times[kind].append(timed(lambda fn=fn: [fn(x, y) for x, y in data[:a.block]]) / a.block)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"probe": "step", "model": a.model, "width": a.width, "threads": torch.get_num_threads(),
            "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "compile_s": round(compile_s, 3),
            "first_eager_step_s": round(first_eager, 4), "graphs": compiles(),
            "eager_step_ms": round(1000 * med["eager"], 3), "compiled_step_ms": round(1000 * med["compiled"], 3),
            "step_ratio": round(med["compiled"] / med["eager"], 3), "backend": a.backend,
            "after_1_step": diff1, "steps_compared": a.steps, f"after_{a.steps}_steps": diff,
            "repeats": a.repeats, "block": a.block}


def differences(m1: torch.nn.Module, m2: torch.nn.Module) -> dict[str, Any]:
    """The largest absolute difference of the parameters, and of the BatchNorm buffers, and the largest relative
    one (|a - b| / max(|a|, 1e-6)) over both, with the tensor it is in."""
    sd1, sd2, params = m1.state_dict(), m2.state_dict(), {n for n, _ in m1.named_parameters()}
    out: dict[str, Any] = {"param_max_abs": 0.0, "buffer_max_abs": 0.0, "max_rel": 0.0, "max_rel_in": None}
    for k, t in sd1.items():
        if not t.is_floating_point():
            continue
        d = (t.double() - sd2[k].double()).abs()
        field = "param_max_abs" if k in params else "buffer_max_abs"
        out[field] = max(out[field], float(d.max()))
        rel = float((d / t.double().abs().clamp_min(1e-6)).max())
        if rel > out["max_rel"]:
            out["max_rel"], out["max_rel_in"] = rel, k
    return out


def cmd_shapes(a: argparse.Namespace) -> dict[str, Any]:
    from fedsap_ray.models.masks import channel_mask_counts
    full = make(a.model, a.width)
    space = full.channel_space()
    widths = [float(w) for w in a.widths.split(",")]
    counts = {w: channel_mask_counts(nested_channel_masks(space, w)) for w in widths}
    data = batches(a.block, 32)
    out: dict[str, Any] = {"probe": "shapes", "model": a.model, "width": a.width, "widths": widths}

    def steady(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        return statistics.median(timed(lambda: [step(x, y) for x, y in data]) / a.block for _ in range(a.repeats))

    static, eager_ms = [], []
    for w in widths:  # sliced: one dense network per width, one static compile each
        m, m_e = make(a.model, a.width, counts[w]), make(a.model, a.width, counts[w])
        lay = ParamLayout.from_model(m)
        g0 = compiles()
        st = stepper(m, torch.compile(m, dynamic=False), None, lay)
        first = timed(lambda st=st: st(*data[0]))
        eager_ms.append(1000 * steady(stepper(m_e, m_e, None, lay)))
        static.append({"p": w, "compile_s": round(first, 2), "graphs": compiles() - g0,
                       "step_ms": round(1000 * steady(st), 3)})
    out["eager_step_ms"] = [round(v, 3) for v in eager_ms]
    out["static"] = static
    # a second instance of the same shape: does a fresh torch.compile of it compile again?
    m2 = make(a.model, a.width, counts[widths[0]])
    g0 = compiles()
    st2 = stepper(m2, torch.compile(m2, dynamic=False), None, ParamLayout.from_model(m2))
    out["same_shape_new_module"] = {"compile_s": round(timed(lambda: st2(*data[0])), 2), "graphs": compiles() - g0}
    dyn = []
    compiled_fn = torch.compile(lambda mod, x: mod(x), dynamic=True)
    for w in widths:  # one dynamic compile serving every width (the module passed in)
        m = make(a.model, a.width, counts[w])
        g0 = compiles()
        st = stepper(m, lambda x, m=m: compiled_fn(m, x), None, ParamLayout.from_model(m))
        first = timed(lambda st=st: st(*data[0]))
        dyn.append({"p": w, "first_step_s": round(first, 2), "graphs": compiles() - g0,
                    "step_ms": round(1000 * steady(st), 3)})
    out["dynamic"] = dyn
    pad = []
    pm = make(a.model, a.width)
    compiled_pad = torch.compile(pm, dynamic=False)
    for w in widths:  # padded: the full-width model masked to the width (one shape whatever the width)
        gm, lay = masked(pm, w)
        g0 = compiles()
        st = stepper(pm, compiled_pad, gm, lay)
        first = timed(lambda st=st: st(*data[0]))
        pad.append({"p": w, "first_step_s": round(first, 2), "graphs": compiles() - g0,
                    "step_ms": round(1000 * steady(st), 3)})
    out["padded"] = pad
    return out


def cmd_agree(a: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from fedsap_ray import results
    from fedsap_ray.config import build_config
    from fedsap_ray.data import build_federation
    from fedsap_ray.engine import compiled
    from fedsap_ray.experiment import run_experiment

    base = ["algorithm.name=fedavg", "resources.num_workers=1", *a.set]
    fed = build_federation(build_config(preset="smoke", overrides=base))
    out = tempfile.mkdtemp(prefix="compile-agree-")
    variants = {"eager": [], "eager_again": [], "train": ["resources.compile=train"], "eager_2_threads": ["resources.torch_threads=2"]}
    tables, secs = {}, {}
    for name, extra in variants.items():
        t0 = time.perf_counter()
        run_experiment(build_config(preset="smoke", overrides=[*base, *extra]), f"{out}/{name}", run_id="x", federation=fed)
        secs[name] = round(time.perf_counter() - t0, 2)
        tables[name] = results.load(f"{out}/{name}").rounds.sort_values(["round", "domain"]).reset_index(drop=True)
    ref = tables["eager"]
    cols = [c for c in ref.columns if ("loss" in c or "acc" in c) and ref[c].dtype.kind == "f"]
    diffs = {name: {c: float(np.nanmax(np.abs(t[c].to_numpy(float) - ref[c].to_numpy(float)))) for c in cols}
             for name, t in tables.items() if name != "eager"}
    return {"probe": "agree", "set": a.set, "secs": secs, "counts": compiled.forwards().counts(), "max_abs_diff": diffs}


def cmd_all(a: argparse.Namespace) -> None:
    cache = a.cache or tempfile.mkdtemp(prefix="inductor-probe-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    for label in ("cold", "warm"):
        cmd = [sys.executable, __file__, "step", "--model", a.model, "--width", str(a.width), "--steps", str(a.steps),
               "--backend", a.backend,
               "--repeats", str(a.repeats), "--block", str(a.block)]
        line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        print(json.dumps({"cache": label, **json.loads(line)}), flush=True)


def cmd_methods(a: argparse.Namespace) -> None:
    import collections

    from fedsap_ray import algorithms, results
    from fedsap_ray.config import build_config
    from fedsap_ray.data import build_federation
    from fedsap_ray.engine import compiled
    from fedsap_ray.experiment import run_experiment

    compiled._FORWARDS = compiled.CompiledForwards(backend="eager")
    base = ["data.num_clients=4", "data.client_fraction=0.01", "data.max_test_per_domain=40", "model.name=cnn_small",
            "model.width_mult=0.25", "training.local_epochs=2", "training.batch_size=16",
            "training.max_steps_per_epoch=3", "training.rounds=3", "resources.num_workers=1", *a.set]
    fed = build_federation(build_config(preset="smoke", overrides=["algorithm.name=fedavg", *base]))
    volatile = [*results.WALL_CLOCK, "worker", "gpu_id", "node"]
    keys = {"rounds": ["round", "eval_mode", "domain"], "clients": ["round", "client_id"]}
    for name in algorithms.names():
        out = tempfile.mkdtemp(prefix=f"compile-methods-{name}-")
        tables = {}
        for mode in ("off", "train"):
            cfg = build_config(preset="smoke", overrides=[f"algorithm.name={name}", *base, f"resources.compile={mode}"])
            run_experiment(cfg, f"{out}/{mode}", run_id="r", federation=fed)
            res = results.load(f"{out}/{mode}")
            tables[mode] = {t: getattr(res, t).drop(columns=volatile, errors="ignore").sort_values(k)
                            .reset_index(drop=True) for t, k in keys.items()}
        equal = all(tables["off"][t].equals(tables["train"][t]) for t in keys)
        outcomes = collections.Counter(results.load(f"{out}/train").clients["compile"])
        print(json.dumps({"probe": "methods", "method": name, "equal_to_eager": equal, "outcomes": dict(outcomes)}),
              flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("probe", choices=("step", "shapes", "all", "agree", "methods"))
    p.add_argument("--model", default="resnet10")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--mask-p", type=float, default=0.5, help="nested width of the masked gradient (step)")
    p.add_argument("--widths", default="0.25,0.5,0.75,1.0", help="sub-model widths (shapes)")
    p.add_argument("--steps", type=int, default=20, help="steps trained by both before comparing parameters")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block", type=int, default=10, help="steps per timed block")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    p.add_argument("--set", action="append", default=[], help="config override of the agree runs (repeatable)")
    p.add_argument("--cache", default=None, help="Inductor cache folder for `all` (default: a fresh one)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.probe in ("all", "methods"):
        (cmd_all if a.probe == "all" else cmd_methods)(a)
        return
    probes = {"step": cmd_step, "shapes": cmd_shapes, "agree": cmd_agree}
    print(json.dumps(probes[a.probe](a)), flush=True)


if __name__ == "__main__":
    main()
