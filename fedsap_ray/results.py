"""Parquet results: one typed schema per table, atomic writes, and :func:`load`.

Layout of an output folder (docs/reference/results.md is generated from the declarations below)::

    OUT/runs/<run_id>.parquet      one row per run (provenance: the resolved config)
    OUT/rounds/<run_id>.parquet    one row per (round, domain) plus a ``__global__`` row
    OUT/clients/<run_id>.parquet   one row per (round, participating client)
    OUT/layers/<run_id>.parquet    one row per (round, client, layer): where the budget went (FedSAP)
    OUT/allocations/<run_id>.parquet  one row per (round, client) for ALL clients: widths and
                                   heterogeneity estimates of the sub-model allocation strategies
    OUT/<table>/compacted-<uuid8>.parquet  rows of many final runs (:func:`compact`,
                                   ``fedsap-ray compact OUT``)

so ``pandas.read_parquet(OUT / "rounds")`` reads a whole sweep; :func:`load` reads it in
one multi-threaded pyarrow dataset scan per table, from a local folder or a URI
(``s3://bucket/sweep``, anything ``pyarrow.fs.FileSystem.from_uri`` accepts), and gives
each run's rows exactly once even after an interrupted compaction. Each file is rewritten
after every round through a temporary file whose name starts with ``.`` (which pyarrow
ignores) and :func:`os.replace`, so a run killed at any moment leaves only complete
files: the rounds finished so far and a ``runs`` row whose status says what happened.
``schema_version`` lets later versions read old folders (:func:`load` adds columns
that an older file lacks as nulls).
"""
from __future__ import annotations

import contextlib
import glob
import json
import re
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from fedsap_ray.atomic import atomic_write
from fedsap_ray.errors import ConfigError

SCHEMA_VERSION = 4  # 2: rounds.frozen_params and the allocations table; 3: rounds.domain_coverage, n_reactivated,
# n_role_switches; 4: the 'deployed' eval mode (rounds.n_eval_clients, eval_clients_sampled, worst_client_*)
GLOBAL_DOMAIN = "__global__"

# (column, arrow type, description): the single place the columns are documented.
RUNS_COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("schema_version", pa.int32(), "results schema version"),
    ("run_id", pa.string(), "config hash + '-' + random suffix; joins the tables"),
    ("study", pa.string(), "study name (config 'study')"),
    ("algorithm", pa.string(), "registry name of the strategy"),
    ("dataset", pa.string(), "honest dataset name (e.g. embedded_digits, digits_offline)"),
    ("model", pa.string(), "model registry name"),
    ("preset", pa.string(), "preset the config started from"),
    ("seed", pa.int64(), "run seed"),
    ("num_clients", pa.int64(), "clients in the federation"),
    ("rounds", pa.int64(), "rounds configured"),
    ("rounds_done", pa.int64(), "rounds completed when this row was written"),
    ("backend", pa.string(), "local | ray"),
    ("config_json", pa.string(), "the resolved config (provenance)"),
    ("config_hash", pa.string(), "stable hash of the config (resources excluded)"),
    ("started_at", pa.timestamp("us", tz="UTC"), "start time"),
    ("finished_at", pa.timestamp("us", tz="UTC"), "end time (null while running)"),
    ("status", pa.string(), "running | finished | failed | interrupted | stopped (ended early by a Tune scheduler)"),
    ("error", pa.string(), "error message when status is failed"),
    ("package_version", pa.string(), "fedsap_ray version"),
    ("wall_s", pa.float64(), "wall time so far, seconds"),
    ("final_global_accuracy", pa.float64(), "global accuracy at the last evaluated round"),
    ("best_global_accuracy", pa.float64(), "best-so-far global accuracy"),
    ("dataset_notes", pa.string(), "what the data is (real / rendered stand-in)"),
]

