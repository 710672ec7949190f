"""Experiment trackers: TensorBoard, MLflow and Weights & Biases, fed from what a run records.

``fedsap-ray run --tracker NAME`` and every sweep script's ``--tracker NAME`` (docs/guides/trackers.md) open
one tracker run per results run and feed every chosen tracker the same records:

- the resolved config as parameters, one per leaf, under the dotted keys of the runs table's ``config.*``
  columns (:func:`config_params`), and the run's study, seed, algorithm and run id (a sweep adds its variant
  and trial) as tags (:func:`run_tags`);
- after every round, every number of the rows that round wrote to the ``rounds`` table
  (:attr:`fedsap_ray.engine.server.RoundSummary.rows`), named by :func:`round_metrics`, at step = the round: what is
  logged is what the table holds, never a figure computed again;
- at the end, the model files the run kept (``OUT/models/<run_id>/``) where the tracker stores files
  (MLflow, W&B; TensorBoard has no place for them).

A run feeds them through a driver callback (:class:`TrackerCallback`); a sweep through a Ray Tune logger
callback on its driver (``sweeps/tuner.py``), to which each trial reports its rounds' metrics. The tables
stay the record: a tracker that fails (a full disk, a server that went away) is reported once on stderr and
dropped for that run, and the run goes on (:class:`TrackedRun`). The libraries are the
``trackers`` extra, imported only by the tracker that uses them; a missing one is refused before the run
starts (:func:`check_libraries`). No Ray here.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fedsap_ray.run.driver import DriverCallback
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.checks import clip
from fedsap_ray.config.schema import ExperimentConfig

if TYPE_CHECKING:  # the command line reads TRACKERS without torch
    from fedsap_ray.engine.server import RoundSummary
    from fedsap_ray.run.session import RunOutcome, SessionMetrics

TRACKERS = ("tensorboard", "mlflow", "wandb")
# the import that proves each tracker's library is installed (all three are the `trackers` extra)
LIBRARIES = {"tensorboard": "torch.utils.tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
EXTRA_HINT = "pip install 'fedsap-ray[trackers]'"
FOLDER = "_trackers"  # OUT/_trackers/<tracker>: where trackers write unless --tracker-uri says otherwise

# How a rounds row's columns become metric names (round_metrics): the columns that say which row it is ...
ROW_KEYS = frozenset({"schema_version", "run_id", "round", "domain", "eval_mode", "evaluated"})
# ... the columns of one (eval mode, domain) row: "<eval_mode>/<domain>/<column>"
ROW_COLUMNS = frozenset({"accuracy", "loss", "n_test", "n_eval_clients", "eval_clients_sampled",
                         "worst_client_accuracy", "worst_client_id", "domain_coverage"})
# ... the columns every row of one eval mode shares: "<eval_mode>/<column>"
MODE_COLUMNS = frozenset({"global_accuracy", "best_global_accuracy", "worst_domain_accuracy"})
# every other column is the round's (cost, time, simulated time, staleness, the strategy's own): "<column>"
NOT_EVALUATED = "not_evaluated"  # the eval-mode part of a round that evaluated nothing (training.eval_every)


@dataclass(frozen=True)
class TrackerSpec:
    """One chosen tracker and where it writes: a folder, or for MLflow a tracking URI as MLflow takes it."""

    name: str  # tensorboard | mlflow | wandb
    location: str  # absolute folder, or (mlflow) a URI: sqlite:///..., http(s)://..., databricks, ...
    out: str | None = None  # the results folder when the location lies in it (checked as its entries are)


@dataclass(frozen=True)
class RunInfo:
    """What every tracker's run of one results run is opened with."""

    run_id: str
    study: str  # the MLflow experiment, the W&B project
    first_round: int  # 1 for a new run, t + 1 for one resumed after round t (it continues its tracker runs)
    params: dict[str, Any]  # config_params
    tags: dict[str, str]  # run_tags


class Tracker(Protocol):
    """One tracker's run of one results run, fed by :class:`TrackedRun` (each call may raise: it is then dropped)."""

    name: str

    def start(self, run: RunInfo) -> None:
        """Open (or, when resuming, continue) the run; log its parameters and tags."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """One round's metrics at ``step`` (the round)."""

    def log_files(self, paths: Sequence[Path]) -> None:
        """Store the run's kept model files (a tracker without file storage ignores them)."""

    def close(self, status: str) -> None:
        """End the run with the results run's status (finished, failed, interrupted, stopped)."""


