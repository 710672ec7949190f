"""``fedsap-ray export``: a run's kept model checked on the run's own test split (through the dataset's input
transform) and written; every bad input exits 2 with one line and writes nothing; a file that fails its check
exits 1 and is not written.

The kept model comes from ``fedsap_ray.results.load_model`` (kept models, issue 53); these tests put a stand-in
there that returns the run's initial global model, or a FedSAP-like dense sub-model for ``--client``, so they
check the command and not the kept files (the end-to-end test with real kept models lives with those)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from exportkit import fedsap_like_submodel
from faultkit import cli_process, tiny_run
from fedsap_ray import results
from fedsap_ray.results import export
from fedsap_ray.config import build_config
from fedsap_ray.data.base import as_input
from fedsap_ray.run.session import build_context

RUN = "r1"


@pytest.fixture(scope="module")
def run(tmp_path_factory, single_thread):
    """(results folder, run context): one tiny one-round run; the context is rebuilt from its stored config."""
    out = tmp_path_factory.mktemp("runs")
    tiny_run(out, RUN, "training.rounds=1")
    row = results.read_table(out, "runs").iloc[0]
    return out, build_context(build_config(file_data=json.loads(row["config_json"])))


@pytest.fixture
def kept(run, monkeypatch):
    """``results.load_model`` answering with the run's global model or client K's sub-model; its calls are listed."""
    _, ctx = run
    calls: list[tuple] = []

    def load_model(out, run_id, which="final", client=None):
        calls.append((str(out), run_id, which, client))
        if client is None:
            return ctx.model.eval()
        return fedsap_like_submodel("resnet10", full=ctx.model, seed=client)[0]
    monkeypatch.setattr(results, "load_model", load_model, raising=False)
    return calls


@pytest.fixture
def seen(monkeypatch):
    """The inputs every export is checked on."""
    inputs: list[torch.Tensor] = []
    real = export.export_module

    def spy(module, example_inputs, *a, **k):
        inputs.append(example_inputs)
        return real(module, example_inputs, *a, **k)
    monkeypatch.setattr(export, "export_module", spy)
    return inputs


def cli(capsys, *args: str) -> tuple[int, str, list[str]]:
    """``fedsap-ray ARGS`` in this process: (exit code, stdout, non-empty stderr lines); argparse's exit included."""
    got = cli_process(capsys, *args)
    return got.returncode, got.stdout, [line for line in got.stderr.splitlines() if line.strip()]


def files(*folders: Path) -> set[Path]:
    return {p for f in folders for p in f.rglob("*")}


def test_onnx_of_a_client_is_checked_on_its_domains_test_split(run, kept, seen, tmp_path, capsys):
    """The inputs are the client's domain's test split through as_input (uint8 -> [-1, 1], not /255); the printed
    difference is the check's, within 1e-4."""
    out, ctx = run
    client = 2
    rc, stdout, err = cli(capsys, "export", str(out), "--run-id", RUN, "--client", str(client), "--format", "onnx",
                          "--output", str(tmp_path / "c2.onnx"))
    assert rc == 0 and not err, err
    assert kept == [(str(out), RUN, "final", client)]
    test = ctx.federation.test[ctx.federation.clients[client].domain]
    assert torch.equal(seen[0], as_input(test.x)) and float(seen[0].min()) < -0.9
    diff = float(stdout.split("max |logit difference| ")[1].split()[0])
    assert diff <= export.TOLERANCE and f"on {len(test)} test samples (domain {ctx.federation.clients[client].domain}'s" in stdout
    meta = json.loads({p.key: p.value for p in onnx.load(tmp_path / "c2.onnx").metadata_props}["fedsap_ray"])
    assert (meta["run_id"], meta["client"], meta["which"]) == (RUN, client, "final")
    assert meta["input_transform"].startswith("uint8 image pixels")


def test_global_model_default_name_and_every_domain(run, kept, seen, tmp_path, capsys, monkeypatch):
    out, ctx = run
    monkeypatch.chdir(tmp_path)
    rc, stdout, err = cli(capsys, "export", str(out), "--run-id", RUN, "--which", "best", "--format", "torchscript")
    assert rc == 0 and not err, err
    assert (tmp_path / f"{RUN}.best.pt").is_file() and kept[0][2:] == ("best", None)
    fed = ctx.federation
    assert torch.equal(seen[0], as_input(torch.cat([fed.test[d].x for d in fed.domains])))


