"""fedsap_ray.results.export: a FedSAP client's dense sub-model written as ONNX, TorchScript and safetensors, each read back
and checked against PyTorch before it is written; the check measures the file (a perturbed weight is caught, a
file that fails is never written); every registered model exports in every format."""
from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from safetensors import safe_open
from torch import nn

from exportkit import fedsap_like_submodel
from fedsap_ray.results import export
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.models import MODEL_REGISTRY


@pytest.fixture(scope="module")
def resnet(single_thread):
    """(sub-model, full model, 64 inputs, the sub-model's logits on them): a ResNet10 at width 0.125 sliced at a
    random FedSAP-like channel mask, its inputs random uint8 images through the datasets' transform."""
    sub, full = fedsap_like_submodel("resnet10", width_mult=0.125)
    x = export.random_inputs(sub, 64, seed=1)
    with torch.no_grad():
        return sub, full, x, sub(x).numpy()


@pytest.fixture(scope="module")
def onnx_file(resnet, tmp_path_factory):
    sub, _, x, _ = resnet
    path = tmp_path_factory.mktemp("onnx") / "client.onnx"
    return export.export_module(sub, x, "onnx", path, metadata={"client": 3})


def test_onnx_of_a_fedsap_submodel_matches_pytorch(resnet, onnx_file):
    """The file is the dense sub-network (its first convolution has the sub-model's channels, fewer than the full
    model's), and onnxruntime gives the module's logits within 1e-4 at batch sizes it was not traced at."""
    sub, full, x, ref = resnet
    assert onnx_file.max_abs_diff <= export.TOLERANCE and onnx_file.samples == 64 and onnx_file.top1_agreement == 1.0
    model = onnx.load(onnx_file.path)
    first_conv = next(n for n in model.graph.node if n.op_type == "Conv")
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert weights[first_conv.input[1]].shape[0] == sub.channel_counts()["layer1"] < full.channel_counts()["layer1"]
    session = ort.InferenceSession(str(onnx_file.path), providers=["CPUExecutionProvider"])
    for lo, hi in ((0, 5), (5, 64)):
        got = session.run(None, {"input": x[lo:hi].numpy()})[0]
        assert np.abs(got - ref[lo:hi]).max() <= export.TOLERANCE
    meta = json.loads({p.key: p.value for p in model.metadata_props}["fedsap_ray"])
    assert meta["client"] == 3 and meta["model"]["channels"] == sub.channel_counts()
    assert meta["input"]["shape"] == ["batch", 3, 32, 32]


def _with_initializer(data: bytes, name: str, change) -> bytes:
    model = onnx.load_from_string(data)
    init = next(i for i in model.graph.initializer if i.name == name)
    init.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(init).copy()), name))
    return model.SerializeToString()


def _bump_bias(delta: float):
    def change(a: np.ndarray) -> np.ndarray:
        a[0] += delta
        return a
    return change


def test_the_check_measures_the_file(resnet, onnx_file):
    """A classifier bias moved by d in the file moves one logit by d: the check reports d and fails above 1e-4. The
    stem's BatchNorm left out of the convolution the exporter folded it into (the stem's raw weights, no shift)
    fails it too."""
    sub, _, x, ref = resnet
    data = onnx_file.path.read_bytes()

    def check(data: bytes) -> float:
        return export.compare(ref, export._batched(export.onnx_runner(data), x), "the file")[0]

    assert check(_with_initializer(data, "fc.bias", _bump_bias(5e-5))) == pytest.approx(5e-5, abs=2e-6)
    with pytest.raises(export.ExportCheckFailed, match=r"by up to 0\.001 .*tolerance 0\.0001"):
        check(_with_initializer(data, "fc.bias", _bump_bias(1e-3)))
    stem = next(n for n in onnx.load_from_string(data).graph.node if n.op_type == "Conv")
    unfolded = _with_initializer(data, stem.input[1], lambda a: sub.conv1.weight.detach().numpy())
    with pytest.raises(export.ExportCheckFailed):
        check(_with_initializer(unfolded, stem.input[2], np.zeros_like))


