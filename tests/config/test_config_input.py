"""Config input that cannot surprise (issue 40): duplicate keys and null sections are errors, an error
line quotes at most a short prefix of a value (an alias bomb fails at once), resource settings are
bounded by the machine or cluster before any work, device values give finite times, and traces are
checked strictly and are part of the run's identity. Every refusal: exit 2, one short line naming the
field (or file), nothing written; the legal neighbours of each case stay accepted."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultkit import TINY, cli, sets, tiny_run
from fedsap_ray.runtime import limits
from fedsap_ray.data import devices
from fedsap_ray.config import MAX_YAML_NODES, build_config, load_file
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.checks import DEVICE_RANGES, short
from fedsap_ray.config.device_config import DevicesConfig
from fedsap_ray.config.schema import ExperimentConfig


def _refused(capsys, *args: str, needles: tuple[str, ...]) -> str:
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--print-config", *args)
    assert rc == 2 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("fedsap-ray: error: invalid ") and len(line) < 400, line
    for n in needles:
        assert n in line, line
    return line


def _write(tmp_path, name: str, text: str) -> str:
    f = tmp_path / name
    f.write_text(text)
    return str(f)


# ---------------------------------------------------------------------------------------------
# Duplicate keys, at any depth, in YAML and JSON
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, text, path, line", [
    ("c.yaml", "data:\n  num_clients: 4\nmodel:\n  width_mult: 0.5\ndata:\n  alpha: 0.5\n", "data", 5),
    ("c.yaml", "devices:\n  jitter: 0.1\n  policy: wait_all\n  jitter: 0.2\n", "devices.jitter", 4),
    ("c.yaml", "algorithm:\n  name: fedprox\n  options:\n    mu: 0.1\n    mu: 0.2\n", "algorithm.options.mu", 5),
    ("c.yaml", "capacity: {scheme: tiers, scheme: full}\n", "capacity.scheme", 1),
    ("c.yaml", "study: a\nseed: 1\nseed: 2\n", "seed", 3),
    ("c.json", '{"model": {"name": "cnn_small", "width_mult": 0.5, "name": "mlp"}}', "model.name", None),
    ("c.json", '{"seed": 1, "training": {}, "seed": 2}', "seed", None),
])
def test_a_duplicate_key_at_any_depth_is_refused_naming_file_path_and_line(tmp_path, capsys, name, text, path, line):
    f = _write(tmp_path, name, text)
    msg = _refused(capsys, "--config", f, needles=(f, f"duplicate key {path}"))
    if line is not None:
        assert f"at line {line}" in msg


def test_duplicate_keys_in_a_set_value_are_refused(capsys):
    _refused(capsys, "--set", "training={rounds: 2, rounds: 3}", needles=("--set", "duplicate key rounds"))


def test_the_same_key_in_different_mappings_and_yaml_merge_keys_stay_legal(tmp_path):
    f = _write(tmp_path, "c.yaml", "x: &base {rounds: 3, lr: 0.1}\n")
    assert load_file(f) == {"x": {"rounds": 3, "lr": 0.1}}
    f = _write(tmp_path, "c.yaml", "training: {rounds: 3}\ndevices: {jitter: 0.1}\ndata: {num_clients: 4}\n")
    cfg = build_config(preset="smoke", file_data=load_file(f))
    assert (cfg.training.rounds, cfg.devices.jitter, cfg.data.num_clients) == (3, 0.1, 4)
    merged = load_file(_write(tmp_path, "m.yaml", "a: &a {rounds: 3, lr: 0.1}\nb:\n  <<: *a\n  rounds: 5\n"))
    assert merged["b"] == {"rounds": 5, "lr": 0.1}  # a key next to a merge overrides it, as YAML says


# ---------------------------------------------------------------------------------------------
# Null sections
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make_args, section", [
    (lambda t: ["--config", _write(t, "c.yaml", "model:\ntraining:\n  rounds: 2\n")], "model"),
    (lambda t: ["--config", _write(t, "c.json", '{"devices": null}')], "devices"),
    (lambda t: ["--config", _write(t, "c.yaml", "algorithm:\n  name: fedprox\n  options:\n")], "algorithm.options"),
    (lambda t: ["--set", "resources=null"], "resources"),
    (lambda t: ["--set", "capacity=~"], "capacity"),
    (lambda t: ["--set", "data=null"], "data"),
    (lambda t: ["--set", "algorithm=null"], "algorithm"),
    (lambda t: ["--set", "algorithm={name: fedprox, options: null}"], "algorithm.options"),
])
def test_a_null_section_is_refused_naming_it(tmp_path, capsys, make_args, section):
    _refused(capsys, *make_args(tmp_path), needles=(f"invalid {section}=null", "a section cannot be null"))


@pytest.mark.parametrize("make_args, section, value", [
    (lambda t: ["--set", "training=[]", "--set", "training.rounds=2"], "training", "[]"),  # a sweep's own sets follow
    (lambda t: ["--set", "devices=5", "--set", "devices.policy=wait_all"], "devices", "5"),
    (lambda t: ["--set", "algorithm.options=[]", "--set", "algorithm.mu=0.1"], "algorithm.options", "[]"),
    (lambda t: ["--config", _write(t, "c.yaml", "model: [cnn]\n")], "model", "['cnn']"),
    (lambda t: ["--config", _write(t, "c.json", '{"asynchronous": true}')], "asynchronous", "True"),
])
def test_a_section_given_as_anything_but_a_mapping_is_refused_before_later_overrides_merge(tmp_path, capsys, make_args,
                                                                                          section, value):
    """A non-mapping section used to be replaced by the next override's mapping: the preset's section was lost
    (``training=[]`` then ``training.rounds=2`` ran with the default batch size, not the preset's)."""
    _refused(capsys, *make_args(tmp_path), needles=(f"invalid {section}={value}", "must be a mapping"))
    with pytest.raises(ConfigError, match="must be a mapping"):  # the sweeps' path: overrides, no command line
        build_config(preset="smoke", overrides=["training=[]", "training.rounds=2"])


def test_an_empty_section_changes_nothing_and_a_null_optional_leaf_is_legal(tmp_path):
    base = build_config(preset="smoke")
    assert build_config(preset="smoke", overrides=["training={}", "data={}", "algorithm.options={}"]) == base
    assert build_config(preset="smoke", file_data=load_file(_write(tmp_path, "c.yaml", "devices: {}\n"))) == base
    cfg = build_config(preset="smoke", overrides=["training.grad_clip=null", "data.max_test_per_domain=null"])
    assert cfg.training.grad_clip is None and cfg.data.max_test_per_domain is None


# ---------------------------------------------------------------------------------------------
# Short values in error lines; alias bombs
# ---------------------------------------------------------------------------------------------
def _laughs(levels: int = 9) -> str:
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["top", "unknown_key", "field"])
def test_a_billion_laughs_document_fails_at_once_with_one_short_line(tmp_path, capsys, where):
    doc = _laughs()
    if where == "unknown_key":
        doc = "bogus:\n" + "".join("  " + line + "\n" for line in doc.splitlines())
    elif where == "field":
        doc = "training:\n  rounds:\n" + "".join("    " + line + "\n" for line in doc.splitlines())
    assert len(doc) < 1200
    f = _write(tmp_path, "bomb.yaml", doc)
    line = _refused(capsys, "--config", f, needles=(f, f"more than {MAX_YAML_NODES:,} values"))
    assert len(line) < 300


