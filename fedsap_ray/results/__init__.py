"""What a run leaves: the Parquet tables (schema, recorder, writer, readers), kept models, exports, destinations.

May import: common, config, persist, models, data, algorithms, engine.

The tables: one typed schema per table, atomic writes, and :func:`load`.

The package, by responsibility: :mod:`~fedsap_ray.results.schema` (the core columns and the columns
strategies declare), :mod:`~fedsap_ray.results.store` (local folders and URIs, listings, run ids,
atomic streams), :mod:`~fedsap_ray.results.writer` (:class:`RunWriter`, per-round parts merged into per-run files),
:mod:`~fedsap_ray.results.reader` (:func:`load`, :func:`read_table`) and
:mod:`~fedsap_ray.results.compaction` (:func:`compact`); everything public is re-exported here.

Layout of an output folder (docs/reference/results.md is generated from the declarations in schema.py)::

    OUT/runs/<run_id>.parquet      one row per run (provenance: the resolved config)
    OUT/rounds/<run_id>.parquet    one row per (round, domain) plus a ``__global__`` row
    OUT/clients/<run_id>.parquet   one row per (round, participating client)
    OUT/layers/<run_id>.parquet    one row per (round, client, layer): where the budget went (FedSAP)
    OUT/allocations/<run_id>.parquet  one row per (round, client): widths and heterogeneity estimates of
                                   the sub-model allocation strategies, for every client at round 1, at
                                   each adaptation step and at the last round, else the round's clients
    OUT/<table>/<run_id>@r<round:06d>.parquet  one round's rows of a run in progress (a "part"),
                                   merged into ``<run_id>.parquet`` when the run ends
    OUT/<table>/compacted-<uuid8>.parquet  rows of many final runs (:func:`compact`,
                                   ``fedsap-ray compact OUT``)
    OUT/models/<run_id>/           the models the run keeps (``training.keep_model``; :mod:`~fedsap_ray.results.kept`:
                                   :func:`load_model`, :func:`kept_models`, :func:`evaluate_kept`)

so ``pandas.read_parquet(OUT / "rounds")`` reads a whole sweep; :func:`load` reads it in
one multi-threaded pyarrow dataset scan per table, from a local folder or a URI
(``s3://bucket/sweep``, anything ``pyarrow.fs.FileSystem.from_uri`` accepts), and gives
each run's rows exactly once even after an interrupted compaction. Writes are append-only:
each round adds one part file per table (its cost does not grow with the round number) and
the run's end merges its parts into ``<run_id>.parquet`` (:func:`consolidate_run`), whose
schema metadata ``fedsap_ray.upto_round`` says which parts it already holds (readers skip
those, so a merge interrupted before it deleted the parts reads every row once). Every file
is written through a temporary file whose name starts with ``.`` (which pyarrow ignores) and
:func:`os.replace`, so a run killed at any moment leaves only complete files: the rounds
finished so far and a ``runs`` row (one small file, rewritten every round) whose status says
what happened.
``schema_version`` lets later versions read old folders (:func:`load` adds the columns of later
versions that an older file lacks as nulls, and ignores columns outside the schema). Every file is
checked as it is read (:mod:`~fedsap_ray.results.reader`): a run's rows under another run's name, a row
key (:data:`ROW_KEYS`) twice, an unknown version, a column its version had (:data:`COLUMNS_SINCE`)
missing or of a type that cannot hold the schema's values, a ``config_json`` that is no JSON object:
:class:`UnreadableFile`, one line naming the file.
"""
from __future__ import annotations

from fedsap_ray.results.compaction import compact
from fedsap_ray.results.kept import KeptModelError, evaluate_kept, kept_models, load_model, read_kept
from fedsap_ray.results.reader import CONFIG_PREFIX, Results, load, read_table, run_statuses, with_config_columns
from fedsap_ray.results.schema import (ALLOCATIONS_COLUMNS, CLIENTS_COLUMNS, COLUMNS_SINCE, CORE_TABLES, DATA_TABLES,
                                       GLOBAL_DOMAIN, KEY_COLUMNS, LAYERS_COLUMNS, ROUNDS_COLUMNS, ROW_KEYS, RUNS_COLUMNS,
                                       SCHEMA_VERSION, TABLE_ROWS, TABLES, WALL_CLOCK, extension_columns,
                                       required_columns, schema, to_table)
from fedsap_ray.results.store import (COMPACTED_PREFIX, FINAL_STATUSES, PART_SEP, RUN_ID_PATTERN, RUN_ID_RULE, UPTO_KEY,
                                      UnreadableFile, atomic_output, check_run_id, filesystem, foreign_reason, is_uri,
                                      part_name, run_files_in)
from fedsap_ray.results.writer import (RunWriter, consolidate_run, drop_compacted, in_compacted, remove_run,
                                       remove_temp_files, row_counts, run_files, write_atomic)

__all__ = [
    "ALLOCATIONS_COLUMNS", "CLIENTS_COLUMNS", "COLUMNS_SINCE", "COMPACTED_PREFIX", "CONFIG_PREFIX", "CORE_TABLES",
    "DATA_TABLES", "FINAL_STATUSES", "GLOBAL_DOMAIN", "PART_SEP", "KEY_COLUMNS", "LAYERS_COLUMNS", "ROUNDS_COLUMNS",
    "ROW_KEYS", "RUNS_COLUMNS", "RUN_ID_PATTERN", "RUN_ID_RULE", "SCHEMA_VERSION", "TABLES", "TABLE_ROWS", "UPTO_KEY",
    "UnreadableFile", "WALL_CLOCK", "Results", "RunWriter",
    "atomic_output", "check_run_id", "compact", "consolidate_run", "extension_columns", "filesystem", "foreign_reason",
    "KeptModelError", "evaluate_kept", "kept_models", "load_model", "read_kept",
    "in_compacted", "is_uri", "load", "part_name", "read_table", "remove_run", "remove_temp_files", "run_files",
    "run_files_in", "drop_compacted", "required_columns", "row_counts",
    "run_statuses", "schema", "to_table", "with_config_columns", "write_atomic",
]
