"""Kept models: the global models a run leaves under ``OUT/models/<run_id>/`` and what its clients deploy
(``training.keep_model``; docs/guides/models.md).

Why: the tables say how well a run's models did, but a researcher also needs the models themselves (to
evaluate them on data the run never saw, to export what a device runs), and the checkpoint, the only other
copy of the weights, is deleted when the run finishes. What is kept, per ``which`` (``final``: the model
after the run's last round; ``best``: the model of the evaluated round where the best-so-far global accuracy
of the first eval mode, ``rounds.best_global_accuracy``, last strictly improved: the figure papers/000 reports as
its Global Acc., its Experiments section and Table 1; papers/003 reports the final one instead, its section 4.2):

- ``<which>.safetensors``: the global model (the server's parameters, ``ServerState.params``), one float32
  tensor per floating-point parameter and buffer of the full model, named as ``model.state_dict()`` names
  them (``num_batches_tracked``, an integer counter no forward pass in eval mode reads, is left out);
- ``<which>.json``: what it is (run id, round, config hash and the whole stored config, model, width,
  classes, input shape and the input transform, the metric that selected it, the eval mode whose recorded
  figures are this model's, the layout's digest) and the digests that bind it to its tensors;
- ``<which>.deployed.safetensors`` + ``.json``: what each client of the run's deployed sample
  (:func:`fedsap_ray.engine.server.deployed_sample`, at most ``training.eval_clients``) runs, as
  :meth:`Strategy.deployed_model <fedsap_ray.algorithms.contract.Strategy.deployed_model>` gives it: its
  parameters at its parameter mask. Stored deduplicated: every distinct mask once (packed bits), every
  distinct vector once and only at its mask's coordinates (nested-width clients share the global vector:
  nothing but their masks is stored), an index per client. The BN rule goes with them: under
  ``training.deployed_bn=client`` the deployed model's BN statistics are those of the client's own training
  data, recomputed when the model is loaded (the rule the deployed evaluation applies,
  :func:`fedsap_ray.engine.evaluate.calibrate_bn_`) from the federation rebuilt from the stored config; the digest
  of each client's data is kept, so a federation that rebuilds differently is refused, never used.

Every file goes through the results folder's door (:class:`fedsap_ray.persist.outdir.OutDir`: no link followed,
nothing outside the folder) and appears whole (:func:`fedsap_ray.persist.atomic.atomic_write`); safetensors holds
tensors and a JSON header only, so reading one runs no code, as every file the project reads. Reading checks
content (:mod:`fedsap_ray.persist.digest`): a JSON edited, a tensor file damaged, replaced or swapped with another
run's or another ``which``'s, is refused by name (:class:`KeptModelError`). The JSON files are written last
and bind the tensors they describe, so a write killed half way is refused on load and rewritten by the resume.

When they are written (:class:`ModelKeeper`, called by :class:`fedsap_ray.run.session.RunSession`): ``best`` at
an evaluated round where the figure strictly improves, *before* that round's checkpoint (a kill in between
resumes from the round before, which the resume trains again and keeps again, byte for byte); ``final`` when
the run ends ``finished`` or ``stopped``, before its ``runs`` row says so (an interrupted or failed run
keeps its checkpoint instead and gets its final model when it is resumed to its end). No Ray; torch,
the models and the data are imported only by the functions that build or load a model.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsap_ray.persist.digest import arrays_digest, json_digest
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.persist.outdir import FILE, OutDir
from fedsap_ray.results.store import check_run_id, filesystem, list_table, run_ids

if TYPE_CHECKING:  # type-only: nothing here imports torch at module level
    import torch
    from torch import nn

    from fedsap_ray.models.masks import ParamLayout
    from fedsap_ray.config.schema import ExperimentConfig

FOLDER = "models"
WHICH = ("final", "best")
FORMAT = 1
KIND = "fedsap_ray kept model"
DEPLOYED_KIND = "fedsap_ray kept deployed models"
#: How the project feeds a model (:func:`fedsap_ray.data.as_input`), recorded in every kept model's JSON: nothing
#: is attached to a loaded model, so whoever feeds it applies this to stored samples.
INPUT_TRANSFORM = ("fedsap_ray.data.as_input: uint8 images x (N, C, H, W) -> float32 x * 2/255 - 1, in [-1, 1]; "
                   "float features and int64 token ids as stored")
BEST_RULE = ("the evaluated round where the best-so-far global accuracy of the first eval mode "
             "(rounds.best_global_accuracy) last strictly improved")
FINAL_RULE = "the last round the run completed"
AFRESH = "restore the file from a copy, or run the run again (--run-id ID --overwrite)"


class KeptModelError(ConfigError):
    """A kept model that cannot be given: an unknown run, a model or client the run did not keep, a damaged or
    edited file (one line naming it; exit 2 from a command)."""


def folder(out: str | Path, run_id: str) -> Path:
    """``OUT/models/<run_id>``: where run ``run_id`` keeps its models."""
    return Path(out) / FOLDER / run_id


def which_of(keep_model: str) -> tuple[str, ...]:
    """The models ``training.keep_model`` keeps: ``final+best`` -> ``("final", "best")``, ``none`` -> ``()``."""
    return () if keep_model == "none" else tuple(w for w in WHICH if w in keep_model.split("+"))


def file_names(which: str) -> tuple[str, str, str, str]:
    """(global tensors, global JSON, deployed tensors, deployed JSON) of one kept model (:meth:`ModelKeeper.write`
    writes the deployed ones first and the global JSON last: it binds the others by their digests)."""
    return f"{which}.safetensors", f"{which}.json", f"{which}.deployed.safetensors", f"{which}.deployed.json"


KEPT_NAMES = tuple(n for w in WHICH for n in file_names(w))
#: What each kept file holds (docs/reference/results.md#kept-models is generated from this).
KEPT_FILES: dict[str, str] = {
    "<which>.safetensors": "the global model (the server's parameters after the model's round): one float32 tensor per "
                           "floating-point parameter and buffer, named as the model's state_dict() names them",
    "<which>.json": "what the model is: run_id, which, round, config_hash and the stored config, algorithm, dataset, "
                    "model, width_mult, num_classes, input_shape, input_kind, input_transform, the metric that selected "
                    "it (name, eval_mode, value), evaluated_as (the eval mode whose recorded figures it reproduces), the "
                    "layout's digest, and the digests binding it to its tensors (json_digest, tensors_digest)",
    "<which>.deployed.safetensors": "the deployed parts of the clients the run evaluates (training.eval_clients), "
                                    "deduplicated: mask.<j> (a parameter mask, packed bits) and values.<i> (a client's "
                                    "own values at its mask's coordinates)",
    "<which>.deployed.json": "per client: its domain, which values and mask it runs (null: the global model's, every "
                             "coordinate), its sample count, label counts and training data digest; the BN rule (bn, "
                             "recalibrate_bn) and training.submodel the run evaluated them with",
}


def kept_models(out: str | Path, run_id: str) -> list[Path]:
    """The files run ``run_id`` keeps in the results folder ``out`` (for trackers and copies), sorted; [] when
    it keeps none. Each entry is checked by the folder's door (a link or a folder in its place is refused)."""
    d = OutDir(out)
    where = folder(d.abs, check_run_id(run_id, "run_id"))
    if not d.is_dir(where):
        return []
    return sorted(d.check(where / n) for n in d.listdir(where) if n in KEPT_NAMES and d.is_file(where / n))


