"""A checkpoint's content against the run it would resume: checked whole before a resume deletes or
writes anything (:class:`fedsap_ray.run.session.RunSession`), so a damaged or edited checkpoint is refused
with one line (exit 2) instead of an IndexError in round t+1 or, worse, a silent retraining from a wrong
state.

What is checked, and why it is enough to catch an edit without knowing each strategy's meaning:

- the parameter vector: 1-D float32 of exactly the model's length, every value finite (training never
  leaves a NaN in W: a NaN there means the file was changed or the run had already diverged);
- the strategy state against a *template*, the state the strategy starts from
  (``Strategy.init_state``): every field of the template is present; a field the template lacks is
  refused unless the strategy names it in ``Strategy.state_keys`` (state a method adds after its first
  round, as DapperFL's ``kept``); where the template holds a value, the checkpoint holds one of the same
  type (an array of the same dtype, number of axes and, for fixed-size arrays, shape); dicts keyed by
  ids have int keys in [0, clients); every array is numeric or boolean (a state never holds text);
- a dict the template holds empty is keyed by ids (ints) and holds one kind of value (one dtype and
  shape for every id); the fields a strategy names in ``Strategy.state_vectors`` hold model-sized
  vectors (or one per id), as long as the parameter vector;
- the server's running metrics against a fresh recorder's (``Recorder.metrics_state``), the same way;
- the table list and row counts: known per-round tables, counts that are non-negative integers.

Each refusal names the checkpoint's field path, e.g. ``strategy.states[3]``.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fedsap_ray.common.errors import ConfigError

NUMERIC_KINDS = "biuf"  # bool, int, uint, float: what model and strategy state are made of


class BadCheckpoint(ConfigError):
    """The checkpoint's content does not fit the run (one line naming the field)."""


