"""Compiled client steps (``resources.compile``, issue 56): the model's forward, and with it the backward
AOTAutograd derives, through ``torch.compile`` (Inductor), once per model shape per process.

What is compiled: the forward of the module the client loop trains (the scratch model, or the sliced
sub-network). The loss, the masking of gradients, the hooks' terms and the SGD step stay eager, so the loop's
order of operations, its hooks and its arithmetic outside the network are those of ``resources.compile=eager``;
inside the network Inductor fuses and reorders float operations, so a compiled run agrees with an eager one
within float rounding, not bit for bit (measured: benchmarks/compile_probe.py, docs/guides/performance.md),
and is deterministic in its own mode (the same generated code for the same shape, on every worker).

Why a key per shape: Dynamo keeps the compiled graphs on the code object of the model class's ``forward``,
guarded on the shapes of the parameters and the input; a new shape is a recompile (seconds), a seen one a
guard check. Sub-model methods train many shapes (one per width or channel budget), so the process keeps
:class:`CompiledForwards`: the shapes it has compiled (``hits`` / ``misses``), at most ``capacity`` of them;
a shape beyond that trains eager with one warning, never by Dynamo's silent fallback at its own recompile
limit (raised here to the capacity).

Falls back by name, never silently: a plan whose client hooks do not all declare ``supports_compile``
(a hook that computes the loss by calling the model itself, or watches activations through module hooks)
trains eager, with one warning per process naming the hooks (:func:`fallback_reason`).

Inductor's on-disk cache is put under the node's cache folder (:func:`inductor_cache_dir`:
``cache_home()/"inductor"``, beside the node's dataset copies), so the processes and trials of a node
compile a shape once: a later process loads the generated code instead of generating it again.
"""
from __future__ import annotations

import os
import stat
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from fedsap_ray.algorithms.hooks import hook_classes
from fedsap_ray.common.messages import ClientPlan
from fedsap_ray.data.status import cache_home

#: resources.compile values that compile the client's training forward (evaluation is not compiled yet)
TRAIN_MODES = ("train",)
CAPACITY = 32  # distinct model shapes compiled per process (each a few seconds cold, under one warm)
ENV = "TORCHINDUCTOR_CACHE_DIR"

ShapeKey = tuple[str, str, bool, tuple[tuple[str, tuple[int, ...]], ...]]


def shape_key(model: torch.nn.Module) -> ShapeKey:
    """What a compiled forward is specialised on: the class, device, train/eval mode and every tensor's shape."""
    shapes = tuple((n, tuple(t.shape)) for n, t in model.state_dict(keep_vars=True).items())
    device = next(model.parameters()).device.type
    return (type(model).__qualname__, device, model.training, shapes)


class CompiledForwards:
    """The process's compiled forwards: ``forward(model)`` returns a callable computing ``model(x)``, compiled
    when the model's shape is one of the first ``capacity`` seen, else the eager module. Thread-safe (the
    local backend's threads share one); ``hits``/``misses``/``refused`` count the clients whose shape was seen,
    new, or beyond the capacity."""

    def __init__(self, capacity: int = CAPACITY, backend: str = "inductor") -> None:
        self.capacity, self.backend = capacity, backend  # backend: torch.compile's (tests use "eager": no codegen)
        self.hits = self.misses = self.refused = 0
        self._seen: OrderedDict[ShapeKey, None] = OrderedDict()
        self._lock = threading.Lock()

    def forward(self, model: torch.nn.Module) -> Callable[..., torch.Tensor]:
        key = shape_key(model)
        with self._lock:
            if key in self._seen:
                self.hits += 1
            elif len(self._seen) >= self.capacity:
                self.refused += 1
                if self.refused == 1:
                    warnings.warn(f"resources.compile: more than {self.capacity} model shapes in this process; "
                                  f"new shapes train eager (first: {key[0]} in {'train' if key[2] else 'eval'} mode)",
                                  stacklevel=2)
                return model
            else:
                self.misses += 1
                self._seen[key] = None
                _raise_recompile_limit(self.capacity)
        # a thin wrapper per client (microseconds, nothing kept): the compiled graphs live on the model class's
        # forward code, so a new module of a seen shape passes the guards of the graph compiled for the first
        # dynamic=None, not False: False would specialise every batch size, so each client's last, shorter batch
        # would be another compile; Dynamo's default makes the batch dimension dynamic at its second size, while
        # parameter shapes stay static (a graph per model shape, as counted here)
        return torch.compile(model, dynamic=None, backend=self.backend)

    def counts(self) -> dict[str, int]:
        return {"compile_hits": self.hits, "compile_misses": self.misses, "compile_refused": self.refused}


_FORWARDS: CompiledForwards | None = None
_WARNED: set[tuple[str, ...]] = set()


def forwards() -> CompiledForwards:
    """The process's :class:`CompiledForwards` (built on first use, with Inductor's cache folder set)."""
    global _FORWARDS
    if _FORWARDS is None:
        use_node_cache()
        _FORWARDS = CompiledForwards()
    return _FORWARDS


def fallback_reason(plan: ClientPlan) -> str | None:
    """Why the plan's training cannot be compiled (the hooks that do not declare ``supports_compile``), or None.
    Warns once per process per set of hooks: the fallback is named, never silent."""
    blocking = tuple(sorted(cls.name for cls in hook_classes(plan) if not getattr(cls, "supports_compile", False)))
    if not blocking:
        return None
    reason = f"client hook(s) {', '.join(blocking)} do not support resources.compile; their clients train eager"
    if blocking not in _WARNED:
        _WARNED.add(blocking)
        warnings.warn(reason, stacklevel=2)
    return reason


def training_forward(plan: ClientPlan, model: torch.nn.Module, mode: str) -> Callable[..., torch.Tensor]:
    """The callable the client loop computes ``model(x)`` with: compiled when ``mode`` compiles training and the
    plan's hooks allow it, else the module itself (``resources.compile=eager``: exactly the eager loop)."""
    if mode not in TRAIN_MODES or fallback_reason(plan) is not None:
        return model
    return forwards().forward(model)


def inductor_cache_dir() -> Path:
    """Inductor's on-disk cache for this node: ``cache_home()/"inductor"`` (module docstring)."""
    return cache_home() / "inductor"


def use_node_cache() -> Path | None:
    """Point Inductor at :func:`inductor_cache_dir` unless ``TORCHINDUCTOR_CACHE_DIR`` is set already. The folder
    holds code Inductor loads and runs, so it is made owner-only, and a folder that is a link, is not ours or is
    writable by others is not used (Inductor then keeps its per-user default, with a warning). Called before
    the process's first compile, which reads the variable."""
    preset = os.environ.get(ENV)
    if preset and os.path.abspath(preset) != os.path.abspath(default_cache_dir()):
        return Path(preset)  # the user's (Inductor writes its own default into the variable when it first looks)
    path = inductor_cache_dir()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        warnings.warn(f"resources.compile: {path} is a link, not ours or writable by others; not used as "
                      "Inductor's cache", stacklevel=2)
        return None
    os.environ[ENV] = str(path)
    return path


def _raise_recompile_limit(n: int) -> None:
    """Dynamo gives up compiling a code object after its recompile limit (8) and runs it eager without a word;
    our own capacity bounds the shapes instead."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name) < n:
        setattr(cfg, name, n)