@pytest.mark.timeout(30)
def test_recursive_aliases_are_refused(tmp_path, capsys):
    f = _write(tmp_path, "c.yaml", "training: &t {rounds: 2, x: *t}\n")
    _refused(capsys, "--config", f, needles=(f, "refers to the node that holds it"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, field", [
    (["--set", "devices.policy=" + "y" * 1_000_000], "devices.policy"),  # a megabyte of text
    (["--set", "training.rounds=[" + ",".join(["1"] * 50_000) + "]"], "training.rounds"),
    (["--set", "data.bogus={" + ",".join(f"k{i}: {i}" for i in range(20_000)) + "}"], "data.bogus"),
    (["--set", "algorithm.nope=" + "9" * 20_000], "algorithm.nope"),  # an int past str()'s digit limit
    (["--set", "model.name=" + "[" * 60 + "]" * 60], "model.name"),
])
def test_a_huge_value_is_quoted_as_a_short_prefix(capsys, args, field):
    line = _refused(capsys, *args, needles=(f"{field}=",))
    assert len(line) < 400 and "..." in line


def test_short_never_builds_the_whole_repr():
    nested: list = []
    nested.append(nested)  # recursive
    for v in (10**100_000, "x" * 10**6, list(range(10**5)), {i: i for i in range(10**4)}, nested):
        assert len(short(v)) <= 80
    assert short([1.0] * 10) == "[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]"  # small values whole


