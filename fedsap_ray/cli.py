"""The ``fedsap-ray`` command (also ``python -m fedsap_ray``): one subcommand per task, over the library.

Exit codes: 0 success, 1 the run failed (the original error first; a failure to record
it follows on an ``also:`` line) or an export's file failed its check (nothing written), 2 bad
input (one line naming the field, the value and what is allowed; nothing was run or written),
130 interrupted (with the ``--resume`` line).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import typing
from pathlib import Path

from fedsap_ray.config import PRESETS, ExperimentConfig, build_config, load_file
from fedsap_ray.common.errors import ConfigError, DatasetUnavailable
from fedsap_ray.run.trackers import add_tracker_args


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, like every other refusal of the command line
    (argparse prints the whole usage block first); exit code 2 as before."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="fedsap-ray", description="Simulate heterogeneous federated learning; results go to Parquet.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one experiment")
    r.add_argument("--config", help="YAML or JSON config file (keys as in docs/reference/config.md)")
    r.add_argument("--preset", choices=sorted(PRESETS), help="start from a preset (default: laptop)")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set training.rounds=20 (repeatable)")
    r.add_argument("--out", default="runs", help="results folder, a local path (default: ./runs; a URI is refused: "
                   "sweeps write to URIs)")
    r.add_argument("--backend", choices=["local", "ray"], help="where clients train (default: config resources.backend)")
    r.add_argument("--address", help="Ray cluster address (auto or HOST:PORT) for --backend ray")
    r.add_argument("--seed", type=int, help="run seed (overrides the config)")
    r.add_argument("--run-id", help="run id (default: config hash + random suffix); 1-128 characters from "
                   "A-Z a-z 0-9 . _ = -, starting with a letter or digit; an id already in --out is refused "
                   "unless --overwrite")
    r.add_argument("--overwrite", action="store_true", help="replace the run with the same --run-id in --out "
                   "(all its rows are deleted once the new run's input checks passed)")
    r.add_argument("--resume", metavar="RUN_ID", help="continue an interrupted run in --out from its last finished round "
                   "(uses the run's stored config; only --backend/--address may change; --tracker continues its "
                   "tracker runs)")
    add_tracker_args(r, "the run (every rounds metric per round, the resolved config, the kept models)")
    r.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    r.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    d = sub.add_parser("datasets", help="list datasets and whether their files are present")
    d.add_argument("--root", help="look for the files under this folder instead of each dataset's default")
    sub.add_parser("algorithms", help="list registered algorithms and their options")
    c = sub.add_parser("compact", help="merge the per-run Parquet files of final runs into one file per table "
                       "(running and resumable runs are left alone)")
    c.add_argument("out", help="results folder or URI (e.g. runs/sweep, s3://bucket/sweep)")
    _export_parser(sub)
    e = sub.add_parser("evaluate", help="evaluate a model a run kept (OUT/models/RUN_ID/, training.keep_model) on the "
                       "run's test data or other data, and print its accuracy and loss per test domain")
    _kept_model_args(e, "evaluate", "results folder (a local path) holding the run")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="data.KEY=VALUE",
                   help="evaluate on other test data, e.g. --set data.name=digits or --set data.max_test_per_domain="
                   "null (repeatable; data.* only)")
    return p


EXPORT_FORMATS = ("onnx", "torchscript", "safetensors")  # fedsap_ray.results.export.FORMATS (not imported here: it loads torch)


def _kept_model_args(p: argparse.ArgumentParser, verb: str, out_help: str) -> None:
    """What ``evaluate`` and ``export`` share: which kept model of which run (fedsap_ray.results.load_model's
    arguments)."""
    p.add_argument("out", help=out_help)
    p.add_argument("--run-id", required=True, help=f"the run whose kept model to {verb}")
    p.add_argument("--which", choices=["final", "best"], default="final",
                   help="which kept model: final (after the last round) or best (default: final)")
    p.add_argument("--client", type=int, metavar="K", help="client K's deployed sub-model (the dense sliced network "
                   "its device runs, BN statistics as the run evaluated them) instead of the global model")


def _export_parser(sub) -> None:
    x = sub.add_parser("export", help="write a run's kept model as a file a device runs (ONNX, TorchScript or "
                       "safetensors), read back and checked against the PyTorch model before it is written")
    _kept_model_args(x, "export", "results folder of the run")
    x.add_argument("--format", dest="fmt", required=True, choices=EXPORT_FORMATS,
                   help="onnx (needs the export extra: pip install 'fedsap-ray[export]'), torchscript, or safetensors "
                   "(the state_dict and a JSON sidecar naming the model's constructor arguments)")
    x.add_argument("--output", metavar="PATH", help="the file to write, ending in .onnx, .pt or .safetensors "
                   "(default: RUN_ID.WHICH[.clientK].EXT in the current folder; never inside the results folder)")
    x.add_argument("--check-on", choices=["test", "random"], default="test",
                   help="the inputs the file is checked on: the run's test split through the dataset's input "
                   "transform (the client's domain for --client; default), or 64 seeded random inputs (no data "
                   "needed); the largest logit difference is printed and above 1e-4 nothing is written (exit 1)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "datasets":
            return _datasets(args)
        if args.command == "algorithms":
            return _algorithms()
        if args.command == "compact":
            return _compact(args)
        if args.command == "export":
            return _export(args)
        if args.command == "evaluate":
            return _evaluate(args)
    except ConfigError as e:
        print(f"fedsap-ray: error: {e}", file=sys.stderr)
        return 2
    return 0  # pragma: no cover


def check_run_out(out: str) -> None:
    """``--out`` of ``fedsap-ray run`` must name a local folder: ``''`` would write into the current
    folder, and a URI (``s3://bucket/x``) would become a local folder named ``s3:``."""
    from fedsap_ray import results

    if out.strip() == "":
        raise ConfigError(f"invalid --out={out!r}: must name a folder (--out . for the current one)")
    if results.is_uri(out):
        raise ConfigError(f"invalid --out={out!r}: fedsap-ray run writes to a local folder; results go to a URI "
                          "through the sweeps (python sweeps/<study>.py --out s3://...), or copy the folder there "
                          "after the run")


def _resolve(args) -> ExperimentConfig:
    from fedsap_ray import results

    check_run_out(args.out)
    file_data = load_file(args.config) if args.config else None
    overrides = list(args.overrides)
    if args.run_id is not None:
        results.check_run_id(args.run_id, "--run-id")
    if args.resume:
        results.check_run_id(args.resume, "--resume")
        if args.config or args.overrides or args.preset or args.seed is not None or args.run_id or args.overwrite:
            raise ConfigError(f"invalid --resume={args.resume!r}: a resumed run keeps its stored config; "
                              "only --out, --backend, --address, --tracker and --tracker-uri may be given")
        file_data = _stored_config(Path(args.out), args.resume)
    if args.backend:
        overrides.append(f"resources.backend={args.backend}")
    if args.address:
        overrides.append(f"resources.address={args.address}")
    cfg = build_config(preset=args.preset, file_data=file_data, overrides=overrides, seed=args.seed)
    if args.address:  # only the Ray backend joins a cluster; the local one would ignore the address
        if cfg.resources.backend != "ray":
            raise ConfigError(f"invalid --address={args.address!r}: only --backend ray joins a Ray cluster "
                              f"(the backend is {cfg.resources.backend}); add --backend ray or leave --address out")
        if not args.print_config:
            from fedsap_ray.runtime.address import check_reachable

            check_reachable(args.address, "--address")  # seconds, where ray.init would wait minutes
    return cfg


def _stored_config(out: Path, run_id: str) -> dict:
    from fedsap_ray.run import guard

    row = guard.check_checkpoint_present(out, run_id)
    return config_object(row["config_json"], f"--resume={run_id!r}", str(out / "runs" / f"{run_id}.parquet"))


def config_object(text: object, field: str, where: str) -> dict:
    """A runs row's ``config_json`` as the JSON object it must be; else one ConfigError naming ``field`` and
    ``where`` the row lives (``--resume`` and ``export`` read a stored config alike)."""
    try:
        stored = json.loads(text)  # type: ignore[arg-type]
    except (TypeError, ValueError, RecursionError) as e:
        raise ConfigError(f"invalid {field}: {where} holds no readable config_json ({e})") from e
    if not isinstance(stored, dict):
        raise ConfigError(f"invalid {field}: {where} holds a config_json that is no JSON object "
                          f"({type(stored).__name__})")
    return stored


def _run(args) -> int:
    cfg = _resolve(args)
    from fedsap_ray.run import trackers

    specs = trackers.tracker_specs(args.tracker, args.tracker_uri, args.out)
    trackers.check_libraries(specs)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
        return 0
    from fedsap_ray.experiment import new_run_id, run_experiment
    from fedsap_ray.results import kept_models, run_files
    from fedsap_ray.run.progress import ProgressPrinter

    out = Path(args.out)
    run_id = args.resume or args.run_id or new_run_id(cfg)
    printer = None if args.quiet else ProgressPrinter(cfg.training.rounds)
    tracked = [trackers.TrackerCallback(specs, cfg, out, run_id)] if specs else []
    try:
        outcome = run_experiment(cfg, out, run_id=run_id, progress=printer, resume=bool(args.resume),
                                 overwrite=args.overwrite, callbacks=tracked)
    except DatasetUnavailable as e:
        print(f"fedsap-ray: error: data.name={cfg.data.name!r}: {e}", file=sys.stderr)
        return 2
    except ConfigError:  # bad input found once the data was loaded (e.g. more clients than samples)
        raise
    except KeyboardInterrupt as e:
        print(f"fedsap-ray: interrupted; finished rounds are in {out}. Continue with: "
              f"fedsap-ray run --out {shlex.quote(str(out))} --resume {run_id}", file=sys.stderr)
        _print_notes(e)
        return 130
    except Exception as e:  # the run itself failed; the runs row records the traceback
        print(f"fedsap-ray: run failed: {e.__class__.__name__}: {e}", file=sys.stderr)
        _print_notes(e)
        return 1
    kept = sorted({f.name.split(".")[0] for f in kept_models(out, outcome.run_id)}, key=["final", "best"].index)
    models = (f"; kept its {' and '.join(kept)} model{'s' if len(kept) > 1 else ''} in {out}/models/{outcome.run_id}/"
              if kept else "")
    print(f"run {outcome.run_id}: {outcome.status} in {outcome.wall_s:.1f}s; final global accuracy "
          f"{outcome.final_global_accuracy:.4f}, best {outcome.best_global_accuracy:.4f}{models}; results in {out}/"
          "{" + ",".join(dict.fromkeys(f.parent.name for f in run_files(out, outcome.run_id))) + "}")
    return 0


def _print_notes(e: BaseException) -> None:
    """Errors that happened while closing the failed run (e.g. its runs row could not be
    written), after the original error, never instead of it."""
    for note in getattr(e, "__notes__", None) or []:
        print(f"fedsap-ray: also: {note}", file=sys.stderr)


def check_datasets_root(root: str | None) -> Path | None:
    """``--root`` of ``fedsap-ray datasets``: a folder (one that does not exist is reported with every file
    missing); an empty name or a file there is refused, as ``data.root`` is."""
    if root is None:
        return None
    if not root.strip():
        raise ConfigError(f"invalid --root={root!r}: must name a folder (leave --root out for each dataset's "
                          "default location)")
    try:
        path = Path(root).expanduser()
        kind = None if not path.exists() else "folder" if path.is_dir() else "file"
    except (ValueError, RuntimeError, OSError) as e:  # a NUL byte, ~unknown_user, a name too long
        raise ConfigError(f"invalid --root={root!r}: not a usable path ({e})") from e
    if kind == "file":
        raise ConfigError(f"invalid --root={root!r}: it is a file; --root is the folder that holds the datasets' files")
    return path


def _datasets(args) -> int:
    from fedsap_ray.data.status import dataset_table

    rows = dataset_table(check_datasets_root(args.root))
    for r in rows:
        mark = "present" if r["present"] else "missing"
        print(f"{r['name']:<16} {mark:<8} {r['root']}")
        print(f"{'':<16} {r['description']}")
        if not r["present"] and r.get("missing"):
            print(f"{'':<16} missing: {r['missing']}")
    return 0


def _algorithms() -> int:
    import dataclasses

    from fedsap_ray import algorithms

    for name in algorithms.names():
        cls = algorithms.get(name)
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Options)) or "(no options)"
        print(f"{name:<14} {cls.summary}")
        print(f"{'':<14}   options: {fields}")
    return 0