def remove_temp_files(out: Path, run_id: str) -> list[Path]:
    """Temporary files a killed writer of this run left in its models folder (call under the run's claim)."""
    d = OutDir(out)
    where = folder(out, run_id)
    if not d.is_dir(where):
        return []
    gone = d.glob(where, ".*.tmp")
    for f in gone:
        d.unlink(f)
    return gone


# ------------------------------------------------------------------------------------------------ files
def _write_tensors(d: OutDir, path: Path, arrays: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> None:
    from safetensors.numpy import save

    data = save({k: np.ascontiguousarray(v) for k, v in arrays.items()}, metadata=dict(meta))
    with d.atomic_write(path) as f:
        f.write(data)


def _write_json(d: OutDir, path: Path, doc: dict[str, Any]) -> None:
    """``doc`` with its own digest (``json_digest``: over every other key), sorted keys, one stable text."""
    body = {k: v for k, v in doc.items() if k != "json_digest"}
    text = json.dumps({**body, "json_digest": json_digest(body)}, sort_keys=True, indent=1, allow_nan=False)
    with d.atomic_write(path) as f:
        f.write(text.encode() + b"\n")


def _read_json(d: OutDir, path: Path, *, kind: str, run_id: str, which: str) -> dict[str, Any]:
    """A kept JSON file, its digest and identity checked (:class:`KeptModelError` naming it otherwise)."""
    shown = d.show(d.check(path, FILE))
    try:
        doc = json.loads(d.read_bytes(path))
    except (ValueError, UnicodeDecodeError) as e:
        raise KeptModelError(f"{shown} is not readable JSON ({e.__class__.__name__}): damaged; {AFRESH}") from e
    if not isinstance(doc, dict) or doc.get("kind") != kind:
        raise KeptModelError(f"{shown} is not a {kind} file; {AFRESH}")
    body = {k: v for k, v in doc.items() if k != "json_digest"}
    try:
        ok = doc.get("json_digest") == json_digest(body)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise KeptModelError(f"{shown} was changed after the run wrote it (its digest does not match): damaged, "
                             f"or edited; {AFRESH}")
    if doc.get("format") != FORMAT:
        raise KeptModelError(f"{shown} has format {doc.get('format')!r}; this version reads format {FORMAT}")
    if doc.get("run_id") != run_id or doc.get("which") != which:
        raise KeptModelError(f"{shown} is the {doc.get('which')!r} model of run {doc.get('run_id')!r}, not the "
                             f"{which!r} model of run {run_id!r}: it was copied here; {AFRESH}")
    return doc


def _read_tensors(d: OutDir, path: Path, digest: Any) -> dict[str, np.ndarray]:
    """A kept safetensors file whose tensors' digest must be ``digest`` (:class:`KeptModelError` otherwise)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    shown = d.show(d.check(path, FILE))
    if d.kind_of(path) is None:
        raise KeptModelError(f"{shown} is missing (its JSON is there); {AFRESH}")
    try:
        arrays = load(d.read_bytes(path))
    except (SafetensorError, ValueError, OverflowError, MemoryError) as e:
        raise KeptModelError(f"{shown} is not a readable safetensors file ({e.__class__.__name__}): truncated or "
                             f"damaged; {AFRESH}") from e
    if arrays_digest(arrays) != digest:
        raise KeptModelError(f"{shown} does not hold the tensors its JSON names (digest mismatch): "
                             f"damaged, replaced or edited; {AFRESH}")
    return arrays


@dataclass(frozen=True)
class Kept:
    """One kept model as read back, every digest checked: the global JSON and tensors, and the deployed ones
    (None when the run kept none, e.g. a model kept before this format kept them)."""

    meta: dict[str, Any]
    tensors: dict[str, np.ndarray]
    deployed: dict[str, Any] | None = None
    deployed_tensors: dict[str, np.ndarray] = field(default_factory=dict)


def read_kept(out: str | Path, run_id: str, which: str = "final", *, deployed: bool = False) -> Kept:
    """Run ``run_id``'s kept ``which`` model in ``out``, checked (:class:`KeptModelError` naming the problem:
    an unknown run, a model it did not keep, a file damaged, edited or copied from elsewhere);
    ``deployed``: read and check the clients' deployed parts too."""
    if which not in WHICH:
        raise KeptModelError(f"invalid which={which!r}: allowed values are {', '.join(WHICH)}")
    d = OutDir(out)
    run_id = check_run_id(run_id, "run_id")
    where = folder(d.abs, run_id)
    g_tensors, g_json, p_tensors, p_json = (where / n for n in file_names(which))
    if not d.is_dir(where) or d.kind_of(g_json) is None:
        raise KeptModelError(_not_kept(d, out, run_id, which))
    meta = _read_json(d, g_json, kind=KIND, run_id=run_id, which=which)
    tensors = _read_tensors(d, g_tensors, meta.get("tensors_digest"))
    if not deployed:
        return Kept(meta, tensors)
    if d.kind_of(p_json) is None:
        raise KeptModelError(f"run {run_id} kept no deployed models beside its {which} model "
                             f"({d.show(d.check(p_json))} is missing); {AFRESH}")
    dep = _read_json(d, p_json, kind=DEPLOYED_KIND, run_id=run_id, which=which)
    if dep.get("global_tensors_digest") != meta.get("tensors_digest") or dep.get("round") != meta.get("round"):
        raise KeptModelError(f"{d.show(d.check(p_json))} belongs to another {which} model of run {run_id} than "
                             f"{d.show(d.check(g_json))} (round {dep.get('round')!r}, not {meta.get('round')!r}); {AFRESH}")
    return Kept(meta, tensors, dep, _read_tensors(d, p_tensors, dep.get("tensors_digest")))