def test_safetensors_on_random_inputs_rebuilds(run, kept, seen, tmp_path, capsys):
    out, _ = run
    path = tmp_path / "c1.safetensors"
    rc, stdout, err = cli(capsys, "export", str(out), "--run-id", RUN, "--client", "1", "--format", "safetensors",
                          "--output", str(path), "--check-on", "random")
    assert rc == 0 and not err and "64 random inputs" in stdout, err
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["client"] == 1 and sidecar["model"]["channels"] == results.load_model(out, RUN, client=1).channel_counts()
    with torch.no_grad():
        assert torch.equal(export.load_safetensors(path)(seen[0]), results.load_model(out, RUN, client=1)(seen[0]))


def _refusals(out: Path, tmp: Path) -> list[tuple[list[str], str]]:
    base = ["export", str(out), "--run-id", RUN]
    (tmp / "afile").write_text("x")
    return [
        (base + ["--format", "tflite"], "argument --format: invalid choice: 'tflite'"),
        (base + ["--format", "onnx", "--output", str(tmp / "no" / "m.onnx")], f"its folder {tmp / 'no'} does not exist"),
        (base + ["--format", "onnx", "--output", str(tmp / "afile" / "m.onnx")], "is not a folder"),
        (base + ["--format", "onnx", "--output", str(tmp / "m.pt")], "--format onnx writes a file whose name ends in .onnx"),
        (base + ["--format", "onnx", "--output", str(tmp)], "ends in .onnx"),
        (base + ["--format", "onnx", "--output", str(out / "runs" / "m.onnx")], "inside the results folder"),
        (["export", str(out), "--run-id", "nope", "--format", "onnx", "--output", str(tmp / "m.onnx")],
         "invalid --run-id='nope': the results folder"),
        (["export", str(out), "--run-id", "../x", "--format", "onnx"], "invalid --run-id='../x'"),
        (base + ["--format", "onnx", "--client", "4", "--output", str(tmp / "m.onnx")], "invalid --client=4: run r1 has clients 0..3"),
        (base + ["--format", "onnx", "--client", "-1"], "invalid --client=-1"),
        (base + ["--format", "onnx", "--client", "one"], "argument --client: invalid int value"),
        (["export", str(tmp / "none"), "--run-id", RUN, "--format", "onnx"], "no results folder there"),
        (base + ["--format", "onnx", "--check-on", "train"], "argument --check-on: invalid choice"),
    ]


def test_every_refusal_is_one_line_exit_2_and_writes_nothing(run, kept, tmp_path, capsys, monkeypatch):
    out, _ = run
    monkeypatch.chdir(tmp_path)
    for args, needle in _refusals(out, tmp_path):
        before = files(out, tmp_path)
        rc, stdout, err = cli(capsys, *args)
        assert rc == 2 and len(err) == 1 and needle in err[0], (args, err)
        assert files(out, tmp_path) == before, args
    assert kept == []  # refused before the kept model was loaded


def test_missing_onnxruntime_names_the_export_extra(run, kept, tmp_path, capsys, monkeypatch):
    out, _ = run
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    rc, _, err = cli(capsys, "export", str(out), "--run-id", RUN, "--format", "onnx", "--output", str(tmp_path / "m.onnx"))
    assert rc == 2 and err == ["fedsap-ray: error: --format onnx needs the export extra (onnxruntime not installed): "
                               "pip install 'fedsap-ray[export]'"]
    assert list(tmp_path.iterdir()) == [] and kept == []


def test_a_file_that_fails_its_check_exits_1_and_is_not_written(run, kept, tmp_path, capsys, monkeypatch):
    out, _ = run
    real = export.onnx_bytes

    def off_by_a_bit(*a):
        model = onnx.load_from_string(real(*a))
        bias = next(i for i in model.graph.initializer if i.name == "fc.bias")
        bias.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(bias) + np.float32(1e-3), "fc.bias"))
        return model.SerializeToString()
    monkeypatch.setattr(export, "onnx_bytes", off_by_a_bit)
    rc, stdout, err = cli(capsys, "export", str(out), "--run-id", RUN, "--client", "0", "--format", "onnx", "--output",
                          str(tmp_path / "m.onnx"))
    assert rc == 1 and len(err) == 1 and err[0].startswith("fedsap-ray: export failed: the onnx file differs"), err
    assert list(tmp_path.iterdir()) == [] and stdout == ""
