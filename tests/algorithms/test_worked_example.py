"""The worked examples of docs/architecture.md: a method with its own local loss and its own metric, and a
dataset with its own model, are each one module plus one registry line. The tests load the modules from
the page itself (so the page cannot drift from what works), register them, and check that everything the
page promises happens."""
from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, federation_fixture, tiny_overrides
from fedsap_ray import results
from fedsap_ray.config import registry as registries
from fedsap_ray.dev import docgen
from fedsap_ray.algorithms import hooks, parse_options, registry
from fedsap_ray.data import federation
from fedsap_ray.config import ConfigError, build_config
from fedsap_ray.experiment import run_experiment

PAGE = REPO / "docs" / "architecture.md"
FED = tiny_overrides("fedavg", "data.num_clients=4", "training.rounds=2")
fed = federation_fixture(FED)


def page_blocks(kind: str) -> dict[str, str]:
    """Module path -> the python block that follows each ``<!-- kind: path -->`` marker of the page."""
    return dict(re.findall(rf"<!-- {kind}: (\S+) -->\n```python\n(.*?)\n```", PAGE.read_text(), flags=re.S))


def example_source(path: str = "fedsap_ray/algorithms/fedavg_ls.py") -> str:
    """The python block that follows the ``<!-- worked-example: path -->`` marker."""
    blocks = page_blocks("worked-example")
    assert path in blocks, f"docs/architecture.md has no worked-example block for {path}"
    return blocks[path] + "\n"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    path = tmp_path_factory.mktemp("example") / "fedavg_ls.py"
    path.write_text(example_source())
    spec = importlib.util.spec_from_file_location("worked_example_fedavg_ls", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(mod)  # registers the strategy and its hook, as the registry line would
    yield mod
    registry._REGISTRY.pop("fedavg_ls", None)
    sys.modules.pop(spec.name, None)
    hooks.unregister_hook(mod.HOOK)


def _run(fed, tmp_path, name: str, *extra: str) -> results.Results:
    cfg = build_config(preset="smoke", overrides=[*FED, f"algorithm.name={name}", *extra])
    run_experiment(cfg, tmp_path / name, run_id="r", federation=fed)
    return results.load(tmp_path / name)


def test_the_worked_example_runs_with_its_own_loss_and_its_own_column(tmp_path, example, fed):
    base = _run(fed, tmp_path, "fedavg")
    plain = _run(fed, tmp_path / "eps0", "fedavg_ls", "algorithm.options.smoothing=0.0")
    smooth = _run(fed, tmp_path / "eps2", "fedavg_ls", "algorithm.options.smoothing=0.2")

    # the hook is the loss: eps = 0 is exactly FedAvg's cross-entropy, eps = 0.2 is not
    cols = ["round", "domain", "eval_mode", "accuracy", "loss", "train_loss"]
    pd.testing.assert_frame_equal(plain.rounds[cols], base.rounds[cols], check_exact=True)
    np.testing.assert_array_equal(plain.clients["train_loss"], base.clients["train_loss"])
    assert not np.array_equal(smooth.clients["train_loss"], base.clients["train_loss"])

    # the metric: declared by the module, written for every client, a probability, paid for in bytes_up
    conf = smooth.clients["train_confidence"]
    assert conf.notna().all() and ((conf > 0) & (conf <= 1)).all()
    assert base.clients["train_confidence"].isna().all()  # other methods leave it null
    np.testing.assert_array_equal(smooth.clients["bytes_up"], base.clients["bytes_up"] + 4)
    assert "| `train_confidence` | `double` |" in docgen.results_page()
    assert "`fedavg_ls`" in docgen.results_page()


def test_the_worked_example_refuses_a_bad_option_naming_it(example):
    with pytest.raises(ConfigError, match=r"algorithm\.smoothing=1\.5"):
        parse_options("fedavg_ls", {"smoothing": 1.5})


# --- a dataset with its own model -------------------------------------------------------------------------
DATA_MODULE, MODEL_MODULE = "fedsap_ray/data/blobs.py", "fedsap_ray/models/blob_net.py"
BLOBS = ["data.name=blobs", "model.name=blob_net", "data.partition=iid", "data.num_clients=4", "training.rounds=2",
         "training.local_epochs=1", "training.batch_size=16"]


@pytest.fixture(scope="module")
def dataset_and_model(tmp_path_factory):
    """Each module of the page put where its path says (a folder added to the package's ``__path__``), and each
    registration line of the page run as written: that line alone registers exactly the one new name."""
    lines = page_blocks("registration-line")
    added = []
    try:
        for path, table in ((DATA_MODULE, registries.DATASETS), (MODEL_MODULE, registries.MODELS)):
            package_path, module = path.removesuffix(".py").rsplit("/", 1)
            package = importlib.import_module(package_path.replace("/", "."))
            folder = tmp_path_factory.mktemp(module)
            (folder / f"{module}.py").write_text(example_source(path))
            package.__path__.append(str(folder))
            added.append((package, str(folder), module))
            line = lines[path].strip()
            assert line == f"from {package.__name__} import {module}  # noqa: F401", line  # one import line
            before = set(table.names())
            exec(compile(line, "docs/architecture.md", "exec"), {})
            assert len(set(table.names()) - before) == 1
        yield
    finally:
        registries.DATASETS.unregister("blobs")
        registries.MODELS.unregister("blob_net")
        for package, folder, module in added:
            package.__path__.remove(folder)
            sys.modules.pop(f"{package.__name__}.{module}", None)
            if hasattr(package, module):
                delattr(package, module)
        federation.clear_split_cache()


@pytest.mark.parametrize("algorithm", ["fedavg", "heterofl"])
def test_the_dataset_and_its_model_run_with_every_kind_of_strategy(tmp_path, dataset_and_model, algorithm):
    cfg = build_config(preset="smoke", overrides=[*BLOBS, f"algorithm.name={algorithm}"])
    run_experiment(cfg, tmp_path, run_id="r")
    res = results.load(tmp_path)
    assert res.runs.loc[0, "status"] == "finished" and res.runs.loc[0, "dataset"] == "blobs"
    assert res.runs.loc[0, "model"] == "blob_net"
    assert all(math.isfinite(a) for a in res.rounds["accuracy"])
    if algorithm == "heterofl":  # a sub-model method: clients below full capacity train part of the hidden layer
        assert (res.clients["capacity_used"] < 1).any()


def test_the_config_reads_what_the_dataset_declares(dataset_and_model):
    with pytest.raises(ConfigError, match=r"invalid data\.partition='domain': data\.name=blobs has one domain"):
        build_config(preset="smoke", overrides=[*BLOBS, "data.partition=domain"])
    with pytest.raises(ConfigError, match=r"invalid data\.name='nope': allowed values are .*\bblobs\b"):
        build_config(preset="smoke", overrides=["data.name=nope"])
    with pytest.raises(ConfigError, match=r"invalid model\.name='nope': allowed values are .*\bblob_net\b"):
        build_config(preset="smoke", overrides=["model.name=nope"])
    from fedsap_ray.data.registry import dataset_names, get_source

    assert "blobs" in dataset_names() and get_source("blobs").files(get_source("blobs").default_root()) == []
