"""A model as a file a device runs: ONNX, TorchScript or safetensors, each read back and checked against the
PyTorch module before anything is written (``fedsap-ray export``; docs/guides/export.md).

What a device runs is a plain network in eval mode. A client's deployed sub-model is the dense sliced network
(:func:`fedsap_ray.models.sliced.sliced_model`), not a masked full-size one, so it exports like any other model, at its
own (smaller) size.

**The check.** Every format is checked the same way, on the inputs the caller gives (``fedsap-ray export``: the
run's test split through the dataset's input transform): the bytes about to be written are read back by what a
device would use (onnxruntime for ONNX, ``torch.jit.load`` for TorchScript, the model rebuilt from its sidecar
for safetensors) and their logits compared with the PyTorch module's. The largest absolute difference is
returned (:class:`ExportReport`); above :data:`TOLERANCE` the export is :class:`ExportCheckFailed` and nothing is
written: a file that computes something other than the model is worse than no file. The batch dimension is
dynamic in every format: the file is traced on :data:`TRACE_BATCH` inputs and checked on all of them, in
batches of :data:`CHECK_BATCH`, so a batch size baked into the graph fails the check.

**Choices.**

- ONNX goes through torch's TorchScript-based exporter (``torch.onnx.export(..., dynamo=False)``), opset
  :data:`ONNX_OPSET`. Measured with torch 2.14.1 on this project's 2-core machine (shared): it exported every
  registered model (ResNet10/18, the three CNNs, the MLP, the character LSTM, at width 1/8) in 0.1-2 s, each
  within 3.3e-7 of PyTorch; the ``torch.export``-based exporter (torch's default since 2.9) exported them too,
  within 2.1e-7, but took 1-11 s each, needs ``onnxscript`` (not in the ``export`` extra) and raised the opset
  to 18. torch marks the TorchScript-based exporter deprecated: when it goes, :func:`onnx_bytes` switches
  with ``dynamo=True`` and ``onnxscript`` joins the extra; the check tells whether the switch changed a logit.
- BatchNorm runs on its running statistics (the module is exported in eval mode, then put back in the mode
  it was in). The ONNX exporter folds each BatchNorm into the convolution before it (its eval-mode
  optimisation); TorchScript and safetensors keep the BatchNorm layers as they are, so a safetensors file holds
  ``state_dict()`` under its own names and the rebuilt model can be trained further.
- Every format carries the same JSON description (:func:`describe`: the model's constructor arguments, its
  input and output, what the caller adds, e.g. the run and the dataset's input transform): ONNX in the model's
  ``metadata_props["fedsap_ray"]``, TorchScript in the extra file ``fedsap_ray.json``, safetensors in its
  header metadata and in the sidecar ``<name>.json`` :func:`load_safetensors` rebuilds the model from (no
  pickle anywhere: reading a safetensors file runs no code).

Files appear whole or not at all (:func:`fedsap_ray.persist.atomic.atomic_write`). onnx and onnxruntime are the
optional ``export`` extra, imported only when an ONNX export is asked for (:func:`require`).
"""
from __future__ import annotations

import importlib
import io
import inspect
import json
import math
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsap_ray.persist.atomic import atomic_write
from fedsap_ray.data.base import as_input
from fedsap_ray.common.errors import ConfigError

#: format -> the file name ending it is written under
FORMATS: dict[str, str] = {"onnx": ".onnx", "torchscript": ".pt", "safetensors": ".safetensors"}
#: the largest absolute difference of a logit between the file and the PyTorch module that passes the check
TOLERANCE = 1e-4
ONNX_OPSET = 17  # run by every onnxruntime since 1.14, mobile builds included
TRACE_BATCH = 2  # inputs the file is traced on; it is checked on all of them (the batch dimension is dynamic)
CHECK_BATCH = 256  # inputs per forward pass of the check
RANDOM_INPUTS = 64  # inputs of random_inputs by default
META_KEY = "fedsap_ray"  # where each format keeps the JSON description
DESCRIPTION_FORMAT = "fedsap_ray.export/1"
EXTRA = "pip install 'fedsap-ray[export]'"
_NEEDS = {"onnx": ("onnx", "onnxruntime"), "torchscript": (), "safetensors": ("safetensors",)}
# torch's deprecation notices of the two TorchScript-based paths (chosen above on purpose), and its warning that an
# LSTM traced at a batch size other than 1 may not run at others: the check runs other batch sizes
_QUIET = (r"You are using the legacy TorchScript-based ONNX export", r"The feature will be removed",
          r"`torch\.jit\.", r"Exporting a model to ONNX with a batch_size other than 1")