ROUNDS_COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("schema_version", pa.int32(), "results schema version"),
    ("run_id", pa.string(), "run id"),
    ("round", pa.int64(), "communication round, 1-based"),
    ("domain", pa.string(), f"test domain, or '{GLOBAL_DOMAIN}' for the summary row"),
    ("eval_mode", pa.string(),
     "which model was evaluated: 'global' (FedSAP: 'group' and 'global_only'; FedSPU adds 'personal'); "
     "'deployed': each client's own model at its own mask on its own domain (training.eval_deployed)"),
    ("evaluated", pa.bool_(), "False on rounds skipped by eval_every (accuracy/loss null)"),
    ("accuracy", pa.float64(), "top-1 accuracy on the held-out set of this domain (global row: mean over domains)"),
    ("loss", pa.float64(), "mean cross-entropy on the held-out set (global row: mean over domains)"),
    ("n_test", pa.int64(), "held-out samples (global row: total)"),
    ("n_eval_clients", pa.int64(),
     "deployed mode: clients whose own model was evaluated for this row (domain: its clients; accuracy is their "
     "sample-weighted mean); null for other modes"),
    ("eval_clients_sampled", pa.bool_(),
     "deployed mode: True when those clients are a seeded sample (more clients than training.eval_clients)"),
    ("worst_client_accuracy", pa.float64(), "deployed mode: lowest accuracy of one client's own model in this row"),
    ("worst_client_id", pa.int64(), "deployed mode: the client with that lowest accuracy"),
    ("global_accuracy", pa.float64(), "unweighted mean of domain accuracies at this round"),
    ("best_global_accuracy", pa.float64(), "best global accuracy up to this round"),
    ("worst_domain_accuracy", pa.float64(), "lowest domain accuracy at this round"),
    ("avg_capacity", pa.float64(), "mean fraction of channels trained by this round's clients"),
    ("n_clients", pa.int64(), "clients that trained this round"),
    ("bytes_up", pa.int64(), "bytes clients sent this round (values actually uploaded + statistics)"),
    ("bytes_down", pa.int64(), "bytes the server sent this round (values + packed masks)"),
    ("train_loss", pa.float64(), "sample-weighted mean local training loss"),
    ("round_wall_s", pa.float64(), "wall time of the round incl. evaluation, seconds"),
    ("n_groups", pa.int64(), "FedSAP: pseudo-groups formed by DGA this round (null except on DGA rounds)"),
    ("ari_domain", pa.float64(), "FedSAP: adjusted Rand index of the pseudo-groups vs. the true domains (DGA rounds)"),
    ("ari_capacity", pa.float64(), "FedSAP: adjusted Rand index of the pseudo-groups vs. the capacity tiers (DGA rounds)"),
    ("frozen_params", pa.int64(),
     "trainable coordinates no client has covered since initialisation, after this round (papers/003 Prop. 3)"),
    ("domain_coverage", pa.float64(),
     "share of trainable coordinates some client of this domain has trained since round 1 (global row: any client)"),
    ("n_reactivated", pa.int64(),
     "FedSAP: client-channels Dropped in a client's mask of this round and active in its next one"),
    ("n_role_switches", pa.int64(), "FedSAP: client-channels switching Global <-> Private between this round and the next"),
]