def test_a_file_that_fails_its_check_is_never_written(resnet, tmp_path, monkeypatch):
    sub, _, x, _ = resnet
    real = export.onnx_bytes
    monkeypatch.setattr(export, "onnx_bytes", lambda *a: _with_initializer(real(*a), "fc.bias", _bump_bias(1e-3)))
    with pytest.raises(export.ExportCheckFailed, match="nothing was written"):
        export.export_module(sub, x, "onnx", tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_file_traced_at_a_fixed_batch_size_fails_its_check(resnet, tmp_path, monkeypatch):
    """The batch dimension must be dynamic: a graph traced at batch 2 with the batch fixed cannot run the check's 64."""
    sub, _, x, _ = resnet

    def fixed_batch(module, trace_inputs, meta):
        with export._quiet():
            torch.onnx.export(module, (trace_inputs,), tmp_path / "fixed.onnx", dynamo=False, opset_version=export.ONNX_OPSET)
        return (tmp_path / "fixed.onnx").read_bytes()
    monkeypatch.setattr(export, "onnx_bytes", fixed_batch)
    with pytest.raises(export.ExportCheckFailed, match=r"^the onnx file cannot be run on the inputs \(.*nothing was written$"):
        export.export_module(sub, x, "onnx", tmp_path / "m.onnx")
    assert [p.name for p in tmp_path.iterdir()] == ["fixed.onnx"]


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated")
def test_torchscript_round_trip(resnet, tmp_path):
    sub, _, x, ref = resnet
    report = export.export_module(sub, x, "torchscript", tmp_path / "m.pt", metadata={"which": "best"})
    assert report.max_abs_diff <= export.TOLERANCE
    extra = {"fedsap_ray.json": ""}
    loaded = torch.jit.load(str(report.path), _extra_files=extra)
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x[:7]).numpy(), ref[:7], atol=1e-6, rtol=0)
    assert json.loads(extra["fedsap_ray.json"])["which"] == "best"


def test_safetensors_round_trip_rebuilds_the_submodel(resnet, tmp_path):
    """The sidecar names the constructor arguments and the sub-model's own channel counts: the module rebuilt from
    it alone (a fresh one) gives identical logits; the header carries the same description."""
    sub, full, x, ref = resnet
    report = export.export_module(sub, x, "safetensors", tmp_path / "m.safetensors", metadata={"run_id": "r"})
    assert [p.name for p in report.files] == ["m.json", "m.safetensors"]
    sidecar = json.loads((tmp_path / "m.json").read_text())
    assert sidecar["model"]["name"] == "resnet10" and sidecar["model"]["width_mult"] == 0.125
    assert sidecar["model"]["channels"] == sub.channel_counts() != full.channel_counts()
    rebuilt = export.load_safetensors(report.path)
    assert rebuilt is not sub and not rebuilt.training
    with torch.no_grad():
        assert torch.equal(rebuilt(x), torch.from_numpy(ref))
    with safe_open(str(report.path), framework="pt") as f:
        assert json.loads(f.metadata()["fedsap_ray"]) == sidecar


def test_load_safetensors_refuses_a_sidecar_that_does_not_fit(resnet, tmp_path):
    sub, _, x, _ = resnet
    path = export.export_module(sub, x, "safetensors", tmp_path / "m.safetensors").path
    sidecar = json.loads(path.with_suffix(".json").read_text())
    sidecar["model"]["channels"]["layer1"] += 1
    path.with_suffix(".json").write_text(json.dumps(sidecar))
    with pytest.raises(ConfigError, match=r"m\.json: cannot rebuild the model \(.*size mismatch"):
        export.load_safetensors(path)
    path.with_suffix(".json").unlink()
    with pytest.raises(ConfigError, match=r"m\.safetensors: cannot read the export"):
        export.load_safetensors(path)


