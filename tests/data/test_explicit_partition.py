"""Explicit partitions (issue 53, fedsap_ray/data/explicit.py): a JSON file mapping clients to samples, domains and
capacities trains exactly those clients, is recorded (runs.partition_source, partition_hash), and a resume after the
file changed is refused naming the file and both hashes; every bad file is exit 2 and one line naming the client and
the field, nothing written. A Flower Datasets partitioner becomes such a partition (a real DirichletPartitioner),
and a federation given to run_experiment is what its runs row records, and what a resume must be given again."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from fedsap_ray import results
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation, load_splits
from fedsap_ray.data.explicit import ExplicitClient, ExplicitPartition, partition_digest, read_partition
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.experiment import run_experiment
from tests.conftest import steady
from tests.faultkit import cli, sets

TINY = ["algorithm.name=heterofl", "data.num_clients=4", "model.name=cnn_small", "model.width_mult=0.0625",
        "data.max_test_per_domain=16", "training.local_epochs=1", "training.batch_size=16",
        "training.max_steps_per_epoch=2", "training.rounds=2", "training.eval_deployed=false"]
SIZES = {"mnist": 4000, "uci_digits": 1437, "street": 4000, "synth": 4000}  # embedded_digits' training splits


def _doc(**changes) -> dict:
    """Four clients of 30 samples, two of mnist (one at capacity 0.5) and one each of uci_digits and street."""
    doc = {"clients": [{"id": 0, "domain": "mnist", "indices": list(range(0, 30)), "capacity": 0.5},
                       {"id": 1, "domain": "mnist", "indices": list(range(30, 60))},
                       {"id": 2, "domain": "uci_digits", "indices": list(range(1400, 1430))},
                       {"id": 3, "domain": "street", "indices": list(range(3970, 4000))}]}
    doc.update(changes)
    return doc


def _write(path, doc) -> str:
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


def _overrides(path: str, *extra: str) -> list[str]:
    return [*TINY, "data.partition=explicit", f"data.partition_file={path}", *extra]


@pytest.fixture(scope="module")
def explicit_run(tmp_path_factory, single_thread):
    """An uninterrupted run on the file of :func:`_doc`: (its folder, the file)."""
    root = tmp_path_factory.mktemp("explicit")
    path = _write(root / "partition.json", _doc())
    run_experiment(build_config(preset="smoke", overrides=_overrides(path)), root / "out", run_id="e")
    return root / "out", path


def test_the_file_decides_each_clients_samples_and_capacity_and_is_recorded(explicit_run):
    out, path = explicit_run
    res = results.load(out)
    row = res.runs.iloc[0]
    assert row["partition_source"] == f"file:{path}" and row["status"] == "finished"
    fed = build_federation(build_config(preset="smoke", overrides=_overrides(path)))
    assert row["partition_hash"] == partition_digest(fed)
    for c, entry in zip(fed.clients, _doc()["clients"]):
        assert c.domain == entry["domain"] and c.indices.tolist() == entry["indices"]
    c = res.clients.drop_duplicates("client_id").set_index("client_id")
    assert c.loc[0, "capacity_max"] == 0.5 and c.loc[0, "pruning_ratio"] == 0.5  # the file's capacity
    assert c.loc[1, "capacity_max"] == 0.8  # capacity.scheme's (cyclic: 1 - 0.2) for a client without one
    assert c.loc[0, "assigned_width"] == 0.5  # heterofl trains p_i = kappa_i
    assert dict(c["true_domain"]) == {0: "mnist", 1: "mnist", 2: "uci_digits", 3: "street"}


def test_a_resume_refuses_a_changed_file_and_finishes_on_the_same_one(explicit_run, tmp_path, capsys, single_thread):
    path = _write(tmp_path / "partition.json", _doc())
    out = tmp_path / "out"

    def stop(summary):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(build_config(preset="smoke", overrides=_overrides(path)), out, run_id="e", progress=stop)
    old = results.load(out).runs.iloc[0]["partition_hash"]
    _write(tmp_path / "partition.json", _doc(allow_overlap=False) | {"clients": [
        *_doc()["clients"][:3], {"id": 3, "domain": "street", "indices": list(range(3960, 3990))}]})
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rc, err = cli(capsys, "run", "--out", str(out), "--resume", "e", "--quiet")
    assert rc == 2 and len(err) == 1, err
    assert f"file:{path}" in err[0] and old in err[0] and err[0].count("hash") == 2
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files  # nothing changed
    _write(tmp_path / "partition.json", _doc())
    rc, err = cli(capsys, "run", "--out", str(out), "--resume", "e", "--quiet")
    assert rc == 0, err
    a, b = results.load(explicit_run[0]), results.load(out)
    for table in ("rounds", "clients"):
        pd.testing.assert_frame_equal(steady(getattr(a, table)), steady(getattr(b, table)))


def _set(entry: int, **fields) -> dict:
    doc = _doc()
    doc["clients"][entry] = {**doc["clients"][entry], **fields}
    return doc


BAD = {  # what is wrong -> (the file, what the one line must name)
    "out-of-range": (_set(2, indices=[5, 1437]), ["client 2 (entry 2)", "indices", "1437", "uci_digits", "1437 training"]),
    "overlap": (_set(1, indices=[29, 30, 31]), ["clients 0 and 1", "sample 29", "mnist", "allow_overlap"]),
    "empty": (_set(3, indices=[]), ["client 3 (entry 3)", "indices is empty"]),
    "string-index": (_set(1, indices=[30, "31"]), ["client 1 (entry 1)", "indices holds '31'"]),
    "bool-index": (_set(1, indices=[30, True]), ["client 1 (entry 1)", "indices holds True"]),
    "float-id": (_set(2, id=2.0), ["clients entry 2", "id is 2.0"]),
    "unknown-domain": (_set(3, domain="svhn"), ["client 3 (entry 3)", "domain 'svhn'", "mnist, uci_digits"]),
    "missing-domain": (_set(3, domain=None), ["client 3 (entry 3)", "domain is missing"]),
    "duplicate-id": (_set(3, id=1), ["client 1 (entry 3)", "given twice", "entries 1 and 3"]),
    "gap-in-ids": (_set(3, id=7), ["client ids must be 0..3", "[3]"]),
    "capacity-zero": (_set(1, capacity=0), ["client 1 (entry 1)", "capacity is 0", "(0, 1]"]),
    "capacity-above-one": (_set(1, capacity=1.5), ["client 1 (entry 1)", "capacity is 1.5"]),
    "capacity-string": (_set(1, capacity="0.5"), ["client 1 (entry 1)", "capacity is '0.5'"]),
    "repeated-index": (_set(1, indices=[30, 31, 30]), ["client 1 (entry 1)", "30 more than once"]),
    "negative-index": (_set(1, indices=[30, -1]), ["client 1 (entry 1)", "holds -1"]),
    "unknown-key": (_set(0, weight=2), ["client 0 (entry 0)", "unknown key 'weight'"]),
    "fewer-clients": ({"clients": _doc()["clients"][:3]}, ["holds 3 clients", "data.num_clients=4"]),
    "not-json": ('{"clients": [', ["is not JSON"]),
    "key-twice": ('{"clients": [], "clients": []}', ["'clients' appears twice"]),
    "overlap-flag": (_doc(allow_overlap="yes"), ["allow_overlap is 'yes'"]),
    "no-clients": ({"clients": []}, ["clients is array", "non-empty list"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_file_is_exit_2_and_one_line_naming_the_client_and_field(case, tmp_path, capsys):
    doc, names = BAD[case]
    path = _write(tmp_path / "p.json", doc)
    out = tmp_path / "out"
    rc, err = cli(capsys, "run", "--preset", "smoke", "--out", str(out), *sets(_overrides(path)))
    assert rc == 2 and len(err) == 1, err
    assert f"invalid data.partition_file='{path}'" in err[0]
    for n in names:
        assert n in err[0], (n, err[0])
    assert not out.exists()  # refused before anything was written


def test_overlap_when_the_file_allows_it_and_the_fields_the_config_refuses(tmp_path):
    doc = _set(1, indices=[29, 30, 31])
    doc["allow_overlap"] = True
    path = _write(tmp_path / "p.json", doc)
    fed = build_federation(build_config(preset="smoke", overrides=_overrides(path)))
    assert 29 in fed.clients[0].indices and 29 in fed.clients[1].indices
    with pytest.raises(ConfigError, match=r"invalid data\.partition='explicit': needs data\.partition_file"):
        build_config(preset="smoke", overrides=[*TINY, "data.partition=explicit"])
    with pytest.raises(ConfigError, match=r"invalid data\.partition_file=.*read only with data\.partition=explicit"):
        build_config(preset="smoke", overrides=[*TINY, f"data.partition_file={path}"])
    with pytest.raises(ConfigError, match=r"invalid data\.max_train_per_domain=100: is not read with data\.partition=explicit"):
        build_config(preset="smoke", overrides=[*_overrides(path), "data.max_train_per_domain=100"])
    with pytest.raises(ConfigError, match=r"invalid data\.partition_file=.*no such file"):
        build_config(preset="smoke", overrides=_overrides(str(tmp_path / "none.json")))


def test_a_flower_partitioner_becomes_the_federation_and_its_runs_row_says_so(tmp_path, single_thread):
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    from fedsap_ray.data.flower import from_flower

    cfg = build_config(preset="smoke", overrides=[*TINY, "data.num_clients=5"])
    splits = load_splits(cfg)
    part = from_flower({"mnist": DirichletPartitioner(num_partitions=3, partition_by="label", alpha=0.5, seed=7),
                        "street": IidPartitioner(num_partitions=2)}, splits)
    assert part.source == "flower:DirichletPartitioner+IidPartitioner"
    assert [c.domain for c in part.clients] == ["mnist"] * 3 + ["street"] * 2
    # the clients are Flower's partitions: a second partitioner of the same seed gives the same index sets
    again = DirichletPartitioner(num_partitions=3, partition_by="label", alpha=0.5, seed=7)
    again.dataset = Dataset.from_dict({"label": splits.train["mnist"].y.numpy(), "i": np.arange(SIZES["mnist"])})
    for c in part.clients[:3]:
        assert sorted(c.indices.tolist()) == sorted(again.load_partition(c.id)["i"])
    assert sum(len(c.indices) for c in part.clients[3:]) == SIZES["street"]  # IID: every street sample, once
    # as a file for data.partition=explicit: the same clients
    path = part.save(tmp_path / "flower.json")
    assert read_partition(path).clients[4].indices.tolist() == part.clients[4].indices.tolist()
    # as an object: build_federation takes it over the config's scheme, and the runs row records it, not the config
    fed = build_federation(cfg, partition=part)
    run_experiment(cfg, tmp_path / "out", run_id="f", federation=fed)
    row = results.load(tmp_path / "out").runs.iloc[0]
    assert row["partition_source"] == "flower:DirichletPartitioner+IidPartitioner"
    assert row["partition_hash"] == partition_digest(fed) and row["num_clients"] == 5
    assert json.loads(row["config_json"])["data"]["partition"] == "domain"  # what the config said, beside it


def test_a_given_federation_is_recorded_and_a_resume_must_be_given_the_same(tmp_path, single_thread):
    cfg = build_config(preset="smoke", overrides=TINY)
    iid = build_config(preset="smoke", overrides=[*TINY, "data.partition=iid"])
    fed = build_federation(iid)  # trained under a config that says data.partition=domain

    def stop(summary):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path, run_id="g", federation=fed, progress=stop)
    row = results.load(tmp_path).runs.iloc[0]
    assert row["partition_source"] == "builtin:iid" and row["partition_hash"] == partition_digest(fed)
    with pytest.raises(ConfigError, match=r"--resume='g'.*builtin:iid \(partition hash .*builtin:domain gives hash"):
        run_experiment(cfg, tmp_path, run_id="g", resume=True)  # the config's own federation is another
    outcome = run_experiment(cfg, tmp_path, run_id="g", resume=True, federation=build_federation(iid))
    assert outcome.status == "finished"
    # the hash is of what is trained, not of where it came from: the same clients by hand hash alike
    hand = ExplicitPartition(tuple(ExplicitClient(c.client_id, c.domain, c.indices) for c in fed.clients))
    same = build_federation(cfg, partition=hand)
    assert same.partition_source == "object" and partition_digest(same) == partition_digest(fed)