class ExportCheckFailed(Exception):
    """The file read back does not compute the module's logits within the tolerance; nothing was written."""


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_module` wrote and what its check measured."""

    fmt: str
    path: Path  # the model file
    files: tuple[Path, ...]  # every file written (safetensors: the sidecar, then the tensors)
    size_bytes: int  # of the model file
    checked_with: str  # what read the file back
    samples: int  # inputs the check compared on
    max_abs_diff: float  # largest |logit difference| between the file and the PyTorch module
    top1_agreement: float  # share of those inputs whose predicted class is the same
    tolerance: float

    def summary(self, inputs: str | None = None) -> str:
        """One line: the file, what read it back, on what (``inputs``, in words; default: how many), the difference."""
        return (f"wrote {self.path} ({self.fmt}, {size_text(self.size_bytes)}); read back with {self.checked_with} "
                f"and checked against PyTorch on {inputs or f'{self.samples} inputs'}: max |logit difference| "
                f"{self.max_abs_diff:.2e} (tolerance {self.tolerance:.0e}), same predicted class on "
                f"{100 * self.top1_agreement:.1f}%")


def require(fmt: str, field: str = "--format") -> None:
    """``fmt`` is a format and the libraries it needs import; else a ConfigError naming ``field`` (and the
    ``export`` extra for a missing library), before any work."""
    if fmt not in FORMATS:
        raise ConfigError(f"invalid {field}={fmt!r}: allowed values are {', '.join(FORMATS)}")
    missing = []
    for name in _NEEDS[fmt]:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ConfigError(f"{field} {fmt} needs the export extra ({', '.join(missing)} not installed): {EXTRA}")


def model_spec(module: nn.Module) -> dict[str, Any] | None:
    """The arguments :func:`fedsap_ray.models.build_model` rebuilds ``module`` from, with its per-layer channel
    counts (a sliced sub-model's own); None for a module it did not build."""
    spec = getattr(module, "build_spec", None)
    counts = getattr(module, "channel_counts", None)
    if spec is None or counts is None:
        return None
    name, kw = spec
    return {"name": name, "num_classes": int(kw["num_classes"]), "input_shape": [int(s) for s in kw["input_shape"]],
            "width_mult": float(kw["width_mult"]),
            "vocab_size": None if kw.get("vocab_size") is None else int(kw["vocab_size"]),
            "channels": {str(k): int(v) for k, v in counts().items()}}


def input_transform(stored: torch.dtype) -> str:
    """How a sample as a dataset stores it becomes the model's input (:func:`fedsap_ray.data.base.as_input`),
    in words, for the description a file carries."""
    if stored == torch.uint8:
        return "uint8 image pixels p (N, C, H, W) -> p * 2/255 - 1: float32 in [-1, 1]"
    if stored == torch.long:
        return "int64 token ids, unchanged"
    return "float32 features, unchanged"


def random_inputs(module: nn.Module, n: int = RANDOM_INPUTS, seed: int = 0) -> torch.Tensor:
    """``n`` seeded random inputs of the model's kind, as the datasets' transform gives them: token ids for a text
    model, uint8 images through :func:`~fedsap_ray.data.base.as_input` for a (C, H, W) one, N(0, 1) features."""
    shape = tuple(int(s) for s in getattr(module, "input_shape", ()))
    if not shape:
        raise ConfigError(f"random inputs: {type(module).__name__} names no input_shape; give it inputs")
    g = torch.Generator().manual_seed(seed)
    if getattr(module, "input_dtype", torch.float32) == torch.long:
        return torch.randint(0, int(getattr(module, "vocab_size")), (n, *shape), generator=g)  # noqa: B009
    if len(shape) == 3:
        return as_input(torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8))
    return torch.randn((n, *shape), generator=g)


def describe(module: nn.Module, inputs: torch.Tensor, fmt: str, metadata: Mapping[str, Any] | None = None) -> dict:
    """The JSON description every format carries (module docstring); ``metadata`` is added as given."""
    spec = model_spec(module)
    with torch.no_grad():
        n_out = int(module(inputs[:1]).shape[-1])
    from fedsap_ray import __version__

    return {"format": DESCRIPTION_FORMAT, "file": fmt, "producer": f"fedsap_ray {__version__}, torch {torch.__version__}",
            **({"model": spec} if spec is not None else {}),
            "input": {"name": "input", "dtype": str(inputs.dtype).removeprefix("torch."),
                      "shape": ["batch", *(int(s) for s in inputs.shape[1:])]},
            "output": {"name": "logits", "shape": ["batch", n_out]},
            **dict(metadata or {})}


def export_module(module: nn.Module, example_inputs: torch.Tensor, fmt: str, path: str | Path, *,
                  metadata: Mapping[str, Any] | None = None, tolerance: float = TOLERANCE) -> ExportReport:
    """Write ``module`` as ``fmt`` to ``path`` once the file, read back, gives its logits on ``example_inputs`` (a
    batch, as the model takes it) within ``tolerance``; :class:`ExportCheckFailed` otherwise, nothing written.

    ``path`` must end in the format's ending (:data:`FORMATS`); safetensors adds the sidecar ``path`` with
    ``.json``. ``metadata`` (JSON values) joins the description every format carries. A model the format's
    exporter cannot take is a ConfigError naming its class."""
    require(fmt, "fmt")
    path = Path(path)
    if path.suffix != FORMATS[fmt]:
        raise ValueError(f"export_module: a {fmt} export is a {FORMATS[fmt]} file, not {path.name!r}")
    if not isinstance(example_inputs, torch.Tensor) or example_inputs.dim() < 2 or len(example_inputs) == 0:
        raise ValueError("export_module: example_inputs must be a non-empty batch (a tensor of at least 2 dimensions)")
    if any(p.device.type != "cpu" for p in module.parameters()):
        raise ValueError("export_module: the module must be on the CPU (module.cpu()): a file is traced and checked there")
    inputs = example_inputs.detach().cpu()
    with _eval_mode(module):
        meta = describe(module, inputs, fmt, metadata)
        files = _encode(fmt, module, inputs[:TRACE_BATCH], meta)
        reference = _logits(module, inputs)
    try:
        reader, checked_with = _READERS[fmt](files, meta)
        got = _batched(reader, inputs)
    except Exception as e:  # the runtime refused the file or the inputs: as much a failed check as other logits
        raise ExportCheckFailed(f"the {fmt} file cannot be run on the inputs ({type(e).__name__}: {_first_line(e)}); "
                                "nothing was written") from e
    worst, agree = compare(reference, got, f"the {fmt} file", tolerance)
    written = tuple(_write(path, files))
    return ExportReport(fmt, path, written, len(files[""]), checked_with, len(inputs), worst, agree, tolerance)


def compare(reference: np.ndarray, got: np.ndarray, what: str, tolerance: float = TOLERANCE) -> tuple[float, float]:
    """(max |difference|, share of rows with the same argmax) of ``got`` against the module's ``reference``
    logits; :class:`ExportCheckFailed` naming ``what`` above ``tolerance`` (NaN included) or on another shape."""
    if got.shape != reference.shape:
        raise ExportCheckFailed(f"{what} gives logits of shape {got.shape}, the PyTorch module {reference.shape}; "
                                "nothing was written")
    diff = np.abs(got.astype(np.float64) - reference.astype(np.float64))
    worst = float(diff.max()) if diff.size else 0.0
    if not worst <= tolerance:
        raise ExportCheckFailed(f"{what} differs from the PyTorch module by up to {worst:.3g} in a logit "
                                f"(tolerance {tolerance:g}) on {len(reference)} inputs; nothing was written")
    rows = reference.reshape(len(reference), -1), got.reshape(len(got), -1)
    agree = float(np.mean(rows[0].argmax(1) == rows[1].argmax(1))) if len(got) else 1.0
    return worst, agree


# ----------------------------------------------------------------------------- each format: bytes and read-back

def onnx_bytes(module: nn.Module, trace_inputs: torch.Tensor, meta: Mapping[str, Any]) -> bytes:
    """The module as an ONNX model (batch dimension dynamic), the description in its metadata_props."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="fedsap-export-") as scratch, _quiet():  # the exporter writes a path
        f = Path(scratch) / "model.onnx"
        # torch before 2.5 has only this exporter and no ``dynamo`` argument; later ones default to the other
        legacy: dict[str, Any] = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
        torch.onnx.export(module, (trace_inputs,), f, opset_version=ONNX_OPSET, input_names=["input"],
                          output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                          **legacy)
        model = onnx.load(f)
    onnx.helper.set_model_props(model, {META_KEY: json.dumps(meta, sort_keys=True)})
    return model.SerializeToString()


def onnx_runner(data: bytes) -> Callable[[torch.Tensor], np.ndarray]:
    """An onnxruntime CPU session of the ONNX bytes, as a function of a batch (with torch's thread count)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: np.asarray(session.run(None, {name: x.numpy()})[0])


def torchscript_bytes(module: nn.Module, trace_inputs: torch.Tensor, meta: Mapping[str, Any]) -> bytes:
    """The module traced (``torch.jit.trace``: no Python control flow in our models' forward), the description
    as the extra file ``fedsap_ray.json``."""
    buf = io.BytesIO()
    with _quiet(), torch.no_grad():
        traced = torch.jit.trace(module, (trace_inputs,), check_trace=False)
        torch.jit.save(traced, buf, _extra_files={f"{META_KEY}.json": json.dumps(meta, sort_keys=True)})
    return buf.getvalue()


def safetensors_bytes(module: nn.Module, meta: Mapping[str, Any]) -> bytes:
    """``module.state_dict()`` as safetensors (every tensor on the CPU, in its own dtype), the description in the
    header; refused for a model the description cannot rebuild (no constructor arguments)."""
    from safetensors.torch import save

    if "model" not in meta:
        raise ConfigError(f"format safetensors needs a model built by fedsap_ray.models.build_model (its sidecar names "
                          f"the constructor arguments); {type(module).__name__} was not: use onnx or torchscript")
    state = {k: v.detach().cpu().clone().contiguous() for k, v in module.state_dict().items()}
    return save(state, metadata={META_KEY: json.dumps(meta, sort_keys=True)})


def rebuild(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str) -> nn.Module:
    """The model a description names (:func:`fedsap_ray.models.build_model`, its channel counts), with
    ``tensors`` loaded (every key, nothing else), in eval mode; a ConfigError naming ``where`` otherwise."""
    from fedsap_ray.models import build_model

    spec = meta.get("model") if isinstance(meta, Mapping) else None
    try:
        if not isinstance(spec, Mapping):
            raise ValueError("no 'model' entry naming the constructor arguments")
        vocab = spec.get("vocab_size")
        with torch.random.fork_rng(devices=[]):  # the global RNG never moves: the weights are replaced below
            model = build_model(str(spec["name"]), num_classes=int(spec["num_classes"]),
                                input_shape=tuple(int(s) for s in spec["input_shape"]),
                                width_mult=float(spec["width_mult"]), vocab_size=None if vocab is None else int(vocab),
                                channels={str(k): int(v) for k, v in dict(spec["channels"]).items()})
        model.load_state_dict(dict(tensors), strict=True)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{where}: cannot rebuild the model ({' '.join(str(e).split())[:300]})") from e
    return model.eval()


def load_safetensors(path: str | Path) -> nn.Module:
    """A safetensors export rebuilt as a fresh module in eval mode, from its sidecar ``<name>.json`` and its
    tensors (no pickle, no code read from the files); a ConfigError naming the file that is missing or wrong."""
    from safetensors.torch import load

    path = Path(path)
    sidecar = path.with_suffix(".json")
    try:
        meta = json.loads(sidecar.read_text())
        tensors = load(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # a missing file, bad JSON, a damaged header
        raise ConfigError(f"{path}: cannot read the export ({' '.join(str(e).split())[:200]})") from e
    return rebuild(meta, tensors, str(sidecar))


def _encode(fmt: str, module: nn.Module, trace_inputs: torch.Tensor, meta: Mapping[str, Any]) -> dict[str, bytes]:
    """The files of one export, by name ending ('' the model file, '.json' a sidecar); a model the exporter
    cannot take is a ConfigError naming its class and the exporter's first words."""
    try:
        if fmt == "onnx":
            return {"": onnx_bytes(module, trace_inputs, meta)}
        if fmt == "torchscript":
            return {"": torchscript_bytes(module, trace_inputs, meta)}
        return {"": safetensors_bytes(module, meta), ".json": json.dumps(meta, indent=2, sort_keys=True).encode()}
    except ConfigError:
        raise
    except Exception as e:  # whatever the exporter raises for a model it cannot take
        raise ConfigError(f"format {fmt}: {type(module).__name__} cannot be exported ({type(e).__name__}: "
                          f"{_first_line(e)}); the other formats may work") from e


def _read_onnx(files: Mapping[str, bytes], meta: Mapping[str, Any]) -> tuple[Callable[[torch.Tensor], np.ndarray], str]:
    import onnxruntime

    return onnx_runner(files[""]), f"onnxruntime {onnxruntime.__version__}"


def _read_torchscript(files: Mapping[str, bytes], meta: Mapping[str, Any]) -> tuple[Callable[[torch.Tensor], np.ndarray], str]:
    with _quiet():
        loaded = torch.jit.load(io.BytesIO(files[""]), map_location="cpu")
    loaded.eval()

    def run(x: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return loaded(x).float().numpy()
    return run, "torch.jit.load"


def _read_safetensors(files: Mapping[str, bytes], meta: Mapping[str, Any]) -> tuple[Callable[[torch.Tensor], np.ndarray], str]:
    from safetensors.torch import load

    model = rebuild(json.loads(files[".json"]), load(files[""]), "the safetensors sidecar")

    def run(x: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return model(x).float().numpy()
    return run, "build_model + load_state_dict from the sidecar"


_READERS = {"onnx": _read_onnx, "torchscript": _read_torchscript, "safetensors": _read_safetensors}


# ----------------------------------------------------------------------------- helpers

@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """The module in eval mode for the block, then back in the mode it was in."""
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


@contextmanager
def _quiet() -> Iterator[None]:
    """torch's notices about the paths chosen here (:data:`_QUIET`), and its tracer's warning that a traced value may
    not generalise to other inputs: the check runs the file on inputs and batch sizes it was not traced on."""
    with warnings.catch_warnings():
        for message in _QUIET:
            warnings.filterwarnings("ignore", message=message)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield


@torch.no_grad()
def _logits(module: nn.Module, inputs: torch.Tensor) -> np.ndarray:
    return _batched(lambda x: module(x).float().numpy(), inputs)


def _batched(run: Callable[[torch.Tensor], np.ndarray], inputs: torch.Tensor) -> np.ndarray:
    return np.concatenate([run(inputs[i:i + CHECK_BATCH].contiguous()) for i in range(0, len(inputs), CHECK_BATCH)])


def _write(path: Path, files: Mapping[str, bytes]) -> Iterator[Path]:
    """Each file whole (temp + rename); a sidecar first, so a model file never appears without it."""
    for ending in sorted(files, key=lambda e: e == ""):
        target = path.with_suffix(ending) if ending else path
        with atomic_write(target) as f:
            f.write(files[ending])
        yield target


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:200]


def size_text(n: int) -> str:
    """Bytes in words (the CLI's line)."""
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{math.ceil(n / 1e3)} kB"
