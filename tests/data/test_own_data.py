"""Your own data without editing the package (issue 53, fedsap_ray/data/own.py): arrays registered in-process, and
a plugin found through a real entry point (a tiny distribution installed in a temporary folder: a .dist-info with
entry_points.txt on sys.path) that runs, resumes, is recorded, and whose changed data a resume refuses, naming both
hashes; a broken plugin is one line naming its entry point. Bad arrays are refused naming the split and array."""
from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation, register_arrays
from fedsap_ray.data.explicit import partition_digest
from fedsap_ray.data.own import splits_digest
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.experiment import run_experiment
from fedsap_ray.config.registry import DATASETS
from tests.conftest import steady
from tests.faultkit import cli, sets

DIST = "tinyplugin"
PLUGIN = textwrap.dedent('''
    """A dataset plugin: three domains of 8-feature blobs, read from arrays.npz beside this module."""
    from pathlib import Path

    import numpy as np

    HERE = Path(__file__).parent


    def load():
        """Tiny blobs: three domains of 8 float features, 3 classes (a test plugin)"""
        a = np.load(HERE / "arrays.npz")
        return {"train": (a["x"], a["y"], a["d"]), "test": (a["xt"], a["yt"], a["dt"]), "num_classes": 3}


    def mismatched():
        """A loader whose labels are one short"""
        got = load()
        x, y, d = got["train"]
        return {**got, "train": (x, y[:-1], d)}


    class TinySource:
        """The same data as a dataset class, as the package's own are written."""

        description = "tiny blobs as a dataset class (a test plugin)"
        how_to_obtain = "nothing to obtain"

        def default_root(self):
            return HERE

        def files(self, root):
            return []

        def load(self, root, *, download=False, seed=0):
            from fedsap_ray.data.own import make_splits

            got = load()
            return make_splits("tinyclass", got["train"], got["test"], num_classes=3)
''')
BROKEN = "raise ImportError('the plugin needs a package that is not installed: nosuchlib')\n"
ENTRY_POINTS = textwrap.dedent('''
    [fedsap_ray.datasets]
    tinyplug = fedsap_tinyplugin:load
    tinyclass = fedsap_tinyplugin:TinySource
    tinybroken = fedsap_tinybroken:load
    tinybad = fedsap_tinyplugin:mismatched
''')
NAMES = ("tinyplug", "tinyclass", "tinybroken", "tinybad", "mine", "mine1")
RUN = ["data.name=tinyplug", "model.name=mlp", "model.width_mult=0.125", "data.partition=iid", "data.num_clients=4",
       "training.rounds=2", "training.local_epochs=1", "training.batch_size=16", "training.max_steps_per_epoch=2",
       "training.eval_deployed=false", "algorithm.name=fedavg"]


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, dt = np.repeat(["a", "b", "c"], 40), np.repeat(["a", "b", "c"], 10)
    return {"x": rng.normal(size=(120, 8)).astype(np.float32), "y": rng.integers(0, 3, 120), "d": d,
            "xt": rng.normal(size=(30, 8)).astype(np.float32), "yt": rng.integers(0, 3, 30), "dt": dt}


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The installed plugin's folder (on sys.path for the module's tests); the registry forgets it afterwards."""
    root = tmp_path_factory.mktemp("site")
    (root / "fedsap_tinyplugin.py").write_text(PLUGIN)
    (root / "fedsap_tinybroken.py").write_text(BROKEN)
    np.savez(root / "arrays.npz", **_arrays(0))
    info = root / f"{DIST}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    yield root
    sys.path.remove(str(root))
    for name in NAMES:
        DATASETS.unregister(name)
    for mod in ("fedsap_tinyplugin", "fedsap_tinybroken"):
        sys.modules.pop(mod, None)


@pytest.fixture(scope="module")
def plugin_run(plugin, tmp_path_factory, single_thread):
    """One uninterrupted run of the plugin dataset, from the command line (in-process): its folder."""
    out = tmp_path_factory.mktemp("plugin") / "out"
    from fedsap_ray.cli import main

    assert main(["run", "--preset", "smoke", "--quiet", "--out", str(out), "--run-id", "p", *sets(RUN)]) == 0
    return out


def test_a_plugin_dataset_is_found_by_its_entry_point_name_runs_and_is_recorded(plugin_run):
    res = results.load(plugin_run)
    row = res.runs.iloc[0]
    assert row["status"] == "finished" and row["dataset"] == "tinyplug"
    assert "tinyplug = fedsap_tinyplugin:load" in row["dataset_notes"] and DIST in row["dataset_notes"]
    assert row["partition_source"] == "builtin:iid" and len(row["partition_hash"]) == 16
    assert sorted(res.clients["true_domain"].unique()) == ["a", "b", "c"]
    # the hash covers the plugin's arrays: the same split of other data would give another
    cfg = build_config(preset="smoke", overrides=RUN)
    fed = build_federation(cfg)
    assert partition_digest(fed) == row["partition_hash"] and fed.data_digest is not None


def _folder(out):
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_plugin_run_resumes_to_the_same_tables_and_refuses_changed_data(plugin, plugin_run, tmp_path, capsys,
                                                                          single_thread):
    out = tmp_path / "out"
    cfg = build_config(preset="smoke", overrides=RUN)

    def stop(summary):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out, run_id="q", progress=stop)
    # the plugin's data changed (same shapes, other numbers): a new process loads the plugin again
    np.savez(plugin / "arrays.npz", **_arrays(1))
    DATASETS.unregister("tinyplug")
    before = _folder(out)
    rc, err = cli(capsys, "run", "--out", str(out), "--resume", "q", "--quiet")
    assert rc == 2 and len(err) == 1, err
    old = results.load(plugin_run).runs.iloc[0]["partition_hash"]
    assert "--resume='q'" in err[0] and "dataset tinyplug" in err[0] and old in err[0] and err[0].count("hash") == 2
    assert _folder(out) == before  # the refusal changed nothing
    # the data back as it was: the resume finishes with the tables of the uninterrupted run
    np.savez(plugin / "arrays.npz", **_arrays(0))
    DATASETS.unregister("tinyplug")
    rc, err = cli(capsys, "run", "--out", str(out), "--resume", "q", "--quiet")
    assert rc == 0, err
    a, b = results.load(plugin_run), results.load(out)
    for table in ("rounds", "clients"):
        pd.testing.assert_frame_equal(steady(getattr(a, table)).drop(columns="run_id"),
                                      steady(getattr(b, table)).drop(columns="run_id"))
    assert b.runs.iloc[0]["partition_hash"] == a.runs.iloc[0]["partition_hash"]


def test_fedsap_ray_datasets_lists_the_installed_plugins_without_importing_them(plugin, capsys):
    from fedsap_ray.cli import main

    DATASETS.unregister("tinybroken")
    assert main(["datasets"]) == 0
    text = capsys.readouterr().out
    assert "tinybroken = fedsap_tinybroken:load (distribution tinyplugin 0.1)" in text and "embedded_digits" in text
    assert "tinybroken" not in DATASETS.entries and "tinybroken" not in DATASETS.plugin_errors  # listed, not loaded


def test_a_dataset_class_plugin_is_registered_as_a_source_and_its_arrays_digested(plugin):
    fed = build_federation(build_config(preset="smoke", overrides=[*RUN, "data.name=tinyclass"]))
    assert fed.dataset == "tinyclass" and fed.data_digest is not None
    assert DATASETS.get("tinyclass").__name__ == "TinySource"


def test_a_broken_plugin_is_one_line_naming_its_entry_point_and_nothing_is_written(plugin, tmp_path, capsys):
    out = tmp_path / "out"
    for _ in range(2):  # and the same line again, without importing it a second time
        rc, err = cli(capsys, "run", "--preset", "smoke", "--out", str(out), *sets([*RUN, "data.name=tinybroken"]))
        assert rc == 2 and len(err) == 1, err
        assert "tinybroken = fedsap_tinybroken:load" in err[0] and f"distribution {DIST} 0.1" in err[0]
        assert "ImportError: the plugin needs a package that is not installed" in err[0]
    assert not out.exists()
    # a plugin that imports but whose loader gives bad arrays: the same, naming the entry point and the array
    rc, err = cli(capsys, "run", "--preset", "smoke", "--out", str(out), *sets([*RUN, "data.name=tinybad"]))
    assert rc == 2 and len(err) == 1, err
    assert "tinybad = fedsap_tinyplugin:mismatched" in err[0] and "train x has shape (120, 8)" in err[0]
    assert not out.exists()
    # an unknown name lists the plugins' names among the allowed values, without importing them
    with pytest.raises(ConfigError, match=r"allowed values are .*tinyplug"):
        DATASETS.get("no_such_dataset")


def test_registered_arrays_run_and_a_single_domain_refuses_the_domain_partition(plugin, tmp_path, single_thread):
    a = _arrays(3)
    register_arrays("mine", (a["x"], a["y"]), (a["xt"], a["yt"]), replace=True)
    cfg = build_config(preset="smoke", overrides=[*RUN, "data.name=mine", "training.rounds=1"])
    fed = build_federation(cfg)
    assert fed.domains == ["mine"] and fed.input_kind == "features" and fed.num_classes == 3
    with pytest.raises(ConfigError, match=r"invalid data\.partition='domain': data\.name=mine has one domain"):
        build_config(preset="smoke", overrides=[*RUN, "data.name=mine", "data.partition=domain"])
    # the caller's arrays are copied: changing them changes nothing registered
    digest = fed.data_digest
    a["x"][:] = 0
    assert splits_digest(DATASETS.get("mine").load(tmp_path)) == digest
    # a package dataset is never replaced; an own one only on request
    with pytest.raises(ValueError, match="embedded_digits.*never replaced"):
        register_arrays("embedded_digits", (a["x"], a["y"]), (a["xt"], a["yt"]))
    with pytest.raises(ValueError, match="replace=True"):
        register_arrays("mine", (a["x"], a["y"]), (a["xt"], a["yt"]))


@pytest.mark.parametrize("train, test, match", [
    (lambda a: (a["x"], a["y"][:-1]), lambda a: (a["xt"], a["yt"]), r"train x has shape \(120, 8\).*N = 119"),
    (lambda a: (a["x"].astype(np.float64) * np.nan, a["y"]), lambda a: (a["xt"], a["yt"]), "train x holds NaN"),
    (lambda a: (a["x"], a["y"] - 1), lambda a: (a["xt"], a["yt"]), "train y has a negative label"),
    (lambda a: (a["x"], a["y"], a["d"]), lambda a: (a["xt"], a["yt"], np.repeat(["a", "z", "c"], 10)),
     r"test names domain\(s\) \['z'\]"),
    (lambda a: (a["x"], a["y"], a["d"]), lambda a: (a["xt"][:10], a["yt"][:10], a["dt"][:10]),
     r"training domain\(s\) \['b', 'c'\] have no test samples"),
    (lambda a: (a["x"], a["y"]), lambda a: (a["xt"].astype(np.uint8)[:, :4], a["yt"]), "uint8 input is images"),
    (lambda a: (a["x"], a["y"]), lambda a: (a["xt"][:, :4], a["yt"]), "must hold the same kind of input"),
], ids=["lengths", "nan", "labels", "unknown-domain", "no-test", "uint8-not-images", "shapes"])
def test_bad_arrays_are_refused_naming_the_split_and_array(train, test, match):
    a = _arrays(2)
    with pytest.raises(ValueError, match=match):
        register_arrays("mine1", train(a), test(a))
    assert "mine1" not in DATASETS.entries
