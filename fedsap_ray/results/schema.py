"""The results tables' schemas: the core columns declared here plus the columns strategies declare.

A strategy declares its own columns (:attr:`fedsap_ray.algorithms.contract.Strategy.columns`); each
per-round table's schema is the core columns below followed by the union of every registered
strategy's declarations (:func:`extension_columns`), so every run of every algorithm writes the
same stable Parquet schema and adding a metric never means editing this file. The core columns
are those the recording side fills for every strategy (:class:`fedsap_ray.engine.server.Server`),
including the ones computed from ground truth a strategy never sees (``true_domain``,
``tv_distance``, ``ari_domain``). docs/reference/results.md is generated from these declarations.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from fedsap_ray.common.columns import RECORDED_TABLES, Column

SCHEMA_VERSION = 14  # 2: rounds.frozen_params and the allocations table; 3: rounds.domain_coverage, n_reactivated,
# n_role_switches; 4: the 'deployed' eval mode (rounds.n_eval_clients, eval_clients_sampled, worst_client_*);
# 5: the round's time by phase (rounds.train_s, eval_s, server_s); 6: simulated device time (rounds.sim_round_s,
# sim_elapsed_s, n_stragglers; clients.sim_time_s, straggler); 7: clients.node (the Ray node a client ran on);
# 8: runs.torch_version and runs.cpu_kernels (what a run's numbers reproduce against); 9: asynchronous training
# (rounds.updates_applied, staleness_mean, staleness_max; clients.version_trained, version_applied, staleness,
# sim_arrival_s, staleness_weight); 10: rounds.backend_bytes_down, backend_bytes_up (what the backend moved
# between processes); 11: runs.rows_written (what a sweep's --resume checks a finished run's tables against);
# 12: runs.partition_source, partition_hash (what a run trained), clients.assigned_width, runs.models_kept (the
# models a run keeps under OUT/models/<run_id>/); 13: clients.compile, rounds.eval_compiles (resources.compile);
# 14: rounds.dp_epsilon, dp_clip_norm, dp_noise_std, dp_snr_shared, dp_snr_partial, dp_unclipped_noised,
# clients.dp_update_norm, dp_clipped (privacy.*)
GLOBAL_DOMAIN = "__global__"
# Columns that describe how a run executed, not what it computed: wall-clock readings (never reproducible), the
# bytes the backend moved between processes (0 in-process, and on Ray a function of the worker count) and what the
# compiled-forward caches did (which process compiled a shape first depends on the backend), so never compared
# between runs (the golden check, the tests of determinism, resume and Ray == local).
WALL_CLOCK = ("started_at", "finished_at", "wall_s", "round_wall_s", "train_s", "eval_s", "server_s",
              "backend_bytes_down", "backend_bytes_up", "compile", "eval_compiles")

# (column, arrow type, description): the core columns, filled by the recording side for every strategy.
# (column, arrow type, description): the single place the columns are documented.
RUNS_COLUMNS: list[Column] = [
    Column("schema_version", pa.int32(), "results schema version"),
    Column("run_id", pa.string(), "config hash + '-' + random suffix; joins the tables"),
    Column("study", pa.string(), "study name (config 'study')"),
    Column("algorithm", pa.string(), "registry name of the strategy"),
    Column("dataset", pa.string(), "honest dataset name (e.g. embedded_digits, digits_offline)"),
    Column("model", pa.string(), "model registry name"),
    Column("preset", pa.string(), "preset the config started from"),
    Column("seed", pa.int64(), "run seed"),
    Column("num_clients", pa.int64(), "clients in the federation"),
    Column("rounds", pa.int64(), "rounds configured"),
    Column("rounds_done", pa.int64(), "rounds completed when this row was written"),
    Column("backend", pa.string(), "local | ray"),
    Column("config_json", pa.string(), "the resolved config (provenance)"),
    Column("config_hash", pa.string(), "stable hash of the config (resources excluded)"),
    Column("started_at", pa.timestamp("us", tz="UTC"), "start time"),
    Column("finished_at", pa.timestamp("us", tz="UTC"), "end time (null while running)"),
    Column("status", pa.string(), "running | finished | failed | interrupted | stopped (ended early by a Tune scheduler)"),
    Column("error", pa.string(), "error message when status is failed"),
    Column("package_version", pa.string(), "fedsap_ray version"),
    Column("torch_version", pa.string(), "torch version of the process that ran the round loop"),
    Column("cpu_kernels", pa.string(),
     "CPU kernels that process's torch picked, e.g. 'aten=AVX512 onednn=max': numbers reproduce exactly only "
     "where this is the same (docs/architecture.md#determinism)"),
    Column("wall_s", pa.float64(), "wall time so far, seconds"),
    Column("final_global_accuracy", pa.float64(), "global accuracy at the last evaluated round"),
    Column("best_global_accuracy", pa.float64(), "best-so-far global accuracy"),
    Column("dataset_notes", pa.string(), "what the data is (real / rendered stand-in)"),
    Column("rows_written", pa.string(), "rows the run had written when this row was written, per table, as JSON "
           "(e.g. {\"clients\": 24, \"rounds\": 12}): a sweep's --resume checks a finished run's tables against it"),
    Column("partition_source", pa.string(), "where the clients' split the run trained came from: builtin:<data.partition> "
           "| file:<data.partition_file> | flower:<partitioner> | object (an ExplicitPartition built in Python) | given "
           "(a Federation passed to run_experiment); recorded from the federation, not the config"),
    Column("partition_hash", pa.string(), "first 16 hex digits of the sha256 of what the run trained: every client's id, "
           "domain, sample indices, capacity and pruning ratio, the domains' pool sizes, and own data's arrays; "
           "--resume refuses another (fedsap_ray.data.explicit.partition_digest)"),
    Column("models_kept", pa.string(), "the models the run keeps under models/<run_id>/ (training.keep_model), as JSON "
           "of which model -> its round (e.g. {\"best\": 7, \"final\": 10}; {} while none is kept): each is "
           "<which>.safetensors + .json with the clients' <which>.deployed.* (fedsap_ray.results.load_model)"),
]

ROUNDS_COLUMNS: list[Column] = [
    Column("schema_version", pa.int32(), "results schema version"),
    Column("run_id", pa.string(), "run id"),
    Column("round", pa.int64(), "communication round, 1-based"),
    Column("domain", pa.string(), f"test domain, or '{GLOBAL_DOMAIN}' for the summary row"),
    Column("eval_mode", pa.string(),
     "which model was evaluated: 'global' (FedSAP: 'group' and 'global_only'; FedSPU adds 'personal'); "
     "'deployed': each client's own model at its own mask on its own domain (training.eval_deployed)"),
    Column("evaluated", pa.bool_(), "False on rounds skipped by eval_every (accuracy/loss null)"),
    Column("accuracy", pa.float64(), "top-1 accuracy on the held-out set of this domain (global row: mean over domains)"),
    Column("loss", pa.float64(), "mean cross-entropy on the held-out set (global row: mean over domains)"),
    Column("n_test", pa.int64(), "held-out samples (global row: total)"),
    Column("n_eval_clients", pa.int64(),
     "deployed mode: clients whose own model was evaluated for this row (domain: its clients; accuracy is their "
     "sample-weighted mean); null for other modes"),
    Column("eval_clients_sampled", pa.bool_(),
     "deployed mode: True when those clients are a seeded sample (more clients than training.eval_clients)"),
    Column("worst_client_accuracy", pa.float64(), "deployed mode: lowest accuracy of one client's own model in this row"),
    Column("worst_client_id", pa.int64(), "deployed mode: the client with that lowest accuracy"),
    Column("global_accuracy", pa.float64(), "unweighted mean of domain accuracies at this round"),
    Column("best_global_accuracy", pa.float64(), "best global accuracy up to this round"),
    Column("worst_domain_accuracy", pa.float64(), "lowest domain accuracy at this round"),
    Column("avg_capacity", pa.float64(), "mean fraction of channels trained by this round's clients"),
    Column("n_clients", pa.int64(), "clients that trained this round"),
    Column("bytes_up", pa.int64(), "bytes clients sent this round (values actually uploaded + statistics)"),
    Column("bytes_down", pa.int64(), "bytes the server sent this round (values + packed masks)"),
    Column("train_loss", pa.float64(), "sample-weighted mean local training loss"),
    Column("round_wall_s", pa.float64(), "wall time of the round incl. evaluation, seconds (train_s + eval_s + server_s)"),
    Column("train_s", pa.float64(),
           "seconds of the round in the backend's training call: sending plans, local training, results back"),
    Column("eval_s", pa.float64(),
           "seconds of the round evaluating the server's models and the deployed ones (0 on rounds not evaluated)"),
    Column("eval_compiles", pa.int64(), "resources.compile=train+eval: evaluation forwards the server process "
           "compiled this round (a new model shape each; 0 once every shape is seen); null in other modes"),
    Column("server_s", pa.float64(), "seconds of the round in the server's own work: client plans and aggregation"),
    Column("backend_bytes_down", pa.int64(), "bytes the backend moved to its workers this round (Ray: each distinct "
           "parameter vector and packed mask once per worker, plus the plans' own parts; 0 in-process), not the "
           "simulated protocol's bytes_down"),
    Column("backend_bytes_up", pa.int64(), "bytes the backend moved back from its workers this round (the results; "
           "0 in-process), not the simulated protocol's bytes_up"),
    Column("sim_round_s", pa.float64(), "simulated device seconds of the round under devices.policy (wait_all: its "
           "slowest client's sim_time_s; deadline: deadline_s if a client missed it; over_select: the k-th to finish)"),
    Column("sim_elapsed_s", pa.float64(), "simulated device seconds of rounds 1..this one (sum of sim_round_s)"),
    Column("n_stragglers", pa.int64(), "clients that trained but were left out of aggregation by devices.policy"),
    Column("updates_applied", pa.int64(), "devices.mode=async: updates this server step applied (null in sync runs)"),
    Column("staleness_mean", pa.float64(), "devices.mode=async: mean staleness (server steps between the version a "
           "client trained on and the one its update was applied to) of the step's applied updates (null in sync runs)"),
    Column("staleness_max", pa.int64(), "devices.mode=async: largest staleness among the step's applied updates "
           "(null in sync runs)"),
    Column("dp_epsilon", pa.float64(), "privacy: epsilon spent at privacy.delta after this round's release, from "
           "dp-accounting (inf without noise; local DP: of the client released most often); null without privacy"),
    Column("dp_clip_norm", pa.float64(), "privacy: the clip norm C the round's updates were clipped to (adapting "
           "under privacy.clipping=adaptive); null without privacy"),
    Column("dp_noise_std", pa.float64(), "privacy.mode=central: std of the Gaussian added to each coordinate's sum "
           "of clipped updates (sigma x C x noise scale), before the denominator; null otherwise"),
    Column("dp_snr_shared", pa.float64(), "privacy.mode=central: ||mean clipped update|| / ||noise|| over the "
           "coordinates every aggregated client trained (null: none, or no noise)"),
    Column("dp_snr_partial", pa.float64(), "privacy.mode=central: the same over the coordinates only some aggregated "
           "clients trained (a wider sub-model's outer channels; null: none, or no noise)"),
    Column("dp_unclipped_noised", pa.float64(), "privacy.clipping=adaptive: the noised fraction of updates within C "
           "that moved C for the next round (Andrew et al. 2021); null otherwise"),
    Column("ari_domain", pa.float64(),
           "adjusted Rand index of the strategy's client groups (RoundRecords.groups) vs. the true domains, on "
           "the rounds it forms them (FedSAP: DGA rounds); recorded from ground truth, never by the strategy"),
    Column("frozen_params", pa.int64(),
     "trainable coordinates no aggregated client has covered since initialisation, after this round (papers/003 "
     "Prop. 3)"),
    Column("domain_coverage", pa.float64(),
     "share of trainable coordinates some client of this domain has trained, and had aggregated, since round 1 "
     "(global row: any client; a straggler's discarded update does not count)"),
]

CLIENTS_COLUMNS: list[Column] = [
    Column("schema_version", pa.int32(), "results schema version"),
    Column("run_id", pa.string(), "run id"),
    Column("round", pa.int64(), "communication round, 1-based"),
    Column("client_id", pa.int64(), "client id"),
    Column("true_domain", pa.string(), "ground-truth domain of the client's data"),
    Column("pruning_ratio", pa.float64(), "FedSAP rho_i (0 under capacity tiers)"),
    Column("capacity_max", pa.float64(), "the device capacity: the most of the model it can train (kappa_i; p_max in HAS-FL's paper)"),
    Column("capacity_used", pa.float64(), "the trained width: share of channels the client trained this round (realised p_i / kappa_i)"),
    Column("assigned_width", pa.float64(), "the width the strategy assigned the client this round, as planned: p_i of "
           "the nested-width methods, the capacity kappa_i of FedDrop, FedMP, NeFL, FedSPU, DapperFL "
           "and FedSAP, 1.0 for full-model methods; capacity_used is the trained width, what the sub-model realised "
           "(Strategy.assigned_width)"),
    Column("tv_distance", pa.float64(), "ground truth: TV(client label dist., global label dist.); recorded, never shown to strategies"),
    Column("n_samples", pa.int64(), "local training samples"),
    Column("train_loss", pa.float64(), "mean local training loss over the round's steps"),
    Column("params_trained", pa.int64(), "trainable parameters (nn.Parameters; BN running statistics not counted) the "
     "client updated in local training, any epoch (DapperFL's default: the full model, its first epoch trains all "
     "of it; FedSPU: its active neurons only); Strategy.params_trained"),
    Column("macs_per_sample", pa.int64(), "per-sample forward multiply-accumulates of the model the client runs at "
     "inference (its sub-model), one pass: Compute.mask_macs of the plan's coverage unless the strategy refines "
     "it (DapperFL's pruned model); not what training spent: see train_macs"),
    Column("train_macs", pa.int64(), "forward multiply-accumulates the client executed in local training, all epochs: "
     "sum over its steps of batch samples x per-sample forward MACs of the network run in that step x forward "
     "passes per step (MOON's frozen models, DapperFL's full-model first epoch, FedSPU's frozen neurons "
     "included); backward not counted (about 2x the forward on the trained part); Strategy.train_macs"),
    Column("bytes_up", pa.int64(), "bytes uploaded"),
    Column("bytes_down", pa.int64(), "bytes downloaded"),
    Column("wall_s", pa.float64(), "local training wall time, seconds"),
    Column("worker", pa.string(), "which worker ran the client ('local' in-process)"),
    Column("gpu_id", pa.int64(), "GPU id the worker saw (null on CPU)"),
    Column("compile", pa.string(), "resources.compile: the client's training forward was eager ('off'), eager because a "
           "client hook cannot be compiled ('fallback', named in a warning), compiled for a shape its process had seen "
           "('hit') or compiled now ('miss'), or eager because its process held the cache's capacity ('refused')"),
    Column("node", pa.string(), "Ray node id of the process that trained the client, first 12 hex digits: the worker's, or "
           "the trial's for a sweep trial training in-process; 'local' outside Ray"),
    Column("sim_time_s", pa.float64(), "simulated seconds of the client-round on its device (fedsap_ray.data.devices): "
           "(1 + devices.backward_factor) x train_macs / speed + bytes_down / down + bytes_up / up"),
    Column("straggler", pa.bool_(), "trained but left out of aggregation by devices.policy (its compute counted)"),
    Column("version_trained", pa.int64(), "devices.mode=async: the model version (server steps done) the client "
           "downloaded and trained on (null in sync runs)"),
    Column("version_applied", pa.int64(), "devices.mode=async: the model version its update was applied to (this row's "
           "round - 1); null for an update discarded as too stale (straggler) and in sync runs"),
    Column("staleness", pa.int64(), "devices.mode=async: server steps between the version trained on and the version "
           "at arrival (null in sync runs)"),
    Column("sim_arrival_s", pa.float64(), "devices.mode=async: simulated time the update arrived at the server (its "
           "start + sim_time_s; null in sync runs)"),
    Column("dp_update_norm", pa.float64(), "privacy: L2 norm of the client's update (trained minus downloaded, over "
           "the coordinates it uploaded) before clipping; null without privacy and for a straggler"),
    Column("dp_clipped", pa.bool_(), "privacy: whether that norm exceeded the round's clip norm (the update was "
           "scaled to it); null without privacy and for a straggler"),
    Column("staleness_weight", pa.float64(), "devices.mode=async: s(staleness) of asynchronous.staleness, the factor on "
           "the update's delta before asynchronous.server_lr (null for a discarded update and in sync runs)"),
]

LAYERS_COLUMNS: list[Column] = [
    Column("schema_version", pa.int32(), "results schema version"),
    Column("run_id", pa.string(), "run id"),
    Column("round", pa.int64(), "communication round, 1-based"),
    Column("client_id", pa.int64(), "client id"),
    Column("layer", pa.string(), "ChannelSpace layer (e.g. layer1, layer2.0.conv1)"),
    Column("channels", pa.int64(), "C_l, channels of the layer"),
    Column("keep_ratio", pa.float64(), "the layer's trained width kappa_{i,l}: fraction of the layer's channels active for this client"),
]

ALLOCATIONS_COLUMNS: list[Column] = [
    Column("schema_version", pa.int32(), "results schema version"),
    Column("run_id", pa.string(), "run id"),
    Column("round", pa.int64(), "communication round, 1-based"),
    Column("client_id", pa.int64(), "client id (every client of the federation, sampled or not)"),
    Column("capacity_max", pa.float64(), "the client's capacity (p_max in HAS-FL's paper): its resource constraint"),
    Column("tv_distance", pa.float64(), "ground truth: TV(client label dist., global label dist.); recorded, never shown to strategies"),
]

CORE_TABLES: dict[str, list[Column]] = {
    "runs": RUNS_COLUMNS, "rounds": ROUNDS_COLUMNS, "clients": CLIENTS_COLUMNS, "layers": LAYERS_COLUMNS,
    "allocations": ALLOCATIONS_COLUMNS,
}
DATA_TABLES = RECORDED_TABLES  # per-round tables (everything but runs)
# What one row of each table is (docs/reference/results.md is generated from these declarations).
TABLE_ROWS: dict[str, str] = {
    "runs": "one row per run: its provenance (the resolved config), status, times and headline accuracies; "
            "results.load and read_table add one config.<section>.<field> column per config leaf",
    "rounds": f"one row per (round, evaluated model, test domain) plus a '{GLOBAL_DOMAIN}' row per round and model",
    "clients": "one row per (round, participating client): its data, capacity, mask and cost",
    "layers": "one row per (round, client, channel layer): where a client's channel budget went (FedSAP)",
    "allocations": "one row per (round, client): the widths and heterogeneity estimates of the sub-model "
                   "allocation strategies, for every client of the federation (sampled or not) at round 1, at "
                   "each adaptation step and at the last round, and for the round's clients in the rounds between "
                   "(the rows left out repeat the latest one: widths change only at an adaptation step)",
}
# the columns that identify a table's rows: a file in the table's folder must have them
KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("run_id", "status"), "rounds": ("run_id", "round", "domain"),
    "clients": ("run_id", "round", "client_id"), "layers": ("run_id", "round", "client_id", "layer"),
    "allocations": ("run_id", "round", "client_id", "p"),
}


def extension_columns(table: str) -> dict[str, tuple[Column, list[str]]]:
    """column name -> (its declaration, the registered strategies declaring it), in registry order.

    Two strategies may declare the same column (the channel counts) only with the same Arrow
    type; a declaration may not reuse a core column's name (the core fills those).
    """
    from fedsap_ray.algorithms import registry
    from fedsap_ray.algorithms.declarations import declared_columns

    if table not in CORE_TABLES:
        raise ValueError(f"invalid table={table!r}: allowed values are {sorted(CORE_TABLES)}")
    core = {c.name for c in CORE_TABLES[table]}
    out: dict[str, tuple[Column, list[str]]] = {}
    for name in registry.names():
        for col in declared_columns(registry.get(name), table):
            if col.name in core:
                raise ValueError(f"algorithm {name!r} declares {table}.{col.name}, a core column")
            if col.name not in out:
                out[col.name] = (col, [name])
            elif out[col.name][0].type != col.type:
                first = out[col.name]
                raise ValueError(f"{table}.{col.name}: algorithm {name!r} declares type {col.type}, "
                                 f"{first[1][0]!r} declared {first[0].type}")
            else:
                out[col.name][1].append(name)
    return out


class _Tables(Mapping[str, list[Column]]):
    """table -> its columns: the core ones, then every registered strategy's (read at each access, so a
    strategy registered later, e.g. a plugin, is in the schema from then on)."""

    def __getitem__(self, table: str) -> list[Column]:
        core = CORE_TABLES[table]
        if table not in DATA_TABLES:
            return list(core)
        return [*core, *(c for c, _ in extension_columns(table).values())]

    def __iter__(self) -> Iterator[str]:
        return iter(CORE_TABLES)

    def __len__(self) -> int:
        return len(CORE_TABLES)


TABLES: Mapping[str, list[Column]] = _Tables()


def schema(table: str) -> pa.Schema:
    return pa.schema([pa.field(n, t, metadata={"doc": d}) for n, t, d in TABLES[table]])


def to_table(table: str, rows: list[dict[str, Any]]) -> pa.Table:
    """Typed Arrow table; unknown keys are an error so the declarations stay the one source of truth."""
    sch = schema(table)
    names = set(sch.names)
    for r in rows:
        extra = set(r) - names
        if extra:
            raise KeyError(f"{table}: columns {sorted(extra)} are not in the schema (declare them in the "
                           "strategy's `columns`, fedsap_ray/algorithms/contract.py)")
    cols = {n: [r.get(n) for r in rows] for n in sch.names}
    return pa.Table.from_pydict(cols, schema=sch)


def check_table(table: str) -> None:
    if table not in TABLES:
        raise ValueError(f"invalid table={table!r}: allowed values are {sorted(TABLES)}")


# ----------------------------------------------------------------------------- what the readers check
# The columns that identify one row of each table (not KEY_COLUMNS, which tell a table's files apart): the readers
# refuse a table that holds one of these keys twice, in one file or in two.
ROW_KEYS: dict[str, tuple[str, ...]] = {
    "runs": ("run_id",), "rounds": ("run_id", "round", "eval_mode", "domain"),
    "clients": ("run_id", "round", "client_id"), "layers": ("run_id", "round", "client_id", "layer"),
    "allocations": ("run_id", "round", "client_id"),
}
# The core columns each schema version brought, by table: the first version *every* writer of which wrote the column
# (read from this file's history: a few columns reached writers a version before SCHEMA_VERSION's comment names).
# A file holding rows of version v has every column listed under 1..v (readers refuse one that lacks any); a column
# of a later version is null in it. A core column listed nowhere is required of no file, so list each new one under
# the version that adds it (tests/results/test_readers.py checks that every core column is listed).
COLUMNS_SINCE: dict[int, dict[str, str]] = {
    1: {"runs": "schema_version run_id study algorithm dataset model preset seed num_clients rounds rounds_done backend "
                "config_json config_hash started_at finished_at status error package_version wall_s "
                "final_global_accuracy best_global_accuracy dataset_notes",
        "rounds": "schema_version run_id round domain eval_mode evaluated accuracy loss n_test global_accuracy "
                  "best_global_accuracy worst_domain_accuracy avg_capacity n_clients bytes_up bytes_down train_loss "
                  "round_wall_s",
        "clients": "schema_version run_id round client_id true_domain pruning_ratio capacity_max capacity_used "
                   "tv_distance n_samples train_loss params_trained macs_per_sample bytes_up bytes_down wall_s worker "
                   "gpu_id",
        "layers": "schema_version run_id round client_id layer channels keep_ratio",
        "allocations": "schema_version run_id round client_id capacity_max tv_distance"},
    2: {"rounds": "ari_domain frozen_params"},
    3: {"rounds": "domain_coverage"},
    4: {"rounds": "n_eval_clients eval_clients_sampled worst_client_accuracy worst_client_id"},
    5: {"rounds": "train_s eval_s server_s", "clients": "train_macs"},
    6: {"rounds": "sim_round_s sim_elapsed_s n_stragglers", "clients": "sim_time_s straggler"},
    7: {"clients": "node"},
    8: {"runs": "torch_version cpu_kernels"},
    10: {"rounds": "backend_bytes_down backend_bytes_up updates_applied staleness_mean staleness_max",
         "clients": "version_trained version_applied staleness sim_arrival_s staleness_weight"},
    11: {"runs": "rows_written"},
    12: {"runs": "partition_source partition_hash models_kept", "clients": "assigned_width"},
    13: {"rounds": "eval_compiles", "clients": "compile"},
    14: {"rounds": "dp_epsilon dp_clip_norm dp_noise_std dp_snr_shared dp_snr_partial dp_unclipped_noised",
         "clients": "dp_update_norm dp_clipped"},
}


def required_columns(table: str, version: int) -> list[str]:
    """The core columns every file of ``table`` holding rows of schema ``version`` has (:data:`COLUMNS_SINCE`)."""
    return [c for v, tables in sorted(COLUMNS_SINCE.items()) if v <= version for c in tables.get(table, "").split()]