# ---------------------------------------------------------------------------------------------
# Resources: bounded by this machine / the Ray cluster, before any work
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, field", [
    ("resources.torch_threads=100000", "resources.torch_threads=100000"),
    ("resources.torch_threads=3", "resources.torch_threads=3"),
    ("resources.num_workers=1000000", "resources.num_workers=1000000"),
    ("resources.num_workers=3", "resources.num_workers=3"),
])
def test_local_threads_and_workers_beyond_the_machines_cpus_exit_2_before_any_work(tmp_path, capsys, monkeypatch,
                                                                                      override, field):
    monkeypatch.setattr(limits, "machine_cpus", lambda: 2)
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path / "o"), *sets(TINY),
                    "--set", override)
    assert rc == 2 and len(lines) == 1, lines
    assert field in lines[0] and "this machine has 2 CPUs" in lines[0], lines
    assert not (tmp_path / "o").exists()
    # the config itself stays portable: --print-config (no run) accepts it
    rc, _ = cli(capsys, "run", "--preset", "smoke", "--print-config", "--set", override)
    assert rc == 0


def test_local_resources_within_the_machine_are_accepted(monkeypatch):
    monkeypatch.setattr(limits, "machine_cpus", lambda: 4)
    for o in (["resources.torch_threads=4"], ["resources.num_workers=4"], ["resources.num_workers=2",
                                                                             "resources.torch_threads=2"]):
        limits.check_resources(build_config(preset="smoke", overrides=o))
    # the Ray backend is bounded by its cluster, not by this machine
    limits.check_resources(build_config(preset="smoke", overrides=["resources.backend=ray",
                                                                   "resources.num_workers=64"]))


def test_ray_workers_and_threads_are_bounded_by_the_clients_and_the_cluster():
    cfg = build_config(preset="smoke", overrides=["resources.backend=ray", "resources.num_workers=11"])
    with pytest.raises(ConfigError, match=r"invalid resources.num_workers=11: the federation has 10 clients"):
        limits.check_cluster_resources(cfg, 10, {"CPU": 64.0})
    cfg = build_config(preset="smoke", overrides=["resources.backend=ray", "resources.torch_threads=9"])
    with pytest.raises(ConfigError, match=r"invalid resources.torch_threads=9: the Ray cluster has 8 CPUs"):
        limits.check_cluster_resources(cfg, 10, {"CPU": 8.0})
    ok = build_config(preset="smoke", overrides=["resources.backend=ray", "resources.num_workers=10",
                                                 "resources.torch_threads=8"])
    limits.check_cluster_resources(ok, 10, {"CPU": 8.0})  # more workers than CPUs now: an autoscaler may add them


