"""Parquet results: one typed schema per table, atomic writes, and :func:`load`.

Layout of an output folder (DESIGN section 4)::

    OUT/runs/<run_id>.parquet      one row per run (provenance: the resolved config)
    OUT/rounds/<run_id>.parquet    one row per (round, domain) plus a ``__global__`` row
    OUT/clients/<run_id>.parquet   one row per (round, participating client)
    OUT/layers/<run_id>.parquet    one row per (round, client, layer): where the budget went (FedSAP)
    OUT/allocations/<run_id>.parquet  one row per (round, client) for ALL clients: widths and
                                   heterogeneity estimates of the sub-model allocation strategies

so ``pandas.read_parquet(OUT / "rounds")`` reads a whole sweep. Each file is rewritten
after every round through a temporary file whose name starts with ``.`` (which pyarrow
ignores) and :func:`os.replace`, so a run killed at any moment leaves only complete
files: the rounds finished so far and a ``runs`` row whose status says what happened.
``schema_version`` lets later versions read old folders (:func:`load` adds columns
that an older file lacks as nulls).
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 2  # 2: rounds.frozen_params and the allocations table
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
    ("status", pa.string(), "running | finished | failed | interrupted"),
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
    ("eval_mode", pa.string(), "which model was evaluated (e.g. 'global'; FedSAP adds 'group' and 'global_only')"),
    ("evaluated", pa.bool_(), "False on rounds skipped by eval_every (accuracy/loss null)"),
    ("accuracy", pa.float64(), "top-1 accuracy on the held-out set of this domain (global row: mean over domains)"),
    ("loss", pa.float64(), "mean cross-entropy on the held-out set (global row: mean over domains)"),
    ("n_test", pa.int64(), "held-out samples (global row: total)"),
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
    ("params_trained", pa.int64(), "parameters (float state incl. BN stats) the client trained"),
    ("macs_per_sample", pa.int64(), "multiply-accumulates per sample of the trained sub-model (null if unknown)"),
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


def write_atomic(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)


class RunWriter:
    """Accumulates one run's rows and rewrites its files atomically on every flush."""

    def __init__(self, out: Path, run_id: str) -> None:
        self.out = Path(out)
        self.run_id = run_id
        self.rows: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}

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


def read_table(path: Path, table: str) -> pd.DataFrame:
    """Read one table of a results folder (every run in it), with every schema column present."""
    folder = Path(path) / table
    files = sorted(f for f in folder.glob("*.parquet") if not f.name.startswith((".", "_"))) if folder.is_dir() else []
    sch = schema(table)
    if not files:
        return sch.empty_table().to_pandas()
    parts = []
    for f in files:
        t = pq.read_table(f)
        for field in sch:  # files from older schema versions: add the missing columns as nulls
            if field.name not in t.column_names:
                t = t.append_column(field, pa.nulls(len(t), field.type))
        parts.append(t.select(sch.names).cast(sch))
    return pa.concat_tables(parts).to_pandas()


def load(path: str | Path) -> Results:
    """Load a results folder (one run or a whole sweep) as pandas DataFrames."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"no results folder at {p}")
    return Results(*(read_table(p, t) for t in ("runs", *DATA_TABLES)))
