"""Explicit partitions: each client's samples named by you, and the digest of the clients a run trains.

``data.partition=explicit`` with ``data.partition_file=PATH`` reads a JSON file mapping every client to its
samples; :class:`ExplicitPartition` is the same thing built in Python (by hand, or from a Flower Datasets
partitioner: :func:`fedsap_ray.data.flower.from_flower`), given to ``build_federation(cfg, partition=...)``.
The file (docs/guides/own-data.md#an-explicit-partition)::

    {"clients": [{"id": 0, "domain": "mnist", "indices": [0, 5, 9], "capacity": 0.5},
                 {"id": 1, "domain": "mnist", "indices": [1, 2, 3]}],
     "allow_overlap": false}

- ``id``: the client ids are exactly 0..N-1, each once, and N must equal ``data.num_clients`` (the config's
  other checks, participation among them, read it);
- ``domain``: the domain whose training split ``indices`` index (the dataset's own split, before any cap, so
  ``data.max_train_per_domain`` is refused with this partition); it may be left out when the dataset has one;
- ``indices``: a non-empty list of distinct sample positions in that split, in the order the client holds them;
  two clients share no sample unless the file says ``"allow_overlap": true``;
- ``capacity`` (optional): the client's capacity (kappa_i), in (0, 1]; it replaces what ``capacity.scheme`` gives that
  client (its ``pruning_ratio`` is then 1 - capacity, as under ``capacity.scheme=explicit``).

Every refusal is one :class:`~fedsap_ray.common.errors.ConfigError` line naming the file, the client (its id and its
position in the list) and the field, before any work: what the file alone can say when it is read, what needs
the data (domains, index ranges, overlaps) when the federation is built, before any round or any write.

Why a digest of what was trained (:func:`partition_digest`, ``runs.partition_hash``): the config names a
partition (a scheme, a file's path), not what it holds, and a run given a :class:`~fedsap_ray.data.base.Federation`
object trains whatever it holds. The digest covers every client's id, domain, index list, capacity and pruning
ratio, the domains' pool sizes, and the arrays of data the package does not own (their sha256), so
``--resume`` refuses, naming both hashes, when the file, the plugin's data or the given federation changed.
It does not say the partition is a good one; only that it is the same.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedsap_ray.data.base import Federation
from fedsap_ray.persist.digest import arrays_digest
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.checks import short

FILE_KEYS = ("clients", "allow_overlap")
CLIENT_KEYS = ("id", "domain", "indices", "capacity")
HASH_HEX = 16  # hex digits of runs.partition_hash (of the sha256)


@dataclass(frozen=True)
class ExplicitClient:
    """One client of an explicit partition: its id, domain (None: the dataset's only one), the positions of its
    samples in that domain's training split (int64, in its order) and its capacity (None: ``capacity.scheme``'s)."""

    id: int
    domain: str | None
    indices: np.ndarray
    capacity: float | None = None


@dataclass(frozen=True)
class ExplicitPartition:
    """Every client's samples (module docstring). Built from a file by :func:`read_partition`, from a Flower
    partitioner by :func:`fedsap_ray.data.flower.from_flower`, or by hand; checked when built (what needs no data)
    and against the data by :meth:`assign`. ``source`` is what ``runs.partition_source`` records."""

    clients: tuple[ExplicitClient, ...]
    allow_overlap: bool = False
    source: str = "object"
    where: str = field(default="invalid partition", compare=False)  # how a refusal starts (names the file)

    def __post_init__(self) -> None:
        object.__setattr__(self, "clients", tuple(self.clients))
        _check_clients(self.clients, self.where)
        if not isinstance(self.allow_overlap, bool):
            raise ConfigError(f"{self.where}: allow_overlap is {short(self.allow_overlap)}; true or false")

    def capacities(self) -> dict[int, float]:
        """client id -> capacity, for the clients whose capacity is given."""
        return {c.id: float(c.capacity) for c in self.clients if c.capacity is not None}

    def assign(self, domains: Sequence[str], pool: Mapping[str, int], num_clients: int) -> list[tuple[str, np.ndarray]]:
        """(domain, indices) per client id, checked against the data: ``domains`` the dataset's, ``pool`` each
        domain's training samples, ``num_clients`` the config's (``data.num_clients``)."""
        n = len(self.clients)
        if n != num_clients:
            raise ConfigError(f"{self.where}: it holds {n} clients but data.num_clients={num_clients}: set "
                              f"data.num_clients={n}")
        out: list[tuple[str, np.ndarray]] = []
        for k, c in sorted(enumerate(self.clients), key=lambda e: e[1].id):
            at = f"{self.where}: client {c.id} (entry {k})"
            d = c.domain
            if d is None:
                if len(domains) != 1:
                    raise ConfigError(f"{at}: domain is missing; the dataset has domains {', '.join(domains)}: name "
                                      "the one its indices point into")
                d = domains[0]
            if d not in pool:
                raise ConfigError(f"{at}: domain {short(d)} is not one of the dataset's: {', '.join(domains)}")
            top = int(c.indices.max())
            if top >= pool[d]:
                raise ConfigError(f"{at}: indices holds {top}, out of range: domain {d!r} has {pool[d]} training "
                                  f"samples (0..{pool[d] - 1})")
            out.append((d, c.indices))
        if not self.allow_overlap:
            _check_disjoint(out, self.where)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON document (module docstring)."""
        clients = []
        for c in self.clients:
            entry: dict[str, Any] = {"id": int(c.id)}
            if c.domain is not None:
                entry["domain"] = c.domain
            entry["indices"] = [int(i) for i in c.indices]
            if c.capacity is not None:
                entry["capacity"] = float(c.capacity)
            clients.append(entry)
        return {"clients": clients, "allow_overlap": self.allow_overlap}

    def save(self, path: str | Path) -> Path:
        """Write the file for ``data.partition_file`` (whole or not at all); returns its path."""
        from fedsap_ray.persist.atomic import atomic_write

        path = Path(path)
        with atomic_write(path) as f:
            f.write(json.dumps(self.to_dict(), separators=(",", ":")).encode())
        return path