@pytest.mark.timeout(120)
@pytest.mark.parametrize("partition", ["domain", "iid", "dirichlet"])
def test_absurd_client_counts_are_refused_before_anything_is_allocated(tmp_path, capsys, partition):
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path / "o"),
                    "--set", f"data.partition={partition}", "--set", "data.num_clients=1000000000000")
    assert rc == 2 and len(lines) == 1, lines
    assert "invalid data.num_clients=1000000000000" in lines[0] and "training samples" in lines[0], lines
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# Device values give finite, positive times
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override", [
    "devices.speed_full=1e-300", "devices.speed_full=0.5", "devices.speed_full=1e19",
    "devices.down_bytes_s=1e-300", "devices.up_bytes_s=0.01", "devices.up_bytes_s=1e16",
    "devices.backward_factor=1e308", "devices.backward_factor=1001",
    "devices.jitter=1000", "devices.jitter=4.5", "devices.over_select=1e308",
])
def test_device_values_outside_their_range_are_refused_with_the_range(capsys, override):
    field, value = override.split("=")
    low, high = DEVICE_RANGES[field.split(".")[1]]
    _refused(capsys, "--set", override, needles=(f"invalid {field}=", f"must be a number in [{low:g}, {high:g}]"))


def test_device_values_at_their_bounds_are_accepted():
    for f, (low, high) in DEVICE_RANGES.items():
        for v in (low, high):
            assert getattr(build_config(preset="smoke", overrides=[f"devices.{f}={v!r}"]).devices, f) == v


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.fixed_dictionaries({f: st.floats(min_value=lo, max_value=hi) for f, (lo, hi) in DEVICE_RANGES.items()}),
       st.floats(min_value=1e-12, max_value=1.0), st.integers(0, 2**32 - 1), st.integers(1, 10**4),
       st.integers(0, 10**15), st.integers(0, 10**12), st.integers(0, 10**12))
def test_any_accepted_device_model_gives_finite_positive_times(values, capacity, seed, t, macs, down, up):
    d = DevicesConfig(**values)
    cfg = ExperimentConfig(seed=seed, devices=d)
    dev = devices.Device(max(d.speed_full * capacity, devices.MIN_SPEED), d.down_bytes_s, d.up_bytes_s, 1.0)
    s = devices.client_time(cfg, dev, t, 3, macs, down, up)
    assert math.isfinite(s) and (s > 0 or macs + down + up == 0)


def test_a_capacity_too_small_for_a_finite_time_is_named():
    cfg = build_config(preset="smoke", overrides=["devices.speed_full=1"])
    with pytest.raises(ConfigError, match=r"invalid devices.speed_full=1: client 1 has capacity 1e-300"):
        devices.devices_for(cfg, [1.0, 1e-300])


# ---------------------------------------------------------------------------------------------
# Traces: strict, and part of the run's identity
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, needle", [
    ("client_id,speed\n0,1e9\n1.7,1e9\n", "row 2: client_id 1.7 is not an integer"),
    ("client_id,speed\n0,1e9\n2,1e9\n0,2e9\n", "row 3: client_id 0 again (first in row 1)"),
    ("client_id,speed,up_bytes\n0,1e9,1e6\n", "unknown column 'up_bytes'; the columns are client_id, speed"),
    ("client_id,speed\n0,fast\n", "row 1 (client 0): speed 'fast' must be a number in [1, 1e+18]"),
    ("client_id,speed\n0,1e9\n1,\n", "row 2 (client 1): speed nan must be a number"),
    ("client_id,speed\n0,inf\n", "row 1 (client 0): speed inf must be"),
    ("client_id,speed\n4,1e9\n", "row 1: client_id 4 is not one of the 4 clients (0..3)"),
    ("client_id,speed\n-1,1e9\n", "client_id -1 is not one of the 4 clients"),
    ("client_id,speed\nx,1e9\n", "row 1: client_id 'x' is not an integer"),
    ("client_id,speed,down_bytes_s\n0,1e9,1e-300\n", "row 1 (client 0): down_bytes_s 1e-300 must be a number in [1, 1e+15]"),
    ("client_id,speed,availability\n0,1e9,0\n", "availability 0 must be a number in (0, 1]"),
    ("client_id,speed,availability\n0,1e9,1.5\n", "availability 1.5 must be"),
    ("client_id,speed\n", "has no rows"),
    ("speed\n1e9\n", "missing client_id"),
])
def test_a_bad_trace_exits_2_naming_the_file_row_and_column_before_any_work(tmp_path, capsys, text, needle):
    f = _write(tmp_path, "trace.csv", text)
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(tmp_path / "o"), *sets(TINY),
                    "--set", f"devices.trace={f}")
    assert rc == 2 and len(lines) == 1, lines
    assert f"invalid devices.trace='{f}'" in lines[0] and needle in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_parquet_traces_are_checked_alike_and_integral_float_ids_are_accepted(tmp_path):
    cfg = build_config(preset="smoke", overrides=[*TINY])
    f = tmp_path / "t.parquet"
    pd.DataFrame({"client_id": [True], "speed": [1e9]}).to_parquet(f)
    with pytest.raises(ConfigError, match=r"row 1: client_id True is not an integer"):
        devices._read_trace(str(f), cfg.devices, 4)
    pd.DataFrame({"client_id": [0], "speed": [1e9], "note": ["x"]}).to_parquet(f)
    with pytest.raises(ConfigError, match=r"unknown column 'note'"):
        devices._read_trace(str(f), cfg.devices, 4)
    pd.DataFrame({"client_id": [2.0, 3.0], "speed": [1e9, 2e9], "availability": [0.5, 1.0]}).to_parquet(f)
    got = devices._read_trace(str(f), cfg.devices, 4)
    assert {c: (d.speed, d.availability) for c, d in got.items()} == {2: (1e9, 0.5), 3: (2e9, 1.0)}
    csv = _write(tmp_path, "t.csv", "client_id,speed,down_bytes_s,up_bytes_s\n3,1e9,1e6,1e5\n0.0,5,1,1\n")
    assert sorted(devices._read_trace(csv, cfg.devices, 4)) == [0, 3]


