"""Compiled client steps (``resources.compile``, issue 56): the model's forward, and with it the backward
AOTAutograd derives, through ``torch.compile`` (Inductor), once per model shape per process.

What is compiled: the forward of the module the client loop trains (the scratch model, or the sliced
sub-network). The loss, the masking of gradients, the hooks' terms and the SGD step stay eager, so the loop's
order of operations, its hooks and its arithmetic outside the network are those of ``resources.compile=off``;
inside the network Inductor fuses and reorders float operations, so a compiled run agrees with an eager one
within float rounding, not bit for bit (measured: benchmarks/compile_probe.py, docs/guides/performance.md),
and is deterministic in its own mode (the same generated code for the same shape, on every worker).

Why a key per shape: Dynamo keeps the compiled graphs on the code object of the model class's ``forward``,
guarded on the shapes of the parameters and the input; a new shape is a recompile (seconds), a seen one a
guard check. Sub-model methods train many shapes (one per width or channel budget), so the process keeps
:class:`CompiledForwards`: the shapes it has compiled (``hits`` / ``misses``), at most ``capacity`` of them;
a shape beyond that trains eager with one warning, never by Dynamo's silent fallback at its own recompile
limit (raised here to the capacity).

Hooks: a hook that gives the base loss computes it through :class:`CompiledView` (the model's call and
``forward_features`` compiled), and forward hooks on the trained module (FedSAP's channel statistics) are traced
into the graph with Dynamo's hook guards on (:func:`_configure_dynamo`). Falls back by name, never silently: a
plan whose client hooks do not all declare ``supports_compile`` (one that runs other networks beside the trained
one, as MOON's, or changes the width batch by batch, as FjORD's) trains eager, with one warning per process
naming the hooks (:func:`fallback_reason`) and ``fallback`` in ``clients.compile``.

Inductor's on-disk cache is put under the node's cache folder (:func:`inductor_cache_dir`:
``cache_home()/"inductor"``, beside the node's dataset copies), so the processes and trials of a node
compile a shape once: a later process loads the generated code instead of generating it again.

A damaged cache entry is rebuilt, never trusted (:mod:`fedsap_ray.engine.compile_cache`): Inductor loads its
generated ``.py`` and ``.so`` files by name without checking them, so every file it writes into our folder gets
a content digest once the compile that wrote it is done (:func:`record_new_files`, after a client's training or
a round's evaluation that compiled), and before the process's first compile :func:`use_node_cache` removes each
file that does not match its digest, has none, or is a link, with one warning naming the folder; Inductor then
generates it again. A folder the user set in ``TORCHINDUCTOR_CACHE_DIR`` is theirs and is not checked.
"""
from __future__ import annotations

import os
import stat
import threading
import warnings
from collections.abc import Callable
from typing import Any, cast
from pathlib import Path

import torch

from fedsap_ray.algorithms.hooks import hook_classes
from fedsap_ray.common.messages import ClientPlan
from fedsap_ray.data.status import cache_home
from fedsap_ray.engine import compile_cache

#: resources.compile values that compile the client's training forward, and those that compile evaluation's too
TRAIN_MODES = ("train", "train+eval")
EVAL_MODES = ("train+eval",)
CAPACITY = 32  # distinct model shapes compiled per process and role (each a few seconds cold, under one warm)
ENV = "TORCHINDUCTOR_CACHE_DIR"
#: what a client's training forward was (the ``clients.compile`` column): the eager loop (``off``), eager because
#: a hook cannot be compiled (``fallback``), a compiled shape seen before in the process (``hit``), compiled now
#: (``miss``), or eager because the process holds ``capacity`` shapes already (``refused``)
OUTCOMES = ("off", "fallback", "hit", "miss", "refused")

ShapeKey = tuple[str, str, bool, tuple[tuple[str, tuple[int, ...]], ...]]


def shape_key(model: torch.nn.Module) -> ShapeKey:
    """What a compiled forward is specialised on: the class, device, train/eval mode and every tensor's shape."""
    shapes = tuple((n, tuple(t.shape)) for n, t in model.state_dict(keep_vars=True).items())
    device = next(model.parameters()).device.type
    return (type(model).__qualname__, device, model.training, shapes)


def compile_mode(device: str) -> str | None:
    """torch.compile's mode for a device: CUDA graphs (``reduce-overhead``) on CUDA, where many small clients
    leave the GPU idle between kernel launches and a replayed graph launches a step at once; Inductor's default
    on the CPU (no launch overhead to save). The CUDA path is prepared for benchmarks/gpu_check.sh and has not
    run on a GPU in our tests (docs/guides/performance.md)."""
    return "reduce-overhead" if device == "cuda" else None