# ---------------------------------------------------------------------------------------------- records
def round_metrics(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Every number of one round's ``rounds`` rows, by name: ``<eval_mode>/<domain>/<column>`` for a row's own
    columns (``global/__global__/accuracy``, ``deployed/mnist/worst_client_accuracy``), ``<eval_mode>/<column>``
    for those every row of its mode shares (``group/best_global_accuracy``), ``<column>`` for the round's
    (``bytes_up``, ``sim_elapsed_s``, ``staleness_mean``, a strategy's own). A round that evaluated nothing has
    the mode ``not_evaluated``. Nulls are left out, booleans are 0/1; names keep to the characters every
    tracker accepts (others become ``_``). Each name is one cell of the table, so nothing is averaged."""
    out: dict[str, float] = {}
    for row in rows:
        mode = row.get("eval_mode") or NOT_EVALUATED
        for column, value in row.items():
            number = _number(value)
            if column in ROW_KEYS or number is None:
                continue
            if column in ROW_COLUMNS:
                name = f"{mode}/{row.get('domain')}/{column}"
            elif column in MODE_COLUMNS:
                name = f"{mode}/{column}"
            else:
                name = column
            out[metric_name(name)] = number
    return out


def metric_name(name: str) -> str:
    """``name`` with every character MLflow refuses in a metric name (it allows letters, digits, ``_ - . / :``
    and spaces) replaced by ``_``, so every tracker shows the same names."""
    return re.sub(r"[^A-Za-z0-9_\-./: ]", "_", name)


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)  # bool, int, float and numpy scalars
    except (TypeError, ValueError):
        return None


def config_params(cfg: ExperimentConfig) -> dict[str, Any]:
    """The resolved config, one entry per leaf under the dotted keys of the runs table's ``config.*`` columns
    (:func:`fedsap_ray.results.reader.with_config_columns` flattens the same JSON the same way)."""
    import pandas as pd

    flat = pd.json_normalize(json.loads(cfg.to_json()), sep=".")
    return {k: _plain(v) for k, v in flat.iloc[0].items()} if len(flat.columns) else {}


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") and not isinstance(v, (list, dict)) else v


def param_text(value: Any) -> str:
    """A parameter as text (MLflow's parameters and TensorBoard's non-scalar ones): strings as they are,
    anything else as JSON (``true``, ``0.1``, ``null``, ``[1, 2]``)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def run_tags(cfg: ExperimentConfig, run_id: str, **extra: Any) -> dict[str, str]:
    """The run's tags: ``study``, ``seed``, ``algorithm``, ``run_id`` and ``extra`` (a sweep's ``variant``,
    ``trial``), None values left out."""
    tags = {"study": cfg.study, "seed": cfg.seed, "algorithm": cfg.algorithm.name, "run_id": run_id, **extra}
    return {k: str(v) for k, v in tags.items() if v is not None}


def run_info(cfg: ExperimentConfig, run_id: str, first_round: int, **tags: Any) -> RunInfo:
    return RunInfo(run_id=run_id, study=cfg.study, first_round=first_round, params=config_params(cfg),
                   tags=run_tags(cfg, run_id, **tags))


def kept_files(out: str | Path, run_id: str) -> list[Path]:
    """The model files a run kept, ``OUT/models/<run_id>/`` (:func:`fedsap_ray.results.kept_models`: through the
    results folder's checks, no link followed); [] when it kept none."""
    from fedsap_ray.results import kept_models

    return kept_models(out, run_id)


# ---------------------------------------------------------------------------------------------- choosing
def add_tracker_args(p: Any, logs: str, default_where: str = "default OUT/_trackers/NAME") -> None:
    """``--tracker`` and ``--tracker-uri`` on an argparse parser (``fedsap-ray run`` and every sweep script):
    ``logs`` says what one tracker run holds, ``default_where`` where the files go by default."""
    p.add_argument("--tracker", action="append", default=[], choices=TRACKERS,
                   help=f"also log {logs} to this experiment tracker (repeatable; docs/guides/trackers.md); needs "
                        "the trackers extra")
    p.add_argument("--tracker-uri", action="append", default=[], metavar="[NAME=]LOCATION",
                   help="where trackers write (repeatable): a folder for all (each in its own subfolder), or "
                        f"NAME=LOCATION for one (mlflow: a folder or a tracking URI); {default_where}")


def tracker_specs(names: Sequence[str] | None, uris: Sequence[str] | None, out: str | None,
                  field: str = "--tracker-uri") -> tuple[TrackerSpec, ...]:
    """The trackers of ``--tracker NAME`` (repeatable) and where each writes, from ``--tracker-uri`` (repeatable):
    ``FOLDER`` (every tracker in ``FOLDER/<name>``) or ``NAME=LOCATION`` (one tracker: a folder, or for MLflow a
    tracking URI); by default ``OUT/_trackers/<name>`` of the local results folder ``out`` (None: ``--out`` is a
    URI, so a location must be given). Checked before anything runs; each refusal one line naming the flag."""
    chosen = list(dict.fromkeys(names or ()))
    if not chosen:
        if uris:
            raise ConfigError(f"invalid {field}={uris[0]!r}: no --tracker is given; add --tracker "
                              f"{'|'.join(TRACKERS)} or leave {field} out")
        return ()
    base, own = _parse_uris(uris or (), chosen, field)
    specs = []
    for name in chosen:
        if name in own:
            specs.append(_spec(name, own[name], field, None))
        elif base is not None:
            specs.append(_spec(name, str(Path(base) / name), field, None))
        elif out is not None:
            specs.append(_spec(name, str(Path(out) / FOLDER / name), "--out", out))
        else:
            raise ConfigError(f"invalid --tracker {name}: --out is a URI and trackers write to this machine; give "
                              f"{field} FOLDER (or {name}=LOCATION)")
    return tuple(specs)


def _parse_uris(uris: Sequence[str], chosen: Sequence[str], field: str) -> tuple[str | None, dict[str, str]]:
    base: str | None = None
    own: dict[str, str] = {}
    for text in uris:
        head, sep, rest = text.partition("=")
        if sep and head in TRACKERS:
            if head not in chosen:
                raise ConfigError(f"invalid {field}={text!r}: --tracker {head} is not given; add it or drop this "
                                  f"{field}")
            if head in own:
                raise ConfigError(f"invalid {field}={text!r}: {head} is given a location twice")
            if not rest.strip():
                raise ConfigError(f"invalid {field}={text!r}: must name a location after {head}=")
            own[head] = rest
        elif not text.strip():
            raise ConfigError(f"invalid {field}={text!r}: must name a folder, or NAME=LOCATION for one tracker")
        elif base is not None:
            raise ConfigError(f"invalid {field}={text!r}: a folder for every tracker is given twice ({base!r} "
                              "first); give one, or NAME=LOCATION for one tracker")
        else:
            base = text
    if base is not None and _is_uri(base):
        raise ConfigError(f"invalid {field}={base!r}: the location for every tracker is a local folder; a tracking "
                          "URI is given for one tracker: mlflow=URI")
    return base, own


def _is_uri(text: str) -> bool:
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*:", text)) and not re.match(r"^[A-Za-z]:[\\/]", text)


def _spec(name: str, location: str, field: str, out: str | None) -> TrackerSpec:
    """The checked spec: a folder must be one this process can create (no file there; under the results folder
    ``out``, no link on the way); a URI is for MLflow only. ``field`` names the flag that gave the location."""
    if _is_uri(location):
        if name != "mlflow":
            raise ConfigError(f"invalid {field}={location!r}: {name} writes to a local folder, not a URI")
        return TrackerSpec(name, location)
    from fedsap_ray.run.guard import check_out_writable
    from fedsap_ray.persist.outdir import DIR, OutDir

    folder = Path(location).expanduser().absolute()
    if out is not None:
        OutDir(out).check(folder, DIR)  # inside the results folder: no link, no file where a folder goes
    check_out_writable(folder, field=field)
    return TrackerSpec(name, str(folder), out)


def check_libraries(specs: Sequence[TrackerSpec]) -> None:
    """Each chosen tracker's library imports; else one line naming the extra that installs it."""
    import importlib

    for spec in specs:
        try:
            importlib.import_module(LIBRARIES[spec.name])
        except ImportError:
            raise ConfigError(f"--tracker {spec.name} needs the trackers extra: {EXTRA_HINT}") from None


# ---------------------------------------------------------------------------------------------- the three
class TensorBoardTracker:
    """Event files in ``<folder>/<run_id>/``: every metric as a float64 scalar (exact: a float32 one would round
    byte counts past 2**24), the parameters as TensorBoard's hparams, the tags as text. Resuming after round t
    purges events past t that an earlier writer left (``purge_step``), so a rerun of the same run id replaces its
    curves instead of drawing over them."""

    name = "tensorboard"

    def __init__(self, spec: TrackerSpec) -> None:
        self.spec = spec
        self.writer: Any = None

    def start(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        folder = _made(self.spec, Path(self.spec.location) / run.run_id)
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=run.first_round)
        values = {k: v if isinstance(v, (bool, int, float, str)) else param_text(v) for k, v in run.params.items()}
        for summary in hparams(values, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("tags", "\n".join(f"- {k}: {v}" for k, v in run.tags.items()))
        self.writer.flush()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step, new_style=True, double_precision=True)
        self.writer.flush()

    def log_files(self, paths: Sequence[Path]) -> None:
        """TensorBoard stores no files."""

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()


MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED", "stopped": "KILLED"}


class MLflowTracker:
    """An MLflow run named by the run id in the experiment named by the study, through ``MlflowClient`` (no
    global state: a sweep's driver holds many at once). A folder location is an SQLite store, ``mlflow.db``,
    with the artifacts beside it (MLflow 3 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE=true``); a
    URI is used as given. A resumed run continues the latest MLflow run tagged with its run id; a new one
    (``--overwrite``) starts another, and the old one stays."""

    name = "mlflow"

    def __init__(self, spec: TrackerSpec) -> None:
        self.spec = spec
        self.client: Any = None
        self.id: str | None = None

    def _uri(self) -> tuple[str, str | None]:
        """(tracking URI, artifact location of an experiment it creates: None lets the store decide)."""
        loc = self.spec.location
        if _is_uri(loc):
            db = loc[len("sqlite:///"):] if loc.startswith("sqlite:///") else None
            return loc, (Path(db).absolute().parent / "artifacts").as_uri() if db else None
        folder = _made(self.spec, Path(loc))
        return f"sqlite:///{folder / 'mlflow.db'}", (folder / "artifacts").as_uri()

    def start(self, run: RunInfo) -> None:
        import logging

        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating initial ... tables" on stderr
        uri, artifacts = self._uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self._experiment(run.study, artifacts)
        found = self.client.search_runs([experiment], filter_string=f"tags.run_id = '{run.run_id}'",
                                        order_by=["attributes.start_time DESC"], max_results=1) \
            if run.first_round > 1 else []
        if found:
            self.id = found[0].info.run_id
            self.client.update_run(self.id, status="RUNNING")
        else:
            self.id = self.client.create_run(experiment, run_name=run.run_id).info.run_id
        params = [Param(k, clip(param_text(v), 6000)) for k, v in run.params.items()]
        tags = [RunTag(k, v) for k, v in run.tags.items()]
        for i in range(0, max(len(params), len(tags)), 100):  # MLflow takes 100 params a batch
            self.client.log_batch(self.id, params=params[i:i + 100], tags=tags[i:i + 100])

    def _experiment(self, name: str, artifacts: str | None) -> str:
        got = self.client.get_experiment_by_name(name)
        if got is not None:
            return got.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifacts)
        except Exception:  # created meanwhile by another run writing to the same store
            got = self.client.get_experiment_by_name(name)
            if got is None:
                raise
            return got.experiment_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow takes 1000 metrics a batch
            self.client.log_batch(self.id, metrics=batch[i:i + 1000])

    def log_files(self, paths: Sequence[Path]) -> None:
        for p in paths:
            self.client.log_artifact(self.id, str(p), artifact_path="models")

    def close(self, status: str) -> None:
        if self.client is not None and self.id is not None:
            self.client.set_terminated(self.id, status=MLFLOW_STATUS.get(status, "FAILED"))


class WandbTracker:
    """A W&B run named by the run id in the project named by the study, its files under ``<folder>/wandb/``;
    offline (nothing leaves the machine: ``wandb sync`` uploads it later) unless ``WANDB_MODE`` says otherwise.
    A resumed run continues the W&B run it started (its id begins with a digest of the run id); kept models are
    copied into the run's files, which W&B uploads when it syncs (a link would break when the run is replaced)."""

    name = "wandb"

    def __init__(self, spec: TrackerSpec) -> None:
        self.spec = spec
        self.run: Any = None

    def start(self, run: RunInfo) -> None:
        import wandb

        folder = _made(self.spec, Path(self.spec.location))
        key = hashlib.sha256(run.run_id.encode()).hexdigest()[:12]
        earlier = sorted((folder / "wandb").glob(f"*run-*-{key}????????")) if run.first_round > 1 else []
        wid = earlier[-1].name.rsplit("-", 1)[-1] if earlier else key + secrets.token_hex(4)
        settings = wandb.Settings(silent=True, console="off", save_code=False, disable_git=True,
                                  disable_job_creation=True)
        self.run = wandb.init(dir=str(folder), project=run.study, name=run.run_id, id=wid, config=run.params,
                              tags=[clip(f"{k}={v}", 64) for k, v in run.tags.items()],
                              group=run.tags.get("variant"), resume="allow" if earlier else None,
                              mode=None if os.environ.get("WANDB_MODE") else "offline", reinit="create_new",
                              settings=settings)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_files(self, paths: Sequence[Path]) -> None:
        folder = Path(self.run.dir) / "models"
        folder.mkdir(parents=True, exist_ok=True)
        for p in paths:
            shutil.copyfile(p, folder / p.name)

    def close(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "finished" else 1)


MAKERS: dict[str, Callable[[TrackerSpec], Tracker]] = {
    "tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker}


def _made(spec: TrackerSpec, folder: Path) -> Path:
    """``folder`` created; inside the results folder through its checks (no link followed)."""
    from fedsap_ray.persist.outdir import OutDir

    if spec.out is not None:
        return OutDir(spec.out).mkdir(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ---------------------------------------------------------------------------------------------- feeding them
def say(line: str) -> None:
    print(f"fedsap-ray: {line}", file=sys.stderr, flush=True)


class TrackedRun:
    """Every chosen tracker's run of one results run, fed the same records. A tracker that raises is reported
    once (``warn``, default stderr) and dropped for this run; the run and the other trackers go on, because
    the results tables, not the trackers, are the record."""

    def __init__(self, specs: Sequence[TrackerSpec], info: RunInfo, warn: Callable[[str], None] = say) -> None:
        self.info, self.warn = info, warn
        self.live: list[Tracker] = []
        for spec in specs:
            tracker = MAKERS[spec.name](spec)
            self.live.append(tracker)
            self._call(tracker, "starting", partial(tracker.start, info))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker in list(self.live):
            self._call(tracker, f"logging round {step}", partial(tracker.log, step, metrics))

    def finish(self, status: str, files: Sequence[Path] = ()) -> None:
        for tracker in list(self.live):
            if self._call(tracker, "storing the kept models", partial(tracker.log_files, files)):
                self._call(tracker, "closing", partial(tracker.close, status))
        self.live.clear()

    def _call(self, tracker: Tracker, what: str, fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            self.warn(f"tracker {tracker.name} failed {what} of run {self.info.run_id} ({e.__class__.__name__}: "
                      f"{clip(first, 300)}); it logs nothing more for this run, which goes on: the results tables "
                      "hold every round")
            self.live.remove(tracker)
            try:
                tracker.close("failed")
            except Exception:  # pragma: no cover - closing what already failed; the warning above says enough
                pass
            return False


class TrackerCallback(DriverCallback):
    """A run's trackers, fed by the driver loop (``fedsap-ray run --tracker``): opened when the run starts
    (continued when it resumes), every round's ``rounds`` rows after it is checkpointed, the kept model files
    and the status when it closes."""

    def __init__(self, specs: Sequence[TrackerSpec], cfg: ExperimentConfig, out: str | Path, run_id: str,
                 warn: Callable[[str], None] = say) -> None:
        self.specs, self.cfg, self.out, self.run_id, self.warn = list(specs), cfg, Path(out), run_id, warn
        self.run: TrackedRun | None = None

    def on_start(self, metrics: Sequence[SessionMetrics]) -> None:
        done = metrics[0].round if metrics else 0
        self.run = TrackedRun(self.specs, run_info(self.cfg, self.run_id, done + 1), self.warn)

    def on_round(self, t: int, summaries: Sequence[RoundSummary], metrics: Sequence[SessionMetrics]) -> None:
        if self.run is None:
            return
        for s in summaries:
            self.run.log(s.round, round_metrics(s.rows))

    def on_finish(self, outcomes: Sequence[RunOutcome | None]) -> None:
        if self.run is None:
            return
        status = outcomes[0].status if outcomes and outcomes[0] is not None else "failed"
        try:
            files = kept_files(self.out, self.run_id)
        except (ConfigError, OSError) as e:
            self.warn(f"trackers get no model files of run {self.run_id}: {e}")
            files = []
        self.run.finish(status, files)
