"""Reading what the trackers wrote, with each tracker's own library, and the cells of a rounds table to compare.

``tensorboard_scalars``/``tensorboard_hparams``: TensorBoard's ``EventAccumulator``; ``mlflow_runs``:
``MlflowClient``; ``wandb_records``: an offline W&B run's ``.wandb`` file, record by record, parsed with W&B's own
protocol buffers (``wandb.proto.wandb_internal_pb2.Record``). The file is LevelDB's log format (32 KiB blocks of
chunks, each a 7-byte header: CRC, length, type) after a 7-byte ``:W&B`` header; wandb no longer ships a Python
reader for it (its Go core writes it), so the few lines below split the chunks.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

ROW_KEYS = ("schema_version", "run_id", "round", "domain", "eval_mode", "evaluated")


def rounds_cells(out: Path, run_id: str) -> list[tuple[int, str, str, str, float]]:
    """Every non-null number of a finished run's rounds rows: (round, eval mode, domain, column, value); the
    mode of a round that evaluated nothing is 'not_evaluated' (docs/guides/trackers.md)."""
    cells = []
    for row in pq.read_table(out / "rounds" / f"{run_id}.parquet").to_pylist():
        mode = row["eval_mode"] or "not_evaluated"
        for column, value in row.items():
            if column in ROW_KEYS or value is None or isinstance(value, str):
                continue
            cells.append((row["round"], mode, row["domain"], column, float(value)))
    return cells


def check_curves(curves: dict[str, dict[int, float]], out: Path, run_id: str) -> None:
    """``curves`` (metric -> step -> value, as a tracker holds them) hold every cell of the run's rounds table at
    step = its round, under the name of its row (``mode/domain/column``), of its eval mode (``mode/column``) or of
    its round (``column``), with the table's value; and nothing else."""
    used: set[tuple[str, int]] = set()
    for rnd, mode, domain, column, value in rounds_cells(out, run_id):
        names = [n for n in (f"{mode}/{domain}/{column}", f"{mode}/{column}", column) if rnd in curves.get(n, {})]
        assert len(names) == 1, f"round {rnd} {mode}/{domain}/{column}: logged under {names or 'no name'}"
        got = curves[names[0]][rnd]
        assert got == value or (math.isnan(got) and math.isnan(value)), \
            f"round {rnd} {mode}/{domain}/{column}: the table holds {value}, the tracker {got} under {names[0]}"
        used.add((names[0], rnd))
    logged = {(n, s) for n, steps in curves.items() for s in steps}
    assert logged == used, f"logged but in no cell of the table: {sorted(logged - used)[:5]}"


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value of every scalar in the event files of ``folder`` (TensorBoard's reader, purges
    applied), the float64 ones the trackers write included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars":
            out[tag] = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
    for tag in acc.Tags()["scalars"]:
        out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return out


def tensorboard_hparams(folder: Path) -> dict[str, Any]:
    """The hparams of the last session started in ``folder``, as TensorBoard's HParams plugin reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(folder))
    acc.Reload()
    data = plugin_data_pb2.HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in data.session_start_info.hparams.items()}


def tensorboard_text(folder: Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return tensor_util.make_ndarray(acc.Tensors(tag)[-1].tensor_proto).item().decode()


def mlflow_runs(uri: str, experiment: str) -> dict[str, dict[str, Any]]:
    """run name -> its status, params, tags, curves (metric -> step -> value) and artifacts, read with MlflowClient."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    found = {}
    for run in client.search_runs([exp.experiment_id]):
        rid = run.info.run_id
        curves = {k: {m.step: m.value for m in client.get_metric_history(rid, k)} for k in run.data.metrics}
        arts = [a.path for a in client.list_artifacts(rid, "models")]
        assert run.info.run_name not in found, f"two MLflow runs named {run.info.run_name}"
        found[run.info.run_name] = dict(status=run.info.status, params=run.data.params, tags=run.data.tags,
                                        curves=curves, artifacts=arts)
    return found


def _chunks(data: bytes) -> Iterator[bytes]:
    block, pos, pending = 32768, 7, b""  # after the ':W&B' + magic + version header
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # FULL
            yield chunk
        elif kind == 2:  # FIRST
            pending = chunk
        elif kind == 3:  # MIDDLE
            pending += chunk
        elif kind == 4:  # LAST
            yield pending + chunk
            pending = b""


def wandb_records(folder: Path) -> list[Any]:
    """Every record of every offline run under ``folder/wandb/``, parsed with W&B's protocol buffers."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for f in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        data = f.read_bytes()
        assert data[:4] == b":W&B", f"{f} is not a W&B run file"
        for chunk in _chunks(data):
            rec = pb.Record()
            rec.ParseFromString(chunk)
            records.append(rec)
    return records


def wandb_run(folder: Path) -> dict[str, Any]:
    """The offline W&B run(s) of ``folder`` read back: name, tags, config and curves (metric -> step -> value)."""
    run: dict[str, Any] = {"curves": {}, "config": {}, "names": set(), "tags": set(), "files": set()}
    for rec in wandb_records(folder):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run["names"].add(rec.run.display_name)
            run["tags"].update(rec.run.tags)
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # W&B's own _step, _timestamp, _runtime
                    run["curves"].setdefault(key, {})[rec.history.step.num] = float(json.loads(item.value_json))
        elif kind == "files":
            run["files"].update(f.path for f in rec.files.files)
    return run
