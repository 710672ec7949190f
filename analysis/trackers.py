"""Curves a sweep logged to its trackers, read back by the trackers' own libraries (docs/guides/trackers.md).

``python -m analysis.trackers OUT --study STUDY --png PATH`` draws, one line per run, a metric as MLflow holds
it (``MlflowClient``, from ``OUT/_trackers/mlflow/mlflow.db``) beside one as TensorBoard holds it
(``EventAccumulator``, from ``OUT/_trackers/tensorboard/<run_id>/``): what a researcher sees in either tool,
drawn with matplotlib because a browser screenshot cannot be taken here. The README's trackers figure is this
command on a small sweep (docs/guides/trackers.md#the-readme-figure). The tables stay the record: every value
drawn is a cell of the rounds table (tests/run/test_trackers.py checks that, tracker by tracker).
"""
from __future__ import annotations

import sys
from pathlib import Path

from fedsap_ray.cli import OneLineParser

Curves = dict[str, dict[int, float]]  # run id -> step (round) -> value


def mlflow_curves(uri: str, experiment: str, metric: str) -> Curves:
    """``metric`` of every run of ``experiment`` (the study) in the MLflow store at ``uri``, by run name."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise FileNotFoundError(f"no MLflow experiment {experiment!r} in {uri}")
    return {run.info.run_name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, metric)}
            for run in client.search_runs([exp.experiment_id])}


def tensorboard_curves(folder: Path, metric: str) -> Curves:
    """``metric`` of every run folder under ``folder`` (the runs' event files), by folder name (the run id)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    curves: Curves = {}
    for run in sorted(p for p in folder.iterdir() if p.is_dir()):
        acc = EventAccumulator(str(run), size_guidance={"tensors": 0})
        acc.Reload()
        if metric in acc.Tags()["tensors"]:
            curves[run.name] = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(metric)}
    return curves


def figure(out: Path, study: str, path: str, mlflow_metric: str = "train_loss",
           tensorboard_metric: str = "deployed/__global__/accuracy") -> None:
    """Two panels: ``mlflow_metric`` read from MLflow, ``tensorboard_metric`` read from TensorBoard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"MLflow: {mlflow_metric}", mlflow_curves(f"sqlite:///{(out / '_trackers' / 'mlflow' / 'mlflow.db').resolve()}",
                                                          study, mlflow_metric)),
              (f"TensorBoard: {tensorboard_metric}", tensorboard_curves(out / "_trackers" / "tensorboard",
                                                                        tensorboard_metric))]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (title, curves) in zip(axes, panels):
        for run_id, points in sorted(curves.items()):
            steps = sorted(points)
            ax.plot(steps, [points[s] for s in steps], marker="o", markersize=3, label=run_id)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("round (the trackers' step)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m analysis.trackers OUT --study STUDY --png PATH``: the trackers figure of a sweep run with
    ``--tracker mlflow --tracker tensorboard`` (their default locations under OUT)."""
    p = OneLineParser(prog="python -m analysis.trackers", description=main.__doc__)
    p.add_argument("out", help="the sweep's results folder")
    p.add_argument("--study", required=True, help="the study (the MLflow experiment), e.g. main_comparison")
    p.add_argument("--png", required=True, help="where to write the figure")
    p.add_argument("--mlflow-metric", default="train_loss", help="the metric read from MLflow")
    p.add_argument("--tensorboard-metric", default="deployed/__global__/accuracy",
                   help="the metric read from TensorBoard")
    args = p.parse_args(argv)
    from analysis.runs import open_or_exit

    open_or_exit(args.out, p.prog)  # a results folder first (one line and exit 2 otherwise, as every analysis command)
    out = Path(args.out)
    for needed in (out / "_trackers" / "mlflow" / "mlflow.db", out / "_trackers" / "tensorboard"):
        if not needed.exists():
            print(f"analysis.trackers: error: {needed} does not exist; run the sweep with --tracker mlflow "
                  "--tracker tensorboard (default --tracker-uri)", file=sys.stderr)
            return 2
    try:
        figure(out, args.study, args.png, args.mlflow_metric, args.tensorboard_metric)
    except FileNotFoundError as e:
        print(f"analysis.trackers: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