CLIENTS_COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("schema_version", pa.int32(), "results schema version"),
    ("run_id", pa.string(), "run id"),
    ("round", pa.int64(), "communication round, 1-based"),
    ("client_id", pa.int64(), "client id"),
    ("true_domain", pa.string(), "ground-truth domain of the client's data"),
    ("pruning_ratio", pa.float64(), "FedSAP rho_i (0 under capacity tiers)"),
    ("capacity_max", pa.float64(), "device capacity: keep ratio kappa_i or p_max"),
    ("capacity_used", pa.float64(), "fraction of channels the client trained this round (p_i / realised kappa)"),
    ("pseudo_group", pa.int64(), "FedSAP pseudo-domain group (null for other strategies)"),
    ("n_global", pa.int64(), "channels trained on the Global path"),
    ("n_private", pa.int64(), "channels trained on a Private path"),
    ("n_dropped", pa.int64(), "channels not trained"),
    ("h_hat", pa.float64(), "HAS-FL raw heterogeneity estimate (null for other strategies)"),
    ("h_tilde", pa.float64(), "HAS-FL smoothed estimate (null for other strategies)"),
    ("tv_distance", pa.float64(), "ground truth: TV(client label dist., global label dist.)"),
    ("n_samples", pa.int64(), "local training samples"),
    ("train_loss", pa.float64(), "mean local training loss over the round's steps"),
    ("params_trained", pa.int64(), "trainable parameters (nn.Parameters; BN running statistics not counted) the "
     "client updated in local training, any epoch (DapperFL's default: the full model, its first epoch trains all "
     "of it; FedSPU: its active neurons only); Strategy.params_trained"),
    ("macs_per_sample", pa.int64(), "per-sample forward multiply-accumulates of the model the client runs at "
     "inference (its sub-model), one pass: Strategy.mask_macs of the plan's coverage unless the strategy refines "
     "it (DapperFL's pruned model); not what training spent: see train_macs"),
    ("train_macs", pa.int64(), "forward multiply-accumulates the client executed in local training, all epochs: "
     "sum over its steps of batch samples x per-sample forward MACs of the network run in that step x forward "
     "passes per step (MOON's frozen models, DapperFL's full-model first epoch, FedSPU's frozen neurons "
     "included); backward not counted (about 2x the forward on the trained part); Strategy.train_macs"),
    ("bytes_up", pa.int64(), "bytes uploaded"),
    ("bytes_down", pa.int64(), "bytes downloaded"),
    ("wall_s", pa.float64(), "local training wall time, seconds"),
    ("worker", pa.string(), "which worker ran the client ('local' in-process)"),
    ("gpu_id", pa.int64(), "GPU id the worker saw (null on CPU)"),
]

LAYERS_COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("schema_version", pa.int32(), "results schema version"),
    ("run_id", pa.string(), "run id"),
    ("round", pa.int64(), "communication round, 1-based"),
    ("client_id", pa.int64(), "client id"),
    ("layer", pa.string(), "ChannelSpace layer (e.g. layer1, layer2.0.conv1)"),
    ("channels", pa.int64(), "C_l, channels of the layer"),
    ("keep_ratio", pa.float64(), "kappa_{i,l}: fraction of the layer's channels active for this client"),
    ("n_global", pa.int64(), "Global channels"),
    ("n_private", pa.int64(), "Private channels"),
    ("n_dropped", pa.int64(), "Dropped channels"),
]

ALLOCATIONS_COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("schema_version", pa.int32(), "results schema version"),
    ("run_id", pa.string(), "run id"),
    ("round", pa.int64(), "communication round, 1-based"),
    ("client_id", pa.int64(), "client id (every client of the federation, sampled or not)"),
    ("capacity_max", pa.float64(), "p_max: the client's resource constraint"),
    ("p", pa.float64(), "width assigned to the client for this round (what it trains if sampled)"),
    ("h_hat", pa.float64(), "HAS-FL Eq. 4: the client's latest raw estimate (null before its first, or not HAS-FL)"),
    ("h_tilde", pa.float64(), "HAS-FL Eq. 5: smoothed estimate at the end of the round (null if not HAS-FL)"),
    ("tv_distance", pa.float64(), "ground truth: TV(client label dist., global label dist.)"),
    ("adapted", pa.bool_(), "an adaptation step (new allocations) happened at the end of this round"),
]

TABLES: dict[str, list[tuple[str, pa.DataType, str]]] = {
    "runs": RUNS_COLUMNS, "rounds": ROUNDS_COLUMNS, "clients": CLIENTS_COLUMNS, "layers": LAYERS_COLUMNS,
    "allocations": ALLOCATIONS_COLUMNS,
}
DATA_TABLES = ("rounds", "clients", "layers", "allocations")  # per-round tables (everything but runs)
# What one row of each table is (docs/reference/results.md is generated from these declarations).
TABLE_ROWS: dict[str, str] = {
    "runs": "one row per run: its provenance (the resolved config), status, times and headline accuracies; "
            "results.load and read_table add one config.<section>.<field> column per config leaf",
    "rounds": f"one row per (round, evaluated model, test domain) plus a '{GLOBAL_DOMAIN}' row per round and model",
    "clients": "one row per (round, participating client): its data, capacity, mask and cost",
    "layers": "one row per (round, client, channel layer): where a client's channel budget went (FedSAP)",
    "allocations": "one row per (round, client) for every client of the federation, sampled or not: the widths "
                   "and heterogeneity estimates of the sub-model allocation strategies",
}