def test_the_traces_content_is_part_of_the_config_hash_and_configs_without_a_trace_keep_theirs(tmp_path):
    # hashes of the same configs before devices.trace_sha256 existed (commit 8b6978f)
    assert build_config(preset="smoke").config_hash() == "670e427f2acd"
    assert build_config(preset="paper").config_hash() == "23b6441b3b37"
    assert build_config(preset="smoke", overrides=["devices.policy=deadline", "devices.deadline_s=30"]
                        ).config_hash() == "7f3b1b47cbc8"
    assert build_config(preset="smoke", overrides=["devices.jitter=0.5", "devices.availability=0.8"]
                        ).config_hash() == "08464f4c6620"
    f = tmp_path / "t.csv"
    f.write_text("client_id,speed\n0,1e9\n")
    a = build_config(preset="smoke", overrides=[f"devices.trace={f}"])
    f.write_text("client_id,speed\n0,2e9\n")
    b = build_config(preset="smoke", overrides=[f"devices.trace={f}"])
    assert a.devices.trace_sha256 != b.devices.trace_sha256 and a.config_hash() != b.config_hash()
    assert json.loads(a.to_json())["devices"]["trace_sha256"] == a.devices.trace_sha256
    with pytest.raises(ConfigError, match=r"invalid devices.trace_sha256=.*devices.trace, which is not set"):
        build_config(preset="smoke", overrides=["devices.trace_sha256=" + "a" * 64])
    with pytest.raises(ConfigError, match=r"invalid devices.trace=.*the file changed since the run's config was made"):
        limits.check_resources(a)  # a's recorded hash is of the first content


def test_a_resume_after_the_trace_was_edited_exits_2_and_resumes_once_restored(tmp_path, capsys):
    f = tmp_path / "trace.csv"
    original = "client_id,speed\n0,1e9\n1,2e9\n"
    f.write_text(original)
    out = tmp_path / "runs"
    tiny_run(out, "r", f"devices.trace={f}", stop_after=1)
    f.write_text("client_id,speed\n0,1e9\n1,2e3\n")  # client 1 a million times slower
    rc, lines = cli(capsys, "run", "--quiet", "--out", str(out), "--resume", "r")
    assert rc == 2 and len(lines) == 1, lines
    assert f"invalid devices.trace='{f}'" in lines[0] and "the file changed since" in lines[0], lines
    f.write_text(original)
    rc, lines = cli(capsys, "run", "--quiet", "--out", str(out), "--resume", "r")
    assert rc == 0, lines
