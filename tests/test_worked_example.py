"""The worked example of docs/architecture.md: a method with its own local loss and its own metric is
one module plus one registry line. The test loads the module from the page itself (so the page cannot
drift from what works), registers it, and checks that everything the page promises happens."""
from __future__ import annotations

import importlib.util
import re
import sys

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, federation_fixture, tiny_overrides
from fedsap_ray import docgen, results
from fedsap_ray.algorithms import hooks, parse_options, registry
from fedsap_ray.config import ConfigError, build_config
from fedsap_ray.experiment import run_experiment

PAGE = REPO / "docs" / "architecture.md"
FED = tiny_overrides("fedavg", "data.num_clients=4", "training.rounds=2")
fed = federation_fixture(FED)


def example_source() -> str:
    """The python block that follows the ``<!-- worked-example: ... -->`` marker."""
    m = re.search(r"<!-- worked-example: (\S+) -->\n```python\n(.*?)\n```", PAGE.read_text(), flags=re.S)
    assert m, "docs/architecture.md has no worked-example block"
    return m.group(2) + "\n"


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