def _compact(args) -> int:
    from fedsap_ray import results

    try:
        if not results.is_uri(args.out):
            from fedsap_ray.persist.outdir import OutDir

            OutDir(args.out)  # refuses a path the file system cannot hold before anything looks at it
        if not results.is_uri(args.out) and Path(args.out).is_dir():
            from fedsap_ray.run.guard import recover_abandoned

            recover_abandoned(Path(args.out))  # an overwrite a kill left half done: finished before compacting
        n = results.compact(args.out)
    except ConfigError:  # an entry of the folder it refuses to touch (fedsap_ray.persist.outdir): names the entry
        raise
    except (FileNotFoundError, ValueError) as e:
        print(f"fedsap-ray: error: compact {args.out}: {e}", file=sys.stderr)
        return 2
    rewritten = f", rewrote {n['files_rewritten']} older compacted files" if n["files_rewritten"] else ""
    print(f"{args.out}: compacted {n['runs_compacted']} runs; wrote {n['files_written']} compacted files"
          f"{rewritten}, removed {n['files_removed']} per-run files; left the per-run files of "
          f"{n['runs_kept']} running or resumable runs")
    return 0


def _export(args) -> int:
    """``fedsap-ray export``: every check that needs no model first, then the kept model, its check inputs, the file."""
    from fedsap_ray import results
    from fedsap_ray.results import export

    results.check_run_id(args.run_id, "--run-id")
    if args.client is not None and args.client < 0:
        raise ConfigError(f"invalid --client={args.client}: a client id is >= 0")
    export.require(args.fmt)
    out = check_export_out(args.out)
    name = f"{args.run_id}.{args.which}{'' if args.client is None else f'.client{args.client}'}"
    path = check_export_output(args.output if args.output is not None else name + export.FORMATS[args.fmt],
                               args.fmt, out)
    cfg = _run_config(args.out, args.run_id)
    if args.client is not None and args.client >= cfg.data.num_clients:
        raise ConfigError(f"invalid --client={args.client}: run {args.run_id} has clients 0..{cfg.data.num_clients - 1}")
    from fedsap_ray.results import load_model  # kept models (fedsap_ray.results); imported here: it loads torch

    model = load_model(args.out, args.run_id, which=args.which, client=args.client)
    try:
        inputs, stored, what = _export_inputs(cfg, model, args.client, args.check_on)
    except DatasetUnavailable as e:
        print(f"fedsap-ray: error: data.name={cfg.data.name!r}: {e} (--check-on random checks without the data)",
              file=sys.stderr)
        return 2
    meta = {"run_id": args.run_id, "which": args.which, "client": args.client, "config_hash": cfg.config_hash(),
            "dataset": cfg.data.name, "input_transform": export.input_transform(stored), "checked_on": what}
    try:
        report = export.export_module(model, inputs, args.fmt, path, metadata=meta)
    except export.ExportCheckFailed as e:
        print(f"fedsap-ray: export failed: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the check passed; writing did not (a full disk): nothing is left at the path
        print(f"fedsap-ray: export failed: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(report.summary(what))
    return 0


def check_export_out(out: str) -> str:
    """``OUT`` of ``fedsap-ray export``: an existing results folder (a URI is read as the other commands read
    one); refused before anything is loaded."""
    from fedsap_ray import results

    if out.strip() == "":
        raise ConfigError(f"invalid OUT={out!r}: must name the results folder of the run")
    if results.is_uri(out):
        return out
    from fedsap_ray.persist.outdir import OutDir

    OutDir(out)  # refuses a path the file system cannot hold
    if not Path(out).is_dir():
        raise ConfigError(f"invalid OUT={out!r}: no results folder there")
    return out


def check_export_output(output: str, fmt: str, out: str) -> Path:
    """``--output`` of ``fedsap-ray export``: a file name ending as the format's files do, in an existing
    writable folder, not a folder itself, and outside the results folder (which holds only what runs write)."""
    from fedsap_ray.results.export import FORMATS

    ending = FORMATS[fmt]
    try:
        path = Path(output).expanduser()
        folder = path.parent
        problem = (None if output.strip() and path.suffix == ending else
                   f"--format {fmt} writes a file whose name ends in {ending}")
        if problem is None and path.is_dir():
            problem = "it is a folder; name the file to write"
        if problem is None and not folder.is_dir():
            problem = f"its folder {folder} {'is not a folder' if folder.exists() else 'does not exist'}; create it first"
        if problem is None and not os.access(folder, os.W_OK | os.X_OK):
            problem = f"its folder {folder} is not writable"
        if problem is None and fmt == "safetensors" and path.with_suffix(".json").is_dir():
            problem = f"its sidecar {path.with_suffix('.json')} is a folder"
        from fedsap_ray import results

        if problem is None and not results.is_uri(out):
            root, real = os.path.realpath(out), os.path.realpath(folder)
            if real == root or real.startswith(root.rstrip("/") + "/"):
                problem = f"it is inside the results folder {out}, which holds only what runs write; write it elsewhere"
    except (ValueError, OSError, RuntimeError) as e:  # a NUL byte, ~unknown_user, a name too long
        problem = f"not a usable path ({e})"
    if problem is not None:
        raise ConfigError(f"invalid --output={output!r}: {problem}")
    return path


def _run_config(out: str, run_id: str) -> ExperimentConfig:
    """The stored config of run ``run_id`` in ``out`` (its ``runs`` row, read as every reader reads it)."""
    from fedsap_ray.results import filesystem
    from fedsap_ray.results.reader import read_arrow

    fs, base = filesystem(out)
    t = read_arrow(fs, base, "runs", columns=["run_id", "config_json"])
    stored = [c for r, c in zip(t.column("run_id").to_pylist(), t.column("config_json").to_pylist()) if r == run_id]
    if not stored:
        raise ConfigError(f"invalid --run-id={run_id!r}: the results folder {out} holds no such run")
    return build_config(file_data=config_object(stored[0], f"--run-id={run_id!r}", f"its runs row in {out}"))


def _export_inputs(cfg: ExperimentConfig, model, client: int | None, on: str):
    """(inputs as the model takes them, the dtype the data is stored in, what they are in words) for the check:
    the run's test split (client ``client``'s domain, else every domain's) through the dataset's input transform,
    or seeded random inputs of the model's kind."""
    import torch

    from fedsap_ray.results import export

    if on == "random":
        x = export.random_inputs(model)
        stored = torch.long if x.dtype == torch.long else torch.uint8 if x.dim() == 4 else torch.float32
        return x, stored, f"{len(x)} random inputs"
    from fedsap_ray.data import build_federation
    from fedsap_ray.data.base import as_input

    fed = build_federation(cfg)
    domains = [fed.clients[client].domain] if client is not None else list(fed.domains)
    x = torch.cat([fed.test[d].x for d in domains])
    if len(x) == 0:
        raise ConfigError(f"invalid --check-on=test: the run's test split is empty ({cfg.data.name}, "
                          f"{', '.join(domains)}); use --check-on random")
    which = f"domain {domains[0]}'s test split" if len(domains) == 1 else f"the test splits of its {len(domains)} domains"
    return as_input(x), x.dtype, f"{len(x)} test samples ({which}, through the dataset's input transform)"


def _evaluate(args) -> int:
    from fedsap_ray import results

    if results.is_uri(args.out) or not args.out.strip():
        raise ConfigError(f"invalid out={args.out!r}: fedsap-ray evaluate reads a local results folder (copy a "
                          "sweep's folder here first)")
    try:
        ev = results.evaluate_kept(args.out, args.run_id, args.which, args.client, args.overrides)
    except DatasetUnavailable as e:
        print(f"fedsap-ray: error: {e}", file=sys.stderr)
        return 2
    for line in evaluation_lines(ev):
        print(line)
    return 0


def evaluation_lines(ev) -> list[str]:
    """``fedsap-ray evaluate``'s table: a heading, one row per test domain (samples, accuracy, mean loss), their
    unweighted mean (the ``rounds`` table's global row), and a client's figure as the run records it."""
    m = ev.meta
    what = "the global model" if ev.client is None else f"client {ev.client}'s deployed model"
    data = f"{ev.dataset} test data" + (f" ({' '.join('--set ' + o for o in ev.overrides)})" if ev.overrides else "")
    lines = [f"run {m['run_id']}: {m['which']} model of round {m['round']} ({m['algorithm']}, {m['model']} at width "
             f"{m['width_mult']:g}), {what}, on {data}",
             f"{'domain':<16} {'n':>7} {'accuracy':>9} {'loss':>9}"]
    lines += [f"{r.domain:<16} {r.n:>7} {r.accuracy:>9.6f} {r.loss:>9.6f}" for r in ev.rows]
    recorded = ""
    if ev.client is None and not ev.overrides and m.get("evaluated_as"):
        recorded = f"; the rounds table's __global__ row of eval_mode {m['evaluated_as']}"
    lines.append(f"{'mean':<16} {'':>7} {ev.mean[0]:>9.6f} {ev.mean[1]:>9.6f}  (unweighted over domains{recorded})")
    if ev.own is not None:
        how = ", reweighted to its training labels" if ev.own_weighted else ""
        lines.append(f"as the run records client {ev.client} (on its own domain {ev.own.domain}{how}): accuracy "
                     f"{ev.own.accuracy:.6f}, loss {ev.own.loss:.6f}")
    return lines


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