def _type_name(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"a {v.dtype} array of shape {v.shape}"
    return type(v).__name__


def _scalar_ok(value: Any, template: Any) -> bool:
    if isinstance(template, bool) or isinstance(template, np.bool_):
        return isinstance(value, (bool, np.bool_))
    if isinstance(template, (int, np.integer)):
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if isinstance(template, (float, np.floating)):
        return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if isinstance(template, str):
        return isinstance(value, str)
    return True


class Checker:
    """Compares a loaded tree with a template tree (module docstring); ``fail`` raises naming the path."""

    def __init__(self, where: str, n_ids: int, ids: bool = False) -> None:
        """``ids``: a mapping below the top that the template holds empty is keyed by ids (ints), as every
        strategy's per-client and per-group state is; off for the server metrics (keyed by mode names)."""
        self.where, self.n_ids, self.ids = where, n_ids, ids

    def fail(self, path: str, what: str) -> BadCheckpoint:
        return BadCheckpoint(f"{self.where}: {path} {what}")

    def values(self, v: Any, path: str) -> None:
        """Rules every value obeys, template or not: numeric arrays, id keys in range, plain containers."""
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in NUMERIC_KINDS:
                raise self.fail(path, f"is {_type_name(v)}; state arrays are numeric or boolean")
        elif isinstance(v, Mapping):
            for k, x in v.items():
                if not isinstance(k, str):
                    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < self.n_ids:
                        raise self.fail(path, f"has the key {k!r}; keys are names or ids in [0, {self.n_ids})")
                self.values(x, f"{path}[{k!r}]" if not isinstance(k, str) else f"{path}.{k}")
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                self.values(x, f"{path}[{i}]")
        elif v is not None and not isinstance(v, (bool, int, float, str, np.generic)):
            raise self.fail(path, f"is {_type_name(v)}")

    def like(self, v: Any, t: Any, path: str, optional: Iterable[str] = (), top: bool = False) -> None:
        """``v`` has the template ``t``'s structure (fields, types, dtypes; module docstring). ``optional``:
        names that may be present or absent; ``top``: a state's own fields (a name the template lacks is
        refused even when the template is empty; deeper down an empty dict may gain names, e.g. modes)."""
        optional = tuple(optional)
        if t is None:  # filled later (e.g. an estimate before any client measured): any plain value
            self.values(v, path)
            return
        if isinstance(t, np.ndarray):
            if not isinstance(v, np.ndarray) or v.dtype != t.dtype or v.ndim != t.ndim:
                raise self.fail(path, f"is {_type_name(v)}; the run needs a {t.dtype} array with {t.ndim} axes")
            if v.shape != t.shape:
                raise self.fail(path, f"has shape {v.shape}; the run's is {t.shape}")
            self.values(v, path)
            return
        if isinstance(t, Mapping):
            if not isinstance(v, Mapping):
                raise self.fail(path, f"is {_type_name(v)}; the run needs a mapping")
            names = [k for k in t if isinstance(k, str)]
            missing = [k for k in names if k not in v and k not in optional]
            if missing:
                raise self.fail(f"{path}.{missing[0]}", "is missing")
            extra = [k for k in v if isinstance(k, str) and k not in t and k not in optional]
            if extra and (names or top):
                raise self.fail(f"{path}.{extra[0]}", "is not a field of this run's state")
            self.values(v, path)
            for k in names:
                if k in v:
                    self.like(v[k], t[k], f"{path}.{k}")
            ids = [k for k in t if not isinstance(k, str)]
            if ids:  # an id-keyed dict: each value like the template's first one
                proto = t[ids[0]]
                for k, x in v.items():
                    self.like(x, proto, f"{path}[{k!r}]")
            elif not names and not top:  # an id-keyed dict the template had empty
                if self.ids:
                    text = next((k for k in v if not isinstance(k, int) or isinstance(k, bool)), None)
                    if text is not None:
                        raise self.fail(path, f"has the key {text!r}; its keys are client or group ids (integers)")
                arrays = [(k, x) for k, x in v.items() if isinstance(x, np.ndarray)]
                for k, x in arrays[1:]:  # one kind of value per id: the same dtype and shape
                    first = arrays[0][1]
                    if x.dtype != first.dtype or x.shape != first.shape:
                        raise self.fail(f"{path}[{k!r}]", f"is {_type_name(x)}, unlike {path}[{arrays[0][0]!r}] "
                                                          f"({_type_name(first)})")
            return
        if isinstance(t, (list, tuple)):
            if not isinstance(v, (list, tuple)):
                raise self.fail(path, f"is {_type_name(v)}; the run needs a list")
            self.values(v, path)
            return
        if not _scalar_ok(v, t):
            raise self.fail(path, f"is {_type_name(v)} {v!r:.40}; the run needs a {type(t).__name__}")


def check_params(params: Any, n_params: int, where: str, name: str = "params") -> None:
    """A model's parameter vector: 1-D float32, ``n_params`` long, finite. ``name``: the checkpoint's field
    that holds it (``params``, or e.g. ``engine.bases[3]``, a version's model the asynchronous engine keeps)."""
    if not isinstance(params, np.ndarray) or params.dtype != np.float32 or params.ndim != 1:
        raise BadCheckpoint(f"{where}: {name} is {_type_name(params)}; the run needs a 1-D float32 vector")
    if params.size != n_params:
        raise BadCheckpoint(f"{where}: {name} holds {params.size} values; this run's model has {n_params}")
    bad = np.flatnonzero(~np.isfinite(params))
    if bad.size:
        raise BadCheckpoint(f"{where}: {name} holds {bad.size} non-finite value(s) (first at index {bad[0]}: "
                            f"{params[bad[0]]}); training never writes one")


def check_rows(tables: Any, rows: Any, known: Iterable[str], rounds_done: int, where: str) -> None:
    """The checkpoint's table list and row counts: known tables, counts per round 1..rounds_done."""
    known = list(known)
    if not isinstance(tables, list) or any(not isinstance(t, str) or t not in known for t in tables):
        raise BadCheckpoint(f"{where}: tables is {tables!r:.60}; a list of table names from {', '.join(known)}")
    if rows is None:
        return
    if not isinstance(rows, Mapping):
        raise BadCheckpoint(f"{where}: rows is {_type_name(rows)}; the run needs table -> round -> rows")
    for t, per in rows.items():
        if t not in known or not isinstance(per, Mapping):
            raise BadCheckpoint(f"{where}: rows.{t!s:.40} is not a table's row counts")
        for r, n in per.items():
            if (not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= rounds_done
                    or not isinstance(n, int) or isinstance(n, bool) or n < 0):
                raise BadCheckpoint(f"{where}: rows.{t}[{r!r:.20}] = {n!r:.20}; counts are rows >= 0 of rounds "
                                    f"1-{rounds_done}")


def check_state(ck: Mapping[str, Any], *, n_params: int, n_clients: int, strategy: Any, strategy_template: Mapping,
                recorder_template: Mapping, rounds: int, known_tables: Iterable[str], where: str) -> None:
    """Everything :mod:`this module <fedsap_ray.persist.statecheck>` checks, for a loaded checkpoint ``ck``;
    ``strategy_template``: the strategy's initial state as a checkpoint stores it (its ``state_keys`` and
    ``state_vectors`` are read from ``strategy``)."""
    st = ck["state"]
    if not 1 <= st.round <= rounds:
        raise BadCheckpoint(f"{where}: round is {st.round}; a checkpoint is written after rounds 1-{rounds}")
    check_params(st.params, n_params, where)
    c = Checker(where, n_clients, ids=True)
    if not isinstance(st.strategy_state, Mapping):
        raise c.fail("strategy", f"is {_type_name(st.strategy_state)}; a state is a mapping of fields")
    c.like(st.strategy_state, strategy_template, "strategy", optional=getattr(strategy, "state_keys", ()), top=True)
    for name in getattr(strategy, "state_vectors", ()):  # model-sized vectors, or one per id
        v = st.strategy_state.get(name)
        for key, x in (v.items() if isinstance(v, Mapping) else [(None, v)]):
            if isinstance(x, np.ndarray) and x.size != n_params:
                shown = f"strategy.{name}" + ("" if key is None else f"[{key!r}]")
                raise c.fail(shown, f"holds {x.size} values; this run's model has {n_params}")
    # sim_elapsed_s: checkpoints from before simulated device time lack it (the recorder reads 0)
    Checker(where, n_clients).like(ck["server"], dict(recorder_template), "server", optional=("sim_elapsed_s",),
                                   top=True)
    for k, v in ck["server"].get("best_by_mode", {}).items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isinf(v):
            raise c.fail(f"server.best_by_mode.{k}", f"is {v!r:.30}; an accuracy")
    check_rows(ck["tables"], ck.get("rows"), known_tables, st.round, where)