def _not_kept(d: OutDir, out: str | Path, run_id: str, which: str) -> str:
    """Why run ``run_id`` has no kept ``which`` model: no such run, or it kept others (or none)."""
    runs_file = d.abs / "runs" / f"{run_id}.parquet"
    where = folder(d.abs, run_id)
    have = [w for w in WHICH if d.is_dir(where) and d.kind_of(where / f"{w}.json") is not None]
    if not have and not d.is_file(runs_file):
        fs, base = filesystem(d.abs)
        compacted = d.is_dir(d.abs / "runs") and any(run_id in run_ids(fs, c.path)
                                                     for c in list_table(fs, base, "runs").compacted)
        if not compacted:
            return f"invalid run_id={run_id!r}: no run with that id in {out}"
    if have:
        return (f"invalid which={which!r}: run {run_id} kept only its {' and '.join(have)} model "
                "(training.keep_model decides which models a run keeps)")
    return (f"invalid run_id={run_id!r}: run {run_id} kept no model in {out}/{FOLDER} (it ran with "
            "training.keep_model=none, has not finished, or was made before models were kept)")


# ------------------------------------------------------------------------------------------- building
def global_arrays(layout: ParamLayout, params: np.ndarray) -> dict[str, np.ndarray]:
    """The global model's tensors: each floating-point entry of the layout in its own shape (views of ``params``)."""
    return {name: layout.slice(name, params) for name in layout.names}


def layout_digest(layout: ParamLayout) -> str:
    """The digest of a layout's tensor names and shapes, in order: a kept model loads only into this layout."""
    return json_digest([[n, list(s)] for n, s in zip(layout.names, layout.shapes)])


def flat_params(layout: ParamLayout, tensors: Mapping[str, np.ndarray], shown: str) -> np.ndarray:
    """The flat float32 vector of a kept model's tensors in ``layout`` (refused when they do not fit it)."""
    if set(tensors) != set(layout.names):
        missing, extra = sorted(set(layout.names) - set(tensors)), sorted(set(tensors) - set(layout.names))
        raise KeptModelError(f"{shown} does not fit the model its JSON names (missing {missing[:3]}, extra "
                             f"{extra[:3]}); {AFRESH}")
    out = np.empty(layout.size, dtype=np.float32)
    for name, off, shape in zip(layout.names, layout.offsets, layout.shapes):
        t = tensors[name]
        if t.dtype != np.float32 or tuple(t.shape) != shape:
            raise KeptModelError(f"{shown}: tensor {name} is {t.dtype} {tuple(t.shape)}, the model's is float32 "
                                 f"{shape}; {AFRESH}")
        out[off:off + t.size] = t.reshape(-1)
    return out


@dataclass(frozen=True)
class ClientModel:
    """What one client of the deployed sample runs: full-size ``params`` restricted to ``mask`` (None: all)."""

    client_id: int
    domain: str
    params: np.ndarray
    mask: np.ndarray | None