def schema(table: str) -> pa.Schema:
    return pa.schema([pa.field(n, t, metadata={"doc": d}) for n, t, d in TABLES[table]])


def to_table(table: str, rows: list[dict[str, Any]]) -> pa.Table:
    """Typed Arrow table; unknown keys are an error so the schema stays the one source of truth."""
    sch = schema(table)
    names = set(sch.names)
    for r in rows:
        extra = set(r) - names
        if extra:
            raise KeyError(f"{table}: columns {sorted(extra)} are not in the schema (add them to results.py)")
    cols = {n: [r.get(n) for r in rows] for n in sch.names}
    return pa.Table.from_pydict(cols, schema=sch)


# ----------------------------------------------------------------------------- run ids

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]{0,127}")
RUN_ID_RULE = ("1 to 128 characters from A-Z a-z 0-9 . _ = -, starting with a letter or digit, "
               "without '..' and not starting with 'compacted-'")


def check_run_id(run_id: Any, field: str = "run_id") -> str:
    """``run_id`` if it is safe as a file name in every table folder, else a ConfigError naming ``field``.

    A run id becomes ``OUT/<table>/<run_id>.parquet``: a path separator or ``..`` would
    write outside the table folder (``../x`` put every table on one file), and a
    ``compacted-`` prefix would be read as a compacted file.
    """
    if (not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id) or ".." in run_id
            or run_id.startswith(COMPACTED_PREFIX)):
        raise ConfigError(f"invalid {field}={run_id!r}: a run id is {RUN_ID_RULE}")
    return run_id


def run_files(out: Path, run_id: str) -> list[Path]:
    """The run's per-run files that exist under the local folder ``out`` (every table)."""
    return [f for t in TABLES if (f := Path(out) / t / f"{run_id}.parquet").is_file()]


def in_compacted(out: Path, run_id: str) -> bool:
    """True when a compacted ``runs`` file in the local folder ``out`` holds the run."""
    fs, base = filesystem(Path(out))
    return any(run_id in _run_ids(fs, c.path) for c in _list_table(fs, base, "runs").compacted)


def remove_run(out: Path, run_id: str) -> int:
    """Delete every row of run ``run_id`` from the local folder ``out`` (per-run files, and its
    rows in compacted files, which are rewritten without them); return the files changed.

    Used by ``--overwrite``: a new run under an old id must not inherit a table the new
    run does not write (e.g. the old run's ``layers``).
    """
    fs, base = filesystem(Path(out))
    changed = 0
    for table in TABLES:
        listing = _list_table(fs, base, table)
        if run_id in listing.per_run:
            fs.delete_file(listing.per_run[run_id].path)
            changed += 1
        for c in listing.compacted:
            ids = _run_ids(fs, c.path)
            if run_id not in ids:
                continue
            if ids == {run_id}:
                fs.delete_file(c.path)
            else:
                rest = _dataset(fs, [c.path], table).to_batches(filter=pc.field("run_id") != run_id)
                _write_batches(fs, c.path, table, rest)
            changed += 1
    return changed


def remove_temp_files(out: Path, run_id: str) -> list[Path]:
    """Delete the temporary files a killed writer of this run left (``.<run_id>.parquet.*.tmp``).

    Only call it while holding the run's claim (no live writer of the run can own them).
    """
    gone = []
    for t in TABLES:
        for f in (Path(out) / t).glob(f".{glob.escape(run_id)}.parquet.*.tmp"):
            f.unlink(missing_ok=True)
            gone.append(f)
    return gone