def read_partition(path: str | Path) -> ExplicitPartition:
    """The partition in the file ``path`` (``data.partition_file``), every structural refusal a one-line
    :class:`ConfigError` naming the file, the client and the field (module docstring)."""
    where = f"invalid data.partition_file={str(path)!r}"
    p = Path(path).expanduser()
    try:
        raw = p.read_bytes()
    except IsADirectoryError:
        raise ConfigError(f"{where}: it is a folder; name the partition's JSON file") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read ({e.strerror or e.__class__.__name__})") from None
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: is not UTF-8 text (a JSON partition file is)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:  # a key twice, NaN/Infinity
        raise ConfigError(f"{where}: {e}") from None
    return partition_from_dict(doc, where=where, source=f"file:{path}")


def partition_from_dict(doc: Any, *, where: str = "invalid partition", source: str = "object") -> ExplicitPartition:
    """:class:`ExplicitPartition` of a JSON document, each value's type checked and named (module docstring)."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: is a JSON {_json_type(doc)}; a partition is an object with a clients list")
    unknown = [k for k in doc if k not in FILE_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {short(unknown[0])}; allowed keys are {', '.join(FILE_KEYS)}")
    entries = doc.get("clients")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: clients is {_json_type(entries) if entries is not None else 'missing'}; a "
                          "non-empty list with one object per client")
    clients = [_client(k, e, where) for k, e in enumerate(entries)]
    allow = doc.get("allow_overlap", False)
    if not isinstance(allow, bool):
        raise ConfigError(f"{where}: allow_overlap is {short(allow)}; true or false")
    return ExplicitPartition(tuple(clients), allow_overlap=allow, source=source, where=where)


def _client(k: int, e: Any, where: str) -> ExplicitClient:
    """Entry ``k`` of the file's clients list, with JSON's types checked."""
    if not isinstance(e, dict):
        raise ConfigError(f"{where}: clients entry {k} is a JSON {_json_type(e)}; an object with id and indices")
    cid = e.get("id")
    if type(cid) is not int:
        raise ConfigError(f"{where}: clients entry {k}: id is {short(cid) if 'id' in e else 'missing'}; an integer "
                          "client id >= 0")
    at = f"{where}: client {cid} (entry {k})"
    unknown = [key for key in e if key not in CLIENT_KEYS]
    if unknown:
        raise ConfigError(f"{at}: unknown key {short(unknown[0])}; allowed keys are {', '.join(CLIENT_KEYS)}")
    domain = e.get("domain")
    if domain is not None and not isinstance(domain, str):
        raise ConfigError(f"{at}: domain is {short(domain)}; a domain name (a string)")
    idx = e.get("indices")
    if not isinstance(idx, list) or not all(type(i) is int for i in idx):
        bad = idx if not isinstance(idx, list) else next(i for i in idx if type(i) is not int)
        what = "missing" if "indices" not in e else short(bad)
        raise ConfigError(f"{at}: indices {'is' if not isinstance(idx, list) else 'holds'} {what}; a list of integer "
                          "sample positions")
    try:
        indices = np.array(idx, dtype=np.int64)
    except OverflowError:
        raise ConfigError(f"{at}: indices holds a number too large for a sample position") from None
    capacity = e.get("capacity")
    if capacity is not None and (type(capacity) not in (int, float)):
        raise ConfigError(f"{at}: capacity is {short(capacity)}; a capacity in (0, 1]")
    return ExplicitClient(cid, domain, indices, None if capacity is None else float(capacity))


def _check_clients(clients: Sequence[ExplicitClient], where: str) -> None:
    """What needs no data: ids 0..N-1 once each, non-empty distinct non-negative indices, capacities in (0, 1]."""
    if not clients:
        raise ConfigError(f"{where}: has no clients")
    seen: dict[int, int] = {}
    for k, c in enumerate(clients):
        if not isinstance(c, ExplicitClient):
            raise ConfigError(f"{where}: clients entry {k} is a {type(c).__name__}, not an ExplicitClient")
        if not isinstance(c.id, (int, np.integer)) or isinstance(c.id, bool) or c.id < 0:
            raise ConfigError(f"{where}: clients entry {k}: id is {short(c.id)}; an integer client id >= 0")
        at = f"{where}: client {c.id} (entry {k})"
        if c.id in seen:
            raise ConfigError(f"{at}: id {c.id} is given twice (entries {seen[c.id]} and {k}); each client once")
        seen[int(c.id)] = k
        if c.domain is not None and (not isinstance(c.domain, str) or not c.domain):
            raise ConfigError(f"{at}: domain is {short(c.domain)}; a domain name (a non-empty string)")
        idx = c.indices
        if not isinstance(idx, np.ndarray) or idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise ConfigError(f"{at}: indices must be a 1-D integer array")
        if not len(idx):
            raise ConfigError(f"{at}: indices is empty; every client needs at least one sample")
        if idx.min() < 0:
            raise ConfigError(f"{at}: indices holds {int(idx.min())}; sample positions are >= 0")
        uniq, counts = np.unique(idx, return_counts=True)
        if len(uniq) != len(idx):
            raise ConfigError(f"{at}: indices holds {int(uniq[counts > 1][0])} more than once; each sample once")
        cap = c.capacity
        if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool)
                                    and math.isfinite(cap) and 0 < cap <= 1):
            raise ConfigError(f"{at}: capacity is {short(cap)}; a capacity in (0, 1]")
    missing = sorted(set(range(len(clients))) - set(seen))
    if missing:
        raise ConfigError(f"{where}: client ids must be 0..{len(clients) - 1}, one per client; {short(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} missing")


def _check_disjoint(parts: list[tuple[str, np.ndarray]], where: str) -> None:
    """No sample of a domain in two clients (client ids are list positions here)."""
    by_domain: dict[str, list[int]] = {}
    for cid, (d, _) in enumerate(parts):
        by_domain.setdefault(d, []).append(cid)
    for d, ids in by_domain.items():
        flat = np.concatenate([parts[c][1] for c in ids])
        owner = np.concatenate([np.full(len(parts[c][1]), c) for c in ids])
        order = np.argsort(flat, kind="stable")
        same = np.flatnonzero(flat[order][1:] == flat[order][:-1])
        if len(same):
            i = order[same[0]]
            j = order[same[0] + 1]
            raise ConfigError(f"{where}: clients {owner[i]} and {owner[j]} both hold sample {flat[i]} of domain {d!r}; "
                              "clients share no sample unless the file sets \"allow_overlap\": true")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    twice = next((k for k in keys if keys.count(k) > 1), None)
    if twice is not None:
        raise ValueError(f"the key {twice!r} appears twice in one object")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_type(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def partition_digest(fed: Federation) -> str:
    """The first :data:`HASH_HEX` hex digits of the sha256 of what a run trains (``runs.partition_hash``, module
    docstring): every client's id, domain, index list, capacity and pruning ratio, the dataset and its domains
    with their training pool sizes, and own data's digest (``fed.data_digest``). Vectorised over the clients:
    a federation of 100,000 clients is one pass over its packed index arrays."""
    clients = sorted(fed.clients, key=lambda c: c.client_id)
    names = list(dict.fromkeys([*fed.domains, *(c.domain for c in clients)]))
    code = {d: i for i, d in enumerate(names)}
    sizes = np.array([len(c.indices) for c in clients], dtype=np.int64)
    arrays = {
        "client_id": np.array([c.client_id for c in clients], dtype="<i8"),
        "domain": np.array([code[c.domain] for c in clients], dtype="<i8"),
        "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype("<i8"),
        "indices": (np.concatenate([np.asarray(c.indices, dtype="<i8") for c in clients]) if clients
                    else np.zeros(0, "<i8")),
        "capacity": np.array([c.capacity for c in clients], dtype="<f8"),
        "pruning_ratio": np.array([c.pruning_ratio for c in clients], dtype="<f8"),
    }
    meta = {"dataset": fed.dataset, "domains": names, "data": fed.data_digest,
            "pool": [len(fed.train[d]) if d in fed.train else -1 for d in names]}
    return arrays_digest(arrays, meta=meta).split(":", 1)[1][:HASH_HEX]