def pack_deployed(global_params: np.ndarray, models: Sequence[ClientModel]) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """(tensors, one entry per client) of the deployed parts, deduplicated: each distinct mask once as packed
    bits (``mask.<j>``, uint8), each distinct vector once at its mask's coordinates only (``values.<i>``,
    float32; none for a client whose values there are the global model's). Uncovered coordinates are never
    stored: the deployed model zeroes them (:func:`fedsap_ray.engine.evaluate.masked`)."""
    from fedsap_ray.engine.evaluate import digest

    tensors: dict[str, np.ndarray] = {}
    masks: dict[bytes, int] = {}
    values: dict[tuple[bytes, int | None], int] = {}
    seen: dict[tuple[int, int], tuple[int | None, int | None]] = {}  # (id(params), id(mask)) -> refs: shared objects once
    entries = []
    for m in models:
        ident = (id(m.params), id(m.mask))
        if ident not in seen:
            j = None
            if m.mask is not None:
                bits = np.packbits(np.asarray(m.mask, dtype=bool))
                j = masks.setdefault(digest(bits), len(masks))
                tensors.setdefault(f"mask.{j}", bits)
            own = m.params if m.mask is None else m.params[m.mask]
            glob = global_params if m.mask is None else global_params[m.mask]
            i = None
            if m.params is not global_params and not np.array_equal(own, glob):
                i = values.setdefault((digest(own), j), len(values))
                tensors.setdefault(f"values.{i}", np.ascontiguousarray(own, dtype=np.float32))
            seen[ident] = (i, j)
        i, j = seen[ident]
        entries.append({"client": int(m.client_id), "domain": m.domain, "values": i, "mask": j})
    return tensors, entries


def unpack_deployed(dep: Mapping[str, Any], tensors: Mapping[str, np.ndarray], global_params: np.ndarray,
                    client: int, shown: str) -> tuple[dict[str, Any], np.ndarray, np.ndarray | None]:
    """(the client's entry, its full-size vector with uncovered coordinates zeroed, its mask or None)."""
    entries = {e.get("client"): e for e in dep.get("clients", []) if isinstance(e, dict)}
    if client not in entries:
        ids = sorted(c for c in entries if isinstance(c, int))
        raise KeptModelError(f"invalid client={client!r}: run {dep.get('run_id')} kept the deployed models of clients "
                             f"{_ids(ids)} only (its deployed sample, training.eval_clients)")
    e = entries[client]
    size = int(global_params.size)
    mask = None
    if e.get("mask") is not None:
        bits = tensors.get(f"mask.{e['mask']}")
        if bits is None or bits.dtype != np.uint8 or bits.size != (size + 7) // 8:
            raise KeptModelError(f"{shown}: client {client}'s mask is missing or of the wrong size; {AFRESH}")
        mask = np.unpackbits(bits, count=size).astype(bool)
    own = global_params if mask is None else global_params[mask]
    if e.get("values") is not None:
        own = tensors.get(f"values.{e['values']}")
        want = size if mask is None else int(mask.sum())
        if own is None or own.dtype != np.float32 or own.shape != (want,):
            raise KeptModelError(f"{shown}: client {client}'s parameters are missing or of the wrong size; {AFRESH}")
    if mask is None:
        return e, np.array(own, dtype=np.float32, copy=True), None
    full = np.zeros(size, dtype=np.float32)
    full[mask] = own
    return e, full, mask