def write_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` whole or not at all (:func:`fedsap_ray.atomic.atomic_write`)."""
    with atomic_write(path) as f:
        pq.write_table(table, f)


class RunWriter:
    """Accumulates one run's rows and rewrites its files atomically on every flush."""

    def __init__(self, out: Path, run_id: str) -> None:
        self.out = Path(out)
        self.run_id = check_run_id(run_id)
        self.rows: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}

    def tables_written(self) -> list[str]:
        """The per-round tables this run has rows in (and so files for, after a flush)."""
        return [t for t in DATA_TABLES if self.rows[t]]

    def set_run(self, row: dict[str, Any]) -> None:
        self.rows["runs"] = [{"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **row}]
        self._write("runs")

    def add(self, table: str, rows: list[dict[str, Any]]) -> None:
        self.rows[table].extend({"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **r} for r in rows)

    def restore(self, upto_round: int) -> dict[str, Any] | None:
        """Reload this run's rows from disk (rounds <= ``upto_round``) to resume it; return its old runs row."""
        for table in DATA_TABLES:
            f = self.out / table / f"{self.run_id}.parquet"
            rows = pq.read_table(f).to_pylist() if f.is_file() else []
            self.rows[table] = [r for r in rows if r["round"] <= upto_round]
        f = self.out / "runs" / f"{self.run_id}.parquet"
        old = pq.read_table(f).to_pylist() if f.is_file() else []
        return old[0] if old else None

    def flush(self) -> None:
        for t in (*DATA_TABLES, "runs"):
            self._write(t)

    def _write(self, table: str) -> None:
        if self.rows[table] or table == "runs":
            write_atomic(to_table(table, self.rows[table]), self.out / table / f"{self.run_id}.parquet")


@dataclass
class Results:
    runs: pd.DataFrame
    rounds: pd.DataFrame
    clients: pd.DataFrame
    layers: pd.DataFrame
    allocations: pd.DataFrame

    def __getitem__(self, table: str) -> pd.DataFrame:
        return getattr(self, table)


def _check_table(table: str) -> None:
    if table not in TABLES:
        raise ValueError(f"invalid table={table!r}: allowed values are {sorted(TABLES)}")


# ----------------------------------------------------------------------------- where the results are

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_OBJECT_STORES = frozenset({"s3", "gcs", "abfs"})  # a single PUT is atomic there; rename is a copy
FINAL_STATUSES = ("finished", "failed", "stopped", "interrupted")  # a run with these writes no more rows
COMPACTED_PREFIX = "compacted-"  # OUT/<table>/compacted-<uuid8>.parquet: rows of many final runs
_ROW_GROUP = 1 << 17


def is_uri(path: str | Path) -> bool:
    """True for a string with a scheme (``s3://``, ``file://``...); a :class:`Path` is always local."""
    return isinstance(path, str) and bool(_URI.match(path))


def filesystem(path: str | Path) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local folder or a URI ``FileSystem.from_uri`` accepts."""
    if not is_uri(path):
        return pafs.LocalFileSystem(), Path(path).absolute().as_posix()
    try:
        fs, inner = pafs.FileSystem.from_uri(str(path))
    except (ValueError, NotImplementedError, OSError) as e:
        raise ValueError(f"invalid results location {str(path)!r}: {e}; use a local path or a URI that "
                         "pyarrow.fs.FileSystem.from_uri accepts (file://, s3://, gs://, hdfs://, abfs://)") from e
    return fs, inner.rstrip("/") or inner


def _is_dir(fs: pafs.FileSystem, base: str) -> bool:
    return fs.get_file_info(base).type == pafs.FileType.Directory


@dataclass
class _Listing:
    per_run: dict[str, pafs.FileInfo]  # run_id (file stem) -> its file
    compacted: list[pafs.FileInfo]


# the columns that identify a table's rows: a file in the table's folder must have them
KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("run_id", "status"), "rounds": ("run_id", "round", "domain"),
    "clients": ("run_id", "round", "client_id"), "layers": ("run_id", "round", "client_id", "layer"),
    "allocations": ("run_id", "round", "client_id", "p"),
}


def foreign_reason(names: list[str], table: str) -> str | None:
    """Why a file with columns ``names`` is not a file of ``table`` (None: it is one).

    A file of this table (any schema version) has the table's key columns and no column
    outside its schema; a file of another table placed in the folder fails one of the two,
    and reading it would give rows that are null in almost every column.
    """
    cols = {n for n, _, _ in TABLES[table]}
    extra = sorted(set(names) - cols)
    missing = [k for k in KEY_COLUMNS[table] if k not in names]
    if not extra and not missing:
        return None
    why = []
    if missing:
        why.append(f"lacks the key column(s) {', '.join(missing)}")
    if extra:
        why.append(f"has column(s) {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''} that {table} has not")
    return " and ".join(why)


def _foreign(fs: pafs.FileSystem, info: pafs.FileInfo, table: str) -> str | None:
    try:
        with fs.open_input_file(info.path) as f:
            names = pq.read_schema(f).names
    except (OSError, pa.ArrowException):
        return None  # unreadable: let the reader report it, naming the file
    return foreign_reason(names, table)


def _list_table(fs: pafs.FileSystem, base: str, table: str) -> _Listing:
    """The table's Parquet files; names starting with "." (temporary) or "_" are not results.

    A Parquet file of another table placed in the folder is skipped with a warning (see
    :func:`foreign_reason`), never read as rows of this table nor compacted or deleted.
    """
    infos = fs.get_file_info(pafs.FileSelector(f"{base}/{table}", allow_not_found=True))
    per_run: dict[str, pafs.FileInfo] = {}
    compacted: list[pafs.FileInfo] = []
    for info in sorted(infos, key=lambda i: i.path):
        name = info.base_name
        if info.type != pafs.FileType.File or name.startswith((".", "_")) or not name.endswith(".parquet"):
            continue
        reason = _foreign(fs, info, table)
        if reason is not None:
            warnings.warn(f"skipped {info.path}: not a file of the {table} table: it {reason}", stacklevel=3)
            continue
        if name.startswith(COMPACTED_PREFIX):
            compacted.append(info)
        else:
            per_run[name[: -len(".parquet")]] = info
    return _Listing(per_run, compacted)


def _run_ids(fs: pafs.FileSystem, path: str) -> set[str]:
    with fs.open_input_file(path) as f:
        col = pq.ParquetFile(f).read(columns=["run_id"]).column("run_id")
    return set(pc.unique(col).to_pylist())


def _dataset(fs: pafs.FileSystem, paths: list[str], table: str) -> ds.FileSystemDataset:
    """One dataset over many files; the explicit schema adds columns an older file lacks as nulls."""
    return ds.FileSystemDataset.from_paths(paths, schema=schema(table), format=ds.ParquetFileFormat(),
                                           filesystem=fs)


def _sources(fs: pafs.FileSystem, listing: _Listing) -> tuple[list[str], list[tuple[str, set[str]]]]:
    """Files to read whole, and compacted files to read without some runs, so each run is read once.

    A run's per-run file wins over compacted rows of the same run (after an interrupted
    :func:`compact` both hold the same rows; after a re-run under the same id the per-run
    file is the newer); among compacted files the first (by name) wins.
    """
    whole = [i.path for i in listing.per_run.values()]
    partial: list[tuple[str, set[str]]] = []
    seen = set(listing.per_run)
    for c in listing.compacted:
        ids = _run_ids(fs, c.path)
        skip = ids & seen
        if not skip:
            whole.append(c.path)
        elif skip != ids:
            partial.append((c.path, skip))
        seen |= ids
    return sorted(whole), partial


def _readahead(fs: pafs.FileSystem) -> int:
    """Files read at once: pyarrow's default locally; many on remote stores, where latency dominates."""
    return 4 if fs.type_name == "local" else 64


def _read_arrow(fs: pafs.FileSystem, base: str, table: str, columns: list[str] | None = None) -> pa.Table:
    whole, partial = _sources(fs, _list_table(fs, base, table))
    kw: dict[str, Any] = {"columns": columns, "fragment_readahead": _readahead(fs)}
    parts = [_dataset(fs, whole, table).to_table(**kw)] if whole else []
    for path, skip in partial:
        parts.append(_dataset(fs, [path], table).to_table(filter=~pc.field("run_id").isin(sorted(skip)), **kw))
    if not parts:
        empty = schema(table).empty_table()
        return empty.select(columns) if columns else empty
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def read_table(path: str | Path, table: str) -> pd.DataFrame:
    """Read one table of a results folder (every run in it), with every schema column present.

    ``path`` is a local folder or a URI (``s3://bucket/sweep``, ``file:///...``). All files
    are read in one multi-threaded pyarrow dataset scan; per-run and compacted files
    together give each run's rows exactly once.
    """
    _check_table(table)
    fs, base = filesystem(path)
    df = _read_arrow(fs, base, table).to_pandas()
    return with_config_columns(df) if table == "runs" else df


def load(path: str | Path) -> Results:
    """Load a results folder (one run or a whole sweep; local path or URI) as pandas DataFrames; the runs
    table gains the flattened ``config.*`` columns (:func:`with_config_columns`)."""
    fs, base = filesystem(path)
    if not _is_dir(fs, base):
        raise FileNotFoundError(f"no results folder at {path}")
    runs, *data = (_read_arrow(fs, base, t).to_pandas() for t in ("runs", *DATA_TABLES))
    return Results(with_config_columns(runs), *data)


CONFIG_PREFIX = "config."


def with_config_columns(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` plus one ``config.<section>.<field>`` column per leaf of each run's resolved config
    (``config_json``; algorithm options as ``config.algorithm.options.<name>``, only those the run set),
    as Ray Tune's ``config/...`` columns, so a notebook filters runs by any setting without parsing JSON.
    Leaves a run lacks are NaN; lists stay Python lists. Derived on read: the files keep one schema."""
    if runs.empty or "config_json" not in runs.columns:
        return runs
    parsed = [json.loads(c) if isinstance(c, str) and c else {} for c in runs["config_json"]]
    flat = pd.json_normalize(parsed, sep=".").add_prefix(CONFIG_PREFIX)
    flat.index = runs.index
    return pd.concat([runs.drop(columns=[c for c in flat.columns if c in runs.columns]), flat], axis=1)


def run_statuses(path: str | Path) -> dict[str, str]:
    """run_id -> status of every run in a results folder (per-run and compacted files); {} if none."""
    fs, base = filesystem(path)
    t = _read_arrow(fs, base, "runs", columns=["run_id", "status"])
    return dict(zip(t.column("run_id").to_pylist(), t.column("status").to_pylist()))


# ----------------------------------------------------------------------------- compaction

@contextmanager
def atomic_output(fs: pafs.FileSystem, path: str) -> Iterator[pa.NativeFile]:
    """A stream whose bytes appear at ``path`` only once complete.

    Object stores: written to memory, then one upload (a single PUT is atomic). Other
    filesystems: a temporary file named ``.<name>.<uuid>.tmp`` (readers skip it) moved into
    place.
    """
    parent, name = path.rsplit("/", 1)
    if fs.type_name in _OBJECT_STORES:
        buf = pa.BufferOutputStream()
        yield buf
        data = buf.getvalue()
        with fs.open_output_stream(path, compression=None) as out:
            out.write(data)
        return
    fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with fs.open_output_stream(tmp, compression=None) as out:
            yield out
        fs.move(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.delete_file(tmp)
        raise


def _write_batches(fs: pafs.FileSystem, path: str, table: str, batches: Iterator[pa.RecordBatch]) -> int:
    """Stream batches into one Parquet file (row groups of ~128k rows); return the row count."""
    sch, rows = schema(table), 0
    with atomic_output(fs, path) as sink, pq.ParquetWriter(sink, sch) as w:
        buf: list[pa.RecordBatch] = []
        n = 0
        for b in batches:
            buf.append(b)
            n += b.num_rows
            if n >= _ROW_GROUP:
                w.write_table(pa.Table.from_batches(buf).cast(sch))
                rows, buf, n = rows + n, [], 0
        if buf:
            w.write_table(pa.Table.from_batches(buf).cast(sch))
            rows += n
    return rows


def _checkpointed(fs: pafs.FileSystem, base: str) -> set[str]:
    infos = fs.get_file_info(pafs.FileSelector(f"{base}/checkpoints", allow_not_found=True))
    return {i.base_name[: -len(".pkl")] for i in infos
            if i.type == pafs.FileType.File and i.base_name.endswith(".pkl") and not i.base_name.startswith(".")}


def _unchanged(fs: pafs.FileSystem, info: pafs.FileInfo) -> bool:
    now = fs.get_file_info(info.path)
    return now.type == pafs.FileType.File and now.mtime == info.mtime and now.size == info.size


def compact(path: str | Path) -> dict[str, int]:
    """Merge the per-run files of final runs into one ``compacted-<uuid8>.parquet`` per table.

    Thousands of tiny per-run files make every listing and scan slow (worst on object
    stores); one file per table loads in one read. A run is compacted when its ``runs``
    status is final (:data:`FINAL_STATUSES`) and it has no checkpoint left (an interrupted
    or failed run that still has one can be resumed, and resuming reads its per-run files).
    Running runs are never touched.

    Safe to interrupt at any moment: the compacted file is written atomically before any
    per-run file is deleted, and readers let a run's per-run file win over compacted rows,
    so every row is read exactly once; running ``compact`` again finishes the job (per-run
    files older than the compacted file that holds their run are deleted; newer ones, from a
    re-run under the same id, replace the run's compacted rows). A per-run file that changed
    while compacting is kept. Returns counts: ``runs_compacted``, ``files_written``,
    ``files_rewritten`` (older compacted files that lost a re-run run), ``files_removed``
    and ``runs_kept`` (runs with per-run files left because they are running or resumable).
    """
    fs, base = filesystem(path)
    if not _is_dir(fs, base):
        raise FileNotFoundError(f"no results folder at {path}")
    statuses = run_statuses(path)
    resumable = _checkpointed(fs, base)
    final = {r for r, s in statuses.items() if s in FINAL_STATUSES and r not in resumable}
    done: set[str] = set()
    kept: set[str] = set()
    written = rewritten = removed = 0
    for table in (*DATA_TABLES, "runs"):  # runs last: until then a status is still found per run
        listing = _list_table(fs, base, table)
        kept |= {r for r in listing.per_run if r not in final}
        todo = {r: i for r, i in listing.per_run.items() if r in final}
        if not todo:
            continue
        ids = {c.path: _run_ids(fs, c.path) for c in listing.compacted}
        fresh = {}
        for r, info in todo.items():
            covering = [c for c in listing.compacted if r in ids[c.path]]
            # a leftover of an interrupted compaction is older than the file holding its rows
            if not covering or any(info.mtime >= c.mtime for c in covering):
                fresh[r] = info
        if fresh:
            new = f"{base}/{table}/{COMPACTED_PREFIX}{uuid.uuid4().hex[:8]}.parquet"
            paths = sorted(i.path for i in fresh.values())
            _write_batches(fs, new, table, _dataset(fs, paths, table).to_batches(fragment_readahead=_readahead(fs)))
            written += 1
            for c in listing.compacted:  # drop superseded rows of re-run runs from older compacted files
                drop = ids[c.path] & fresh.keys()
                if not drop:
                    continue
                rest = _dataset(fs, [c.path], table).to_batches(filter=~pc.field("run_id").isin(sorted(drop)))
                if drop == ids[c.path]:
                    fs.delete_file(c.path)
                else:
                    _write_batches(fs, c.path, table, rest)
                rewritten += 1
        for r, info in todo.items():
            if _unchanged(fs, info):
                fs.delete_file(info.path)
                removed += 1
                done.add(r)
            else:
                kept.add(r)
    return {"runs_compacted": len(done - kept), "files_written": written, "files_rewritten": rewritten,
            "files_removed": removed, "runs_kept": len(kept)}