class CompiledForwards:
    """The process's compiled forwards: :meth:`lookup` returns a callable computing ``model(x)``, compiled when
    the model's shape is one of the first ``capacity`` of its role (training or evaluation) seen, else the eager
    module, and the outcome (:data:`OUTCOMES`). Thread-safe (the local backend's threads share one); ``hits``,
    ``misses`` and ``refused`` count per role."""

    def __init__(self, capacity: int = CAPACITY, backend: str = "inductor") -> None:
        self.capacity, self.backend = capacity, backend  # backend: torch.compile's (tests use "eager": no codegen)
        self.hits = {"train": 0, "eval": 0}
        self.misses = {"train": 0, "eval": 0}
        self.refused = {"train": 0, "eval": 0}
        self._seen: dict[str, set[ShapeKey]] = {"train": set(), "eval": set()}
        self._lock = threading.Lock()

    def lookup(self, model: torch.nn.Module) -> tuple[Callable[..., torch.Tensor], str]:
        key = shape_key(model)
        role = "train" if key[2] else "eval"
        seen = self._seen[role]
        with self._lock:
            if key in seen:
                self.hits[role] += 1
                outcome = "hit"
            elif len(seen) >= self.capacity:
                self.refused[role] += 1
                if self.refused[role] == 1:
                    warnings.warn(f"resources.compile: more than {self.capacity} model shapes in this process's "
                                  f"{role} forwards; new shapes run eager (first: {key[0]})", stacklevel=2)
                return model, "refused"
            else:
                self.misses[role] += 1
                seen.add(key)
                outcome = "miss"
                _configure_dynamo(4 * self.capacity)  # two roles; a shape may hold a static and a dynamic-batch graph
        # a thin wrapper per client (microseconds, nothing kept): the compiled graphs live on the model class's
        # forward code, so a new module of a seen shape passes the guards of the graph compiled for the first.
        # dynamic=None, not False: False would specialise every batch size, so each client's last, shorter batch
        # would be another compile; Dynamo's default makes the batch dimension dynamic at its second size, while
        # parameter shapes stay static (a graph per model shape, as counted here)
        return torch.compile(model, dynamic=None, backend=self.backend, mode=compile_mode(key[1])), outcome

    def forward(self, model: torch.nn.Module) -> Callable[..., torch.Tensor]:
        """:meth:`lookup`'s callable alone."""
        return self.lookup(model)[0]

    def features(self, model: torch.nn.Module) -> Callable[..., torch.Tensor]:
        """``model.forward_features`` compiled as :meth:`lookup` compiles ``model``: for a model :meth:`lookup`
        compiled (its graphs, like the forward's, live on the class's code and count in the same shape)."""
        features = cast(Callable[..., torch.Tensor], model.forward_features)  # a MaskableModel method
        return torch.compile(features, dynamic=None, backend=self.backend, mode=compile_mode(shape_key(model)[1]))

    def counts(self) -> dict[str, int]:
        return {f"{role}_compile_{what}": n[role] for what, n in
                (("hits", self.hits), ("misses", self.misses), ("refused", self.refused)) for role in ("train", "eval")}


_FORWARDS: CompiledForwards | None = None
_FORWARDS_LOCK = threading.Lock()
_WARNED: set[tuple[str, ...]] = set()


def forwards() -> CompiledForwards:
    """The process's :class:`CompiledForwards` (built on first use, with Inductor's cache folder set). Locked: the
    local backend's first clients ask at once, and two caches would each count the first shape a miss."""
    global _FORWARDS
    with _FORWARDS_LOCK:
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


def training_forward(plan: ClientPlan, model: torch.nn.Module, mode: str) -> tuple[Callable[..., torch.Tensor], str]:
    """The callable the client loop computes ``model(x)`` with, and its outcome (:data:`OUTCOMES`): compiled
    when ``mode`` compiles training and the plan's hooks allow it, else the module itself
    (``resources.compile=off``: exactly the eager loop)."""
    if mode not in TRAIN_MODES:
        return model, "off"
    if fallback_reason(plan) is not None:
        return model, "fallback"
    return forwards().lookup(model)