def test_export_runs_bn_on_running_statistics_and_leaves_the_module_as_it_was(resnet, tmp_path):
    """A module handed over in training mode is exported (and checked) in eval mode; its mode and BN statistics
    are unchanged afterwards (a training-mode forward pass would have moved them)."""
    sub, _, x, ref = resnet
    before = {k: v.clone() for k, v in sub.state_dict().items()}
    sub.train()
    try:
        export.export_module(sub, x, "onnx", tmp_path / "m.onnx")
        assert sub.training
    finally:
        sub.eval()
    assert all(torch.equal(before[k], v) for k, v in sub.state_dict().items())
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    assert np.abs(got - ref).max() <= export.TOLERANCE


@pytest.mark.parametrize("name", sorted(MODEL_REGISTRY))
def test_every_model_exports_in_every_format(name, tmp_path, single_thread):
    """Each registered model, as a FedSAP-like dense sub-model at width 1/16, in each format: read back within 1e-4."""
    sub, _ = fedsap_like_submodel(name)
    x = export.random_inputs(sub, 9)
    for fmt, ending in export.FORMATS.items():
        report = export.export_module(sub, x, fmt, tmp_path / f"m{ending}")
        assert report.max_abs_diff <= export.TOLERANCE and report.path.is_file(), (name, fmt)


def test_a_model_the_exporter_cannot_take_is_refused_by_name(resnet, tmp_path, monkeypatch):
    sub, _, x, _ = resnet

    def unsupported(*a, **k):
        raise RuntimeError("Exporting the operator 'aten::foo' to ONNX opset version 17 is not supported.\nmore text")
    monkeypatch.setattr(torch.onnx, "export", unsupported)
    with pytest.raises(ConfigError) as e:
        export.export_module(sub, x, "onnx", tmp_path / "m.onnx")
    assert str(e.value).startswith("format onnx: ResNet cannot be exported (RuntimeError: Exporting the operator")
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def test_missing_library_names_the_export_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime -> ImportError
    with pytest.raises(ConfigError, match=r"--format onnx needs the export extra \(onnxruntime not installed\): "
                                          r"pip install 'fedsap-ray\[export\]'"):
        export.require("onnx")
    export.require("torchscript")


def test_any_module_exports_as_onnx_and_torchscript_but_safetensors_needs_its_constructor(tmp_path):
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    assert export.export_module(net, x, "onnx", tmp_path / "n.onnx").max_abs_diff <= export.TOLERANCE
    assert export.export_module(net, x, "torchscript", tmp_path / "n.pt").max_abs_diff <= export.TOLERANCE
    with pytest.raises(ConfigError, match="format safetensors needs a model built by fedsap_ray.models.build_model"):
        export.export_module(net, x, "safetensors", tmp_path / "n.safetensors")
    with pytest.raises(ValueError, match=r"a onnx export is a \.onnx file"):
        export.export_module(net, x, "onnx", tmp_path / "n.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.onnx", "n.pt"]


def test_cli_formats_are_the_exporters():
    from fedsap_ray.cli import EXPORT_FORMATS

    assert EXPORT_FORMATS == tuple(export.FORMATS)


def test_description_is_json_of_the_input_kind():
    sub, _ = fedsap_like_submodel("char_lstm")
    x = export.random_inputs(sub, 3)
    assert x.dtype == torch.long and int(x.max()) < 95
    meta = export.describe(sub, x, "onnx")
    assert meta["input"] == {"name": "input", "dtype": "int64", "shape": ["batch", 80]}
    assert meta["output"]["shape"] == ["batch", 10] and json.loads(json.dumps(meta)) == meta
    img = export.random_inputs(fedsap_like_submodel("cnn_small")[0], 3)
    assert img.dtype == torch.float32 and float(img.min()) >= -1.0 and float(img.max()) <= 1.0
    assert export.input_transform(torch.uint8).startswith("uint8 image pixels p (N, C, H, W) -> p * 2/255 - 1")