def _ids(ids: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    if not ids:
        return "none"
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


# ------------------------------------------------------------------------------------------ the keeper
class ModelKeeper:
    """Writes one run's kept models (module docstring): ``best`` from :meth:`after_round`, ``final`` from
    :meth:`at_end`; :meth:`check_resume` checks a resumed run's kept ``best`` against its checkpoint.

    ``kept`` (which -> round) is what the ``runs`` row's ``models_kept`` column records."""

    def __init__(self, out: Path, run_id: str, ctx: Any, strategy: Any, deployed_clients: Sequence[int]) -> None:
        self.out, self.run_id, self.ctx, self.strategy = Path(out), run_id, ctx, strategy
        self.which = which_of(ctx.cfg.training.keep_model)
        self.deployed_clients = list(deployed_clients)
        self.kept: dict[str, int] = {}
        self._data_digests: dict[int, str] | None = None

    @property
    def dir(self) -> OutDir:
        return OutDir(self.out)

    def models_kept(self) -> str:
        """The ``runs.models_kept`` value: JSON of which -> round, e.g. ``{"best": 2, "final": 3}``."""
        return json.dumps(self.kept, sort_keys=True)

    def start_fresh(self) -> None:
        """A run that starts from round 0 keeps nothing of an earlier attempt under its id (a sweep's rerun)."""
        d = self.dir
        where = folder(self.out, self.run_id)
        if d.is_dir(where):
            for name in d.listdir(where):
                if name in KEPT_NAMES:
                    d.unlink(where / name)

    def after_round(self, state: Any, improved: bool, recorder: Any, config_json: str) -> None:
        """After round ``state.round`` (before its checkpoint): keep ``best`` when the round improved it."""
        if "best" in self.which and improved:
            self.write("best", state, recorder.primary_mode, recorder.best, config_json)

    def at_end(self, state: Any, recorder: Any, config_json: str) -> None:
        """When the run ends ``finished`` or ``stopped`` (before its runs row says so): keep ``final``."""
        if "final" in self.which and state is not None and state.round >= 1:
            self.write("final", state, recorder.primary_mode, recorder.last_global, config_json)

    def check_resume(self, done: int, server_metrics: Mapping[str, Any], where: str) -> None:
        """Before a resume from round ``done`` changes anything: the run's kept ``best`` is the one its checkpoint
        counted (its round at most ``done`` and its figure the checkpoint's best), or one the round after wrote
        before it was checkpointed (the resume trains that round again and keeps it again). A ``final`` model
        (of a stopped run) is noted; the resumed run replaces it."""
        d = self.dir
        where_models = folder(self.out, self.run_id)
        primary = server_metrics.get("primary_mode")
        best = (server_metrics.get("best_by_mode") or {}).get(primary) if primary is not None else None
        for which in WHICH:
            present = d.is_dir(where_models) and d.kind_of(where_models / f"{which}.json") is not None
            if which == "final" or "best" not in self.which:
                if present:
                    try:
                        self.kept[which] = int(read_kept(self.out, self.run_id, which).meta["round"])
                    except KeptModelError:
                        pass  # replaced before it is ever read: the resumed run writes its own
                continue
            if best is None or (isinstance(best, float) and math.isnan(best)):
                continue  # nothing evaluated yet: no best model to have
            if not present:
                raise ConfigError(f"{where}: the run keeps its best model (training.keep_model="
                                  f"{self.ctx.cfg.training.keep_model}) but {where_models / 'best.json'} is missing; "
                                  f"{AFRESH}")
            try:
                meta = read_kept(self.out, self.run_id, "best", deployed=True).meta
            except KeptModelError as e:
                raise ConfigError(f"{where}: {e}") from e
            rnd, value = meta.get("round"), (meta.get("metric") or {}).get("value")
            if not (isinstance(rnd, int) and (rnd == done + 1 or (rnd <= done and value == best))):
                raise ConfigError(f"{where}: {where_models / 'best.json'} is the model of round {rnd!r} (global "
                                  f"accuracy {value!r}), not the best the checkpoint counted ({best!r} by round "
                                  f"{done}); {AFRESH}")
            if rnd <= done:
                self.kept["best"] = rnd

    # ---------------------------------------------------------------------------------------- writing
    def write(self, which: str, state: Any, mode: str | None, value: float, config_json: str) -> None:
        """Keep ``state``'s global model and its clients' deployed parts as ``which`` (JSON files last)."""
        ctx, d = self.ctx, self.dir
        where = folder(self.out, self.run_id)
        g_tensors, g_json, p_tensors, p_json = (where / n for n in file_names(which))
        params = state.params
        arrays = global_arrays(ctx.layout, params)
        tensors_digest = arrays_digest(arrays)
        dep_arrays, entries = pack_deployed(params, [
            ClientModel(cid, ctx.federation.clients[cid].domain, *self.strategy.deployed_model(state, cid))
            for cid in self.deployed_clients])
        digests = self.data_digests()
        fed = ctx.federation
        for e in entries:
            c = fed.clients[e["client"]]
            e.update(n_samples=c.n_samples, data_digest=digests.get(c.client_id),
                     label_counts=[int(v) for v in c.label_counts])
        cfg = ctx.cfg
        common = {"format": FORMAT, "run_id": self.run_id, "which": which, "round": int(state.round),
                  "config_hash": cfg.config_hash()}
        dep = {**common, "kind": DEPLOYED_KIND, "file": p_tensors.name, "global_tensors_digest": tensors_digest,
               "bn": cfg.training.deployed_bn, "recalibrate_bn": bool(digests), "submodel": cfg.training.submodel,
               "label_weighted": len(fed.domains) == 1, "layout_size": int(ctx.layout.size),
               "clients": entries, "tensors_digest": arrays_digest(dep_arrays),
               "meaning": ("each client's deployed model: the global model (values null) or its own values at its "
                           "mask (mask null: every coordinate), uncovered coordinates zero; recalibrate_bn: its BN "
                           "statistics are recomputed on the client's own training data (data_digest) when loaded")}
        meta = {**common, "kind": KIND, "file": g_tensors.name, "config": json.loads(config_json),
                "algorithm": cfg.algorithm.name, "dataset": fed.dataset, "model": cfg.model.name,
                "width_mult": cfg.model.width_mult, "num_classes": int(fed.num_classes),
                "input_shape": [int(s) for s in fed.input_shape], "input_kind": fed.input_kind,
                "vocab_size": fed.vocab_size, "input_transform": INPUT_TRANSFORM,
                "metric": {"name": "global_accuracy", "eval_mode": mode, "value": _finite(value),
                           "selected": BEST_RULE if which == "best" else FINAL_RULE},
                "evaluated_as": self.evaluated_as(state),
                "layout": {"digest": layout_digest(ctx.layout), "tensors": len(ctx.layout.names),
                           "size": int(ctx.layout.size)},
                "tensors_digest": tensors_digest, "deployed": p_json.name}
        # one metadata key: safetensors writes its metadata map in an order that differs from process to process,
        # and a resumed run must keep the very bytes an uninterrupted one keeps (what it is: the JSON beside it)
        meta_tensors = {"format": "pt"}
        d.mkdir(where)
        _write_tensors(d, p_tensors, dep_arrays, meta_tensors)
        _write_json(d, p_json, dep)
        _write_tensors(d, g_tensors, arrays, meta_tensors)
        _write_json(d, g_json, meta)
        self.kept[which] = int(state.round)

    def evaluated_as(self, state: Any) -> str | None:
        """The eval mode whose models are the global model on every test domain (``global``; FedSAP's
        ``global_only``): the mode whose recorded figures ``fedsap-ray evaluate`` reproduces; None when none is."""
        sets = self.strategy.eval_sets(state, self.ctx.federation.eval_domains())
        for mode, per in sets.items():
            if all(v is state.params or np.array_equal(v, state.params) for v in per.values()):
                return str(mode)
        return None

    def data_digests(self) -> dict[int, str]:
        """Per client of the deployed sample, the digest of its training data when its deployed model's BN
        statistics are recomputed on it (``deployed_bn=client`` and a model with BatchNorm); {} otherwise."""
        if self._data_digests is None:
            from fedsap_ray.engine.evaluate import has_batchnorm

            ctx = self.ctx
            self._data_digests = {}
            if ctx.cfg.training.deployed_bn == "client" and has_batchnorm(ctx.model):
                for cid in self.deployed_clients:
                    self._data_digests[cid] = data_digest(ctx.federation.client_data(cid))
        return self._data_digests


def data_digest(data: Any) -> str:
    """The digest of one client's training data (its samples and labels, as stored)."""
    return arrays_digest({"x": data.x.numpy(), "y": data.y.numpy()})


def _finite(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


# ------------------------------------------------------------------------------------------- loading
def stored_config(kept: Kept, shown: str, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """The run's config rebuilt from the kept JSON (as ``--resume`` rebuilds it), ``overrides`` applied; refused
    when, without overrides, it no longer hashes as the run's (this version builds it differently)."""
    from fedsap_ray.config.build import build_config

    stored = kept.meta.get("config")
    if not isinstance(stored, dict):
        raise KeptModelError(f"{shown} holds no config; {AFRESH}")
    cfg = build_config(file_data=stored, overrides=list(overrides))
    if not overrides and cfg.config_hash() != kept.meta.get("config_hash"):
        raise KeptModelError(f"{shown}: the run's stored config builds another config in this version of fedsap_ray "
                             f"(hash {cfg.config_hash()}, the run's {kept.meta.get('config_hash')}): load it with the "
                             "version that ran it")
    return cfg


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` (the run's ``resources.torch_threads``: part of its evaluation
    numerics) for the block, put back after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _global_model(kept: Kept, shown: str) -> tuple[nn.Module, ParamLayout, np.ndarray]:
    """(the model built as the JSON says, its layout, the kept flat vector), checked against the layout digest."""
    import torch

    from fedsap_ray.models.masks import ParamLayout
    from fedsap_ray.models import build_model

    m = kept.meta
    try:
        with torch.random.fork_rng(devices=[]):  # the weights are overwritten: the global RNG must not move
            model = build_model(str(m["model"]), num_classes=int(m["num_classes"]), input_shape=tuple(m["input_shape"]),
                                width_mult=float(m["width_mult"]), vocab_size=m.get("vocab_size"))
    except (KeyError, TypeError, ValueError) as e:
        raise KeptModelError(f"{shown} names a model this version cannot build ({e.__class__.__name__}: {e}); "
                             f"{AFRESH}") from e
    layout = ParamLayout.from_model(model)
    if (m.get("layout") or {}).get("digest") != layout_digest(layout):
        raise KeptModelError(f"{shown}: model {m['model']} at width {m['width_mult']} has another layout in this "
                             "version of fedsap_ray than the run's: load it with the version that ran it")
    return model, layout, flat_params(layout, kept.tensors, shown.replace(".json", ".safetensors"))


@dataclass
class DeployedParts:
    """Client K's deployed model, ready to run: its network, layout and flat vector, as the run evaluated it."""

    net: Any
    layout: Any
    vec: np.ndarray
    entry: dict[str, Any]
    cfg: Any


def deployed_parts(kept: Kept, client: int, *, device: torch.device | None = None, sliced: bool = True,
                   federation: Any = None) -> DeployedParts:
    """Client ``client``'s deployed network (:func:`fedsap_ray.engine.evaluate.deployed_network`, the function the run's
    deployed evaluation calls), BN statistics recomputed on its own training data when the run did: the
    federation is rebuilt from the stored config (``federation``: one the caller built so) and the client's
    data checked against its kept digest."""
    import torch

    from fedsap_ray.engine.evaluate import DeployedModel, deployed_network

    assert kept.deployed is not None
    run_id, which = kept.meta["run_id"], kept.meta["which"]
    shown = f"{FOLDER}/{run_id}/{which}.deployed.json"
    model, layout, vec = _global_model(kept, f"{FOLDER}/{run_id}/{which}.json")
    entry, params, mask = unpack_deployed(kept.deployed, kept.deployed_tensors, vec, client,
                                          f"{FOLDER}/{run_id}/{which}.deployed.safetensors")
    cfg = stored_config(kept, f"{FOLDER}/{run_id}/{which}.json")
    bn_data = None
    if kept.deployed.get("recalibrate_bn"):
        from fedsap_ray.data import build_federation

        fed = federation if federation is not None else build_federation(cfg)
        if client >= len(fed.clients) or data_digest(fed.client_data(client)) != entry.get("data_digest"):
            raise KeptModelError(f"{shown}: client {client}'s training data, on which its BN statistics are "
                                 "recomputed, is not what the run's stored config builds now (the run was given a "
                                 "federation of its own, or the dataset's files changed); the deployed model cannot "
                                 "be rebuilt exactly")
        bn_data = fed.client_data(client)
    dev = device if device is not None else torch.device("cpu")
    with torch_threads(cfg.resources.torch_threads):
        net, net_layout, v = deployed_network(model, layout, DeployedModel(client, str(entry.get("domain")), params, mask),
                                              dev, bn_data, sliced=sliced)
    return DeployedParts(net, net_layout, v, entry, cfg)


def load_model(out: str | Path, run_id: str, which: str = "final", client: int | None = None, *,
               device: torch.device | str | None = None) -> nn.Module:
    """A kept model of run ``run_id`` in the results folder ``out`` as a ``torch.nn.Module`` in eval mode.

    ``client=None``: the global model (the server's parameters after round ``meta['round']``). ``client=K``:
    the model client K deploys, as the run's deployed evaluation ran it: the dense sliced sub-network
    (:func:`fedsap_ray.models.sliced.sliced_model`, the network a device of its width runs, not the masked full
    one) when a channel set describes its mask, else the full-size network with the uncovered coordinates
    zeroed; under ``training.deployed_bn=client`` its BN statistics are recomputed on K's own training data
    (:func:`fedsap_ray.engine.evaluate.calibrate_bn_`) with the run's ``resources.torch_threads``, from the
    federation rebuilt out of the stored config (refused when K's data is not what the run used). On
    ``device`` (default: CPU; figures equal the run's on the device kind it ran on).

    Inputs: nothing is attached to the module. It takes what :func:`fedsap_ray.data.as_input` makes of stored
    samples (uint8 images mapped to float32 in [-1, 1]; float features and int64 token ids as stored), named
    in the model's JSON (``input_transform``) and given by :func:`fedsap_ray.data.input_transform`.

    Refused (:class:`KeptModelError`, one line): an unknown run, a ``which`` the run did not keep, a client
    outside the run's deployed sample, a damaged, edited or copied file (every digest is checked first).
    """
    import torch

    kept = read_kept(out, run_id, which, deployed=client is not None)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if client is None:
        model, layout, vec = _global_model(kept, f"{FOLDER}/{kept.meta['run_id']}/{which}.json")
        model.to(dev)
        layout.load_into(model, vec)
        return model.eval()
    if not isinstance(client, int) or isinstance(client, bool):
        raise KeptModelError(f"invalid client={client!r}: must be a client id (an integer)")
    parts = deployed_parts(kept, client, device=dev)
    parts.net.to(dev)
    parts.layout.load_into(parts.net, parts.vec)
    return parts.net.eval()


# ----------------------------------------------------------------------------------------- evaluating
@dataclass(frozen=True)
class DomainFigures:
    """One row of ``fedsap-ray evaluate``'s table: a test domain, its samples, top-1 accuracy and mean loss."""

    domain: str
    n: int
    accuracy: float
    loss: float


@dataclass(frozen=True)
class KeptEvaluation:
    """What :func:`evaluate_kept` measured: per test domain, their unweighted mean (as ``rounds``' global row),
    and for a client on the run's own data its figure as the run records it (``own``: on its own domain;
    reweighted to its training labels in a one-domain federation, fedsap_ray.engine.evaluate's docstring)."""

    meta: dict[str, Any]
    client: int | None
    dataset: str
    rows: list[DomainFigures]
    mean: tuple[float, float]
    own: DomainFigures | None = None
    own_weighted: bool = False  # own is reweighted to the client's training labels (a one-domain federation)
    overrides: tuple[str, ...] = ()


def check_data_overrides(overrides: Sequence[str]) -> None:
    """``--set`` of ``fedsap-ray evaluate`` may only choose the test data (``data.*``): the model is the run's."""
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        if "=" not in text or not key.startswith("data.") or key == "data.":
            raise KeptModelError(f"invalid --set {text!r}: fedsap-ray evaluate takes data.KEY=VALUE overrides only "
                                 "(which test data; the model and its training are the run's)")


def check_fits(meta: Mapping[str, Any], fed: Any, cfg: ExperimentConfig, overrides: Sequence[str]) -> None:
    """Test data chosen by ``overrides`` must have the classes and input shape the kept model takes."""
    want = (int(meta["num_classes"]), tuple(meta["input_shape"]), meta.get("vocab_size"))
    if (fed.num_classes, tuple(fed.input_shape), fed.vocab_size) != want:
        raise KeptModelError(f"invalid --set {' '.join(overrides)}: data.name={cfg.data.name} gives {fed.num_classes} "
                             f"classes of {fed.input_kind} inputs of shape {tuple(fed.input_shape)}; the run's "
                             f"{meta['model']} takes {want[0]} classes of inputs of shape {want[1]}")


def evaluate_kept(out: str | Path, run_id: str, which: str = "final", client: int | None = None,
                  overrides: Sequence[str] = (), *, device: torch.device | None = None) -> KeptEvaluation:
    """Evaluate a kept model (:func:`load_model`'s) on the test splits of the run's data, or of the data
    ``overrides`` (``data.*`` settings: another registered dataset, other domains, another cap) choose, with
    the functions the run evaluated with: :func:`fedsap_ray.engine.evaluate.evaluate` for the global model (the eval
    mode of ``meta['evaluated_as']``), :func:`fedsap_ray.engine.evaluate.deployed_network` and
    :func:`~fedsap_ray.engine.evaluate.evaluate_by_class` for client K's deployed model (as the run ran it: sliced
    under ``training.submodel=sliced``, BN per ``training.deployed_bn``), with the run's torch threads on the
    run's device choice. On the run's own data the figures are the recorded ones, bit for bit (on the device
    kind and CPU kernels it ran with: docs/architecture.md#determinism)."""
    from fedsap_ray.engine.client import pick_device
    from fedsap_ray.data import build_federation
    from fedsap_ray.engine.evaluate import client_figures, evaluate, evaluate_by_class, summarise

    check_data_overrides(overrides)
    kept = read_kept(out, run_id, which, deployed=client is not None)
    meta = kept.meta
    shown = f"{FOLDER}/{meta['run_id']}/{which}.json"
    cfg_run = stored_config(kept, shown)
    cfg = stored_config(kept, shown, overrides) if overrides else cfg_run
    fed = build_federation(cfg)
    check_fits(meta, fed, cfg, overrides)
    dev = device if device is not None else pick_device(cfg_run.resources.device)
    figures: dict[str, tuple[float, float]] = {}
    own, weights = None, None
    with torch_threads(cfg_run.resources.torch_threads):
        if client is None:
            model, layout, vec = _global_model(kept, shown)
            for d in fed.test:
                figures[d] = evaluate(model, layout, vec, fed.test[d], dev)
        else:
            parts = deployed_parts(kept, client, device=dev, sliced=cfg_run.training.submodel == "sliced",
                                   federation=None if overrides else fed)
            tables = {d: evaluate_by_class(parts.net, parts.layout, parts.vec, fed.test[d], dev, fed.num_classes)
                      for d in fed.test}
            figures = {d: client_figures(t) for d, t in tables.items()}
            home = str(parts.entry.get("domain"))
            if not overrides and home in tables:
                assert kept.deployed is not None
                weights = (np.asarray(parts.entry.get("label_counts"), dtype=np.int64)
                           if kept.deployed.get("label_weighted") else None)
                own = DomainFigures(home, len(fed.test[home]), *client_figures(tables[home], weights))
    rows = [DomainFigures(d, len(fed.test[d]), a, loss) for d, (a, loss) in figures.items()]
    s = summarise(figures) if figures else {"global_accuracy": float("nan"), "loss": float("nan")}
    return KeptEvaluation(meta=meta, client=client, dataset=fed.dataset, rows=rows, mean=(s["global_accuracy"], s["loss"]),
                          own=own, own_weighted=own is not None and weights is not None, overrides=tuple(overrides))


# ------------------------------------------------------------------------------------------ a sweep's plan
def model_size(cfg: ExperimentConfig) -> int:
    """Entries of ``cfg``'s model (its flat layout's size) on its dataset: loads the dataset's splits (cached per
    process, :func:`fedsap_ray.data.load_splits`) for its classes and input shape, and builds the model once."""
    import torch

    from fedsap_ray.data.federation import NATIVE_INPUT, load_splits
    from fedsap_ray.models.masks import ParamLayout
    from fedsap_ray.models import build_model

    splits = load_splits(cfg)
    shape = NATIVE_INPUT.get((cfg.data.name, cfg.model.name), tuple(splits.input_shape))
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg.model.name, num_classes=splits.num_classes, input_shape=shape,
                            width_mult=cfg.model.width_mult, vocab_size=splits.vocab_size)
    return ParamLayout.from_model(model).size


def plan_line(cfgs: Sequence[ExperimentConfig]) -> str:
    """What a sweep of runs ``cfgs`` will keep (printed before it starts): how many models, about how many bytes
    of global models, and at most how many more for the clients' deployed parts (every evaluated client's own
    values and mask: what FedSAP or FedSPU need; nested-width clients share the global values, only their masks
    are stored, so they take far less)."""
    n = sum(len(which_of(c.training.keep_model)) for c in cfgs)
    if not n:
        return "keeps no models (training.keep_model=none)"
    modes = sorted({c.training.keep_model for c in cfgs})
    sizes: dict[tuple[Any, ...], int] = {}
    glob = deployed = 0
    try:
        for c in cfgs:
            key = (c.data.name, c.data.root, c.data.download, c.model.name, c.model.width_mult)
            if key not in sizes:
                sizes[key] = model_size(c)
            k = len(which_of(c.training.keep_model))
            clients = min(c.training.eval_clients, c.data.num_clients)
            glob += k * 4 * sizes[key]
            deployed += k * clients * (4 * sizes[key] + (sizes[key] + 7) // 8)
    except Exception as e:  # the data cannot be read here (not downloaded, another node's path): say so, go on
        return (f"keeps {n} models (training.keep_model={', '.join(modes)}; size unknown here: "
                f"{e.__class__.__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    return (f"keeps {n} models (training.keep_model={', '.join(modes)}) under models/: about {_mb(glob)} of global "
            f"models, plus at most {_mb(deployed)} for the clients' deployed parts")


def _mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"