class CompiledView:
    """What a hook's ``loss`` gets under ``resources.compile``: the trained module with its call and its
    ``forward_features`` compiled (the process's graphs for its shape), every other attribute the module's own
    (the classifier a loss applies to the features stays eager: one linear layer). A hook that computes its loss
    from the model it is given thus computes it through the compiled network, as the plain loss does."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., torch.Tensor]) -> None:
        self._model, self._forward = model, forward
        self._features: Callable[..., torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if self._features is None:
            self._features = forwards().features(self._model)
        return self._features(x)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def loss_model(model: torch.nn.Module, forward: Callable[..., torch.Tensor]) -> Any:
    """The model a hook's ``loss`` is given: ``model`` itself when ``forward`` is (eager), else its
    :class:`CompiledView`."""
    return model if forward is model else CompiledView(model, forward)


def eval_forward(net: torch.nn.Module, mode: str) -> Callable[..., torch.Tensor]:
    """The callable evaluation computes ``net(x)`` with (``net`` in eval mode, as
    :func:`fedsap_ray.engine.evaluate.inference_module` built it): compiled under ``train+eval``."""
    return forwards().forward(net) if mode in EVAL_MODES else net


def eval_compiles() -> int:
    """Evaluation shapes this process has compiled so far (a round's ``rounds.eval_compiles`` is the difference)."""
    return 0 if _FORWARDS is None else _FORWARDS.misses["eval"]


def round_compiles(mode: str, before: int) -> int | None:
    """``rounds.eval_compiles``: evaluation shapes compiled since ``before`` (:func:`eval_compiles`), None when
    ``mode`` does not compile evaluation."""
    if mode not in EVAL_MODES:
        return None
    record_new_files()
    return eval_compiles() - before


def inductor_cache_dir() -> Path:
    """Inductor's on-disk cache for this node: ``cache_home()/"inductor"`` (module docstring)."""
    return cache_home() / "inductor"


def _inductor_default() -> str:
    """Inductor's own default cache folder (deferred import: Inductor costs a second to every process that imports
    the engine, most of which never compile)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def use_node_cache() -> Path | None:
    """Point Inductor at :func:`inductor_cache_dir` unless ``TORCHINDUCTOR_CACHE_DIR`` is set already. The folder
    holds code Inductor loads and runs, so it is made owner-only, and a folder that is a link, is not ours or is
    writable by others is not used (Inductor then keeps its per-user default, with a warning). Called before
    the process's first compile, which reads the variable."""
    preset = os.environ.get(ENV)
    if preset and os.path.abspath(preset) != os.path.abspath(_inductor_default()):
        return Path(preset)  # the user's (Inductor writes its own default into the variable when it first looks)
    path = inductor_cache_dir()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        warnings.warn(f"resources.compile: {path} is a link, not ours or writable by others; not used as "
                      "Inductor's cache", stacklevel=2)
        return None
    os.environ[ENV] = str(path)
    global _CHECKED_ROOT
    if _CHECKED_ROOT != path:  # once per process and folder, before the compile that would load a damaged file
        compile_cache.check(path)
        _CHECKED_ROOT = path
    return path


#: what decides a process's Inductor folder (:func:`use_node_cache`), handed from a driver to its actors
CACHE_VARS = ("FEDSAP_RAY_CACHE", ENV)


def cache_env() -> dict[str, str]:
    """This process's say in where Inductor's cache is (:data:`CACHE_VARS` that are set; Inductor's own default
    left out), for a driver to hand to the actors it starts on its node: an actor's process inherits the raylet's
    environment, which is the driver's only as it was at ``ray.init``, so a later change (a session Ray, a
    script that sets ``FEDSAP_RAY_CACHE`` after connecting) would put the actors' compiles in another folder."""
    env = {name: os.environ[name] for name in CACHE_VARS if os.environ.get(name)}
    if ENV in env and os.path.abspath(env[ENV]) == os.path.abspath(_inductor_default()):
        del env[ENV]
    return env


def adopt_cache_env(env: dict[str, str]) -> None:
    """Take a driver's :func:`cache_env` (before the process's first compile): the same folder as the driver's."""
    for name in CACHE_VARS:
        if name in env:
            os.environ[name] = env[name]
        else:  # unset on the driver: the raylet's value (the node's at ray.init) is not the driver's folder
            os.environ.pop(name, None)


_CHECKED_ROOT: Path | None = None  # our Inductor folder, once checked: the one whose new files get digests
_RECORDED_AT: int | None = None  # Dynamo's compiled-frame count at the last record
_RECORD_LOCK = threading.Lock()


def record_new_files(outcome: str = "miss") -> None:
    """Record the digests of the files the process's compiles wrote into our Inductor folder
    (:func:`compile_cache.record`), after a client's training (``outcome``, :data:`OUTCOMES`) or a round's
    evaluation. Cheap when nothing compiled: it walks the folder only after a miss or when Dynamo compiled a
    frame since the last record (a recompile for a new batch size, or another thread's miss)."""
    global _RECORDED_AT
    if _CHECKED_ROOT is None or outcome in ("off", "fallback", "refused"):
        return
    from torch._dynamo.utils import counters  # deferred: Dynamo's import costs a second to every process

    frames = counters["frames"]["ok"]
    with _RECORD_LOCK:
        if outcome != "miss" and frames == _RECORDED_AT:
            return
        _RECORDED_AT = frames
        compile_cache.record(_CHECKED_ROOT)


def _configure_dynamo(n: int) -> None:
    """Two of Dynamo's defaults would make a compiled client wrong or slow without a word:

    - it gives up compiling a code object after its recompile limit (8) and runs it eager: our own capacity
      bounds the shapes instead (raised to ``n``);
    - it does not guard on module hooks (``skip_nnmodule_hook_guards``): a forward hook registered after a
      graph was compiled (FedSAP's channel statistics watch only the last local epoch) is skipped by that graph,
      so the statistics would miss every activation (measured on torch 2.14: "no forward pass reached layer").
      Guarded, a hooked and an unhooked graph are kept per shape; a later client's new hooks of the same kind
      pass the guards (no recompile: tests/engine/test_compiled.py)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name) < n:
        setattr(cfg, name, n)
    cfg.skip_nnmodule_hook_guards = False
