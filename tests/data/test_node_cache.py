"""Node-shared, memory-mapped splits (fedsap_ray.data.node_cache): same federation as a normal load, built
once per node across processes (under a lock), rebuilt when corrupt or stale, copy-on-write maps (writes never reach the files)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation, federation, node_cache, registry
from fedsap_ray.data.base import DomainData, Federation
from fedsap_ray.data.registry import DomainSplits, FileStatus
from tests.data.cachekit import assert_same_splits

REPO = Path(__file__).resolve().parents[2]
HAS_PROC_MAPS = Path("/proc/self/maps").exists()


@pytest.fixture(autouse=True)
def _fresh_memo():
    node_cache.clear_in_process()
    yield
    node_cache.clear_in_process()


@pytest.fixture(scope="module")
def smoke_cfg():
    return build_config(preset="smoke", seed=0)


def counting_load(monkeypatch) -> list[int]:
    """Patch load_splits (as node_cache calls it) to count its calls; returns the call log."""
    calls: list[int] = []
    real = federation.load_splits

    def counted(cfg):
        calls.append(1)
        return real(cfg)

    monkeypatch.setattr(federation, "load_splits", counted)
    return calls


def mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


def assert_same_federation(a: Federation, b: Federation) -> None:
    assert (a.dataset, a.domains, a.num_classes, a.input_kind, a.input_shape, a.vocab_size, a.notes,
            a.domain_notes) == (b.dataset, b.domains, b.num_classes, b.input_kind, b.input_shape, b.vocab_size,
                                b.notes, b.domain_notes)
    for part in ("train", "test"):
        for d in a.domains:
            pa, pb = getattr(a, part)[d], getattr(b, part)[d]
            assert np.array_equal(pa.x.numpy(), pb.x.numpy()) and np.array_equal(pa.y.numpy(), pb.y.numpy()), (part, d)
    assert len(a.clients) == len(b.clients)
    for ca, cb in zip(a.clients, b.clients):
        assert (ca.client_id, ca.domain, ca.pruning_ratio, ca.capacity, ca.tv_distance) == \
               (cb.client_id, cb.domain, cb.pruning_ratio, cb.capacity, cb.tv_distance)
        assert np.array_equal(ca.indices, cb.indices) and np.array_equal(ca.label_counts, cb.label_counts)


# ---------------------------------------------------------------------------- embedded_digits, one process
@pytest.mark.parametrize("seed", [0, 1])
def test_federation_from_shared_splits_equals_normal_one(tmp_path, seed):
    cfg = build_config(preset="smoke", seed=seed)
    normal = build_federation(cfg)
    node_cache.shared_splits(cfg, tmp_path)  # builds
    node_cache.clear_in_process()
    reopened = node_cache.shared_splits(cfg, tmp_path)  # maps the files
    assert_same_splits(federation.load_splits(cfg), reopened)
    assert_same_federation(normal, build_federation(cfg, reopened))
    assert node_cache.entry_dir(cfg, tmp_path) == node_cache.entry_dir(build_config(preset="smoke", seed=seed + 7),
                                                                       tmp_path)  # not seed dependent
    if HAS_PROC_MAPS:
        assert str(node_cache.entry_dir(cfg, tmp_path) / "train_x_0.npy") in mapped_files()


def test_repeated_calls_reuse_the_process_maps_and_info_and_clear(tmp_path, smoke_cfg, monkeypatch):
    calls = counting_load(monkeypatch)
    a = node_cache.shared_splits(smoke_cfg, tmp_path)
    assert node_cache.shared_splits(smoke_cfg, tmp_path) is a and len(calls) == 1
    entry = node_cache.entry_dir(smoke_cfg, tmp_path)
    assert entry.parent == tmp_path and entry.name.startswith("embedded_digits-") and len(entry.name) == 16 + 16
    meta = json.loads((entry / "meta.json").read_text())
    assert len(meta["arrays"]) == 4 * 4  # train/test x and y for each of the four domains
    info = node_cache.node_cache_info(tmp_path)
    assert [(i["name"], i["key"], i["path"]) for i in info] == [("embedded_digits", entry.name[-16:], entry)]
    assert info[0]["bytes"] == sum(f.stat().st_size for f in entry.iterdir()) > sum(
        a.train[d].x.numel() for d in a.domains)
    assert node_cache.node_cache_builds(tmp_path) == {entry.name: 1}
    assert node_cache.clear_node_cache(tmp_path) == 1 and not entry.exists() and node_cache.node_cache_info(tmp_path) == []
    node_cache.shared_splits(smoke_cfg, tmp_path)
    assert len(calls) == 2 and entry.is_dir()
    assert node_cache.node_cache_builds(tmp_path) == {entry.name: 2}  # the log outlives a clear: two builds here


def _corrupt(entry: Path, how: str) -> None:
    if how == "no_meta":
        (entry / "meta.json").unlink()
    elif how == "bad_meta":
        (entry / "meta.json").write_text('{"format_version": 1, "arr')
    elif how == "truncated":
        f = entry / "train_x_0.npy"
        os.truncate(f, f.stat().st_size // 2)
    elif how == "shape":  # same sample count, so only the check against meta.json can tell
        n = len(np.load(entry / "train_y_0.npy"))
        np.save(entry / "train_x_0.npy", np.zeros((n, 3, 16, 32), dtype=np.uint8))
    elif how == "dtype":
        np.save(entry / "test_y_1.npy", np.load(entry / "test_y_1.npy").astype(np.int32))
    elif how == "missing_array":
        (entry / "test_x_3.npy").unlink()
    elif how == "old_format":
        meta = json.loads((entry / "meta.json").read_text())
        meta["format_version"] = 0
        (entry / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("how", ["no_meta", "bad_meta", "truncated", "shape", "dtype", "missing_array", "old_format"])
def test_corrupt_entry_is_rebuilt(tmp_path, smoke_cfg, monkeypatch, how):
    reference = federation.load_splits(smoke_cfg)
    calls = counting_load(monkeypatch)
    node_cache.shared_splits(smoke_cfg, tmp_path)
    node_cache.clear_in_process()  # drop our maps before damaging the files under them
    entry = node_cache.entry_dir(smoke_cfg, tmp_path)
    _corrupt(entry, how)
    rebuilt = node_cache.shared_splits(smoke_cfg, tmp_path)
    assert len(calls) == 2
    assert_same_splits(reference, rebuilt)
    assert sorted(p.name for p in tmp_path.iterdir()) == [node_cache.BUILD_LOG, entry.name,
                                                          entry.name + ".lock"]  # nothing left over
    node_cache.clear_in_process()
    node_cache.shared_splits(smoke_cfg, tmp_path)  # now complete: opened, not rebuilt
    assert len(calls) == 2 and node_cache.node_cache_builds(tmp_path) == {entry.name: 2}


# ---------------------------------------------------------------------------- a fake text source with natural clients
class FakeText:
    """Stands in for ``shakespeare`` (so the config accepts it): text, vocab, natural clients; data from the
    integer in ``<root>/lines.txt`` and the seed; counts its loads."""

    name = "shakespeare"
    single_domain = natural_partition = True  # what register_dataset declares for the real one
    description = "fake"
    how_to_obtain = "made by the test"
    seed_dependent = False
    loads = 0

    def default_root(self) -> Path:
        raise AssertionError("tests always pass data.root")

    def files(self, root: Path) -> list[FileStatus]:
        p = Path(root) / "lines.txt"
        return [FileStatus("lines", p, p.is_file())]

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits:
        type(self).loads += 1
        shift = int((Path(root) / "lines.txt").read_text())
        rng = np.random.default_rng((seed, shift))

        def dd(n: int) -> DomainData:
            return DomainData(torch.from_numpy(rng.integers(0, 30, (n, 8))), torch.from_numpy(rng.integers(0, 30, n)))

        perm = rng.permutation(60)
        return DomainSplits(
            dataset="fake_text", domains=["plays"], train={"plays": dd(60)}, test={"plays": dd(20)},
            num_classes=30, input_kind="text", input_shape=(8,), vocab_size=30, notes=f"fake {shift}",
            domain_notes={"plays": "made up"},
            natural_train={"HAMLET": perm[:30], "OPHELIA": perm[30:45], "YORICK": perm[45:]},
            natural_test={"HAMLET": np.arange(0, 12), "OPHELIA": np.arange(12, 20), "GHOST": np.zeros(0, np.int64)},
        )


@pytest.fixture
def fake_text(monkeypatch, tmp_path):
    monkeypatch.setitem(registry._SOURCES, "shakespeare", FakeText)
    monkeypatch.setattr(FakeText, "loads", 0)
    root = tmp_path / "text_root"
    root.mkdir()
    (root / "lines.txt").write_text("1")
    federation.clear_split_cache()
    yield root
    federation.clear_split_cache()  # the fake splits must not outlive the test in load_splits' cache


def text_cfg(root: Path, seed: int = 0):
    return build_config(preset="smoke", seed=seed, overrides=[
        "data.name=shakespeare", "data.partition=natural", f"data.root={root}", "data.num_clients=3",
        "model.name=char_lstm", "data.max_test_per_domain=null"])


def test_text_source_with_natural_clients_round_trips(fake_text, tmp_path):
    cfg = text_cfg(fake_text)
    node_cache.shared_splits(cfg, tmp_path / "nc")
    node_cache.clear_in_process()
    reopened = node_cache.shared_splits(cfg, tmp_path / "nc")
    assert FakeText.loads == 1
    assert_same_splits(federation.load_splits(cfg), reopened)
    assert isinstance(reopened.natural_train["HAMLET"], np.memmap) and len(reopened.natural_test["GHOST"]) == 0
    reopened.natural_train["HAMLET"][0] = 5  # copy-on-write: this process only
    node_cache.clear_in_process()
    assert node_cache.shared_splits(cfg, tmp_path / "nc").natural_train["HAMLET"][0] != 5
    node_cache.clear_in_process()
    reopened = node_cache.shared_splits(cfg, tmp_path / "nc")
    assert_same_federation(build_federation(cfg), build_federation(cfg, reopened))


def test_key_follows_root_and_the_load_seed(fake_text, tmp_path, monkeypatch):
    nc = tmp_path / "nc"
    other_root = tmp_path / "other_root"
    other_root.mkdir()
    (other_root / "lines.txt").write_text("1")
    assert node_cache.entry_dir(text_cfg(fake_text), nc) == node_cache.entry_dir(text_cfg(fake_text, seed=4), nc)
    assert node_cache.entry_dir(text_cfg(fake_text), nc) != node_cache.entry_dir(text_cfg(other_root), nc)
    monkeypatch.setattr(FakeText, "seed_dependent", True)  # then load_splits loads per run seed, and so do we
    a, b = (node_cache.shared_splits(text_cfg(fake_text, seed=s), nc) for s in (0, 4))
    assert node_cache.entry_dir(text_cfg(fake_text), nc) != node_cache.entry_dir(text_cfg(fake_text, seed=4), nc)
    assert FakeText.loads == 2 and not np.array_equal(a.train["plays"].x.numpy(), b.train["plays"].x.numpy())
    node_cache.clear_in_process()
    assert_same_splits(node_cache.shared_splits(text_cfg(fake_text, seed=4), nc), b)
    assert FakeText.loads == 2


def test_changed_source_file_rebuilds_the_entry(fake_text, tmp_path):
    cfg = text_cfg(fake_text)
    first = node_cache.shared_splits(cfg, tmp_path / "nc")
    old_x = first.train["plays"].x.clone()
    node_cache.clear_in_process()
    st = (fake_text / "lines.txt").stat()
    (fake_text / "lines.txt").write_text("22")  # new size (and mtime): the data under the root changed
    os.utime(fake_text / "lines.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again = node_cache.shared_splits(cfg, tmp_path / "nc")
    assert FakeText.loads == 2 and again.notes == "fake 22"
    assert not np.array_equal(old_x.numpy(), again.train["plays"].x.numpy())


# ---------------------------------------------------------------------------- other processes
CHILD = r"""
import json, sys, time
from pathlib import Path
args = json.loads(sys.argv[1])
from fedsap_ray.config import build_config
from fedsap_ray.data import federation, node_cache
cfg = build_config(preset="smoke", seed=0)
calls = []
real = federation.load_splits
def counted(c):
    calls.append(1)
    time.sleep(args["slow"])  # widen the window in which a second builder would slip in without the lock
    return real(c)
federation.load_splits = counted
if args["ready"]:
    Path(args["ready"]).touch()
    deadline = time.monotonic() + 60
    while not Path(args["go"]).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
s = node_cache.shared_splits(cfg, args["cache_dir"])
entry = node_cache.entry_dir(cfg, args["cache_dir"])
sums = [int(s.train[d].x.sum()) for d in s.domains]  # what it read, before any write of its own
if args["write"]:
    x = s.train[s.domains[0]].x
    x[0, 0, 0, 0] = 255 - int(x[0, 0, 0, 0])
    print("WROTE", flush=True)
maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
print(json.dumps({"loads": len(calls), "mapped": str(entry / "train_x_0.npy") in maps, "sums": sums}))
"""


def start_child(cache_dir: Path, *, slow: float = 0.0, ready: Path | None = None, go: Path | None = None,
                write: bool = False) -> subprocess.Popen:
    args = {"cache_dir": str(cache_dir), "slow": slow, "ready": str(ready) if ready else "",
            "go": str(go) if go else "", "write": write}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONFAULTHANDLER", None)  # the write test's fault is expected; no traceback dump

    def no_core() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=no_core)


def child_report(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _entry_files(entry: Path) -> list[tuple[str, int, int]]:
    return [(p.name, p.stat().st_ino, p.stat().st_mtime_ns) for p in [entry, *sorted(entry.iterdir())]]


@pytest.fixture(scope="module")
def second_process(tmp_path_factory, smoke_cfg):
    """An entry this process built, and a second process that opened it and then wrote through one of its tensors
    (one child for the two tests below: a Python with torch costs seconds to start): (this process's splits, the
    entry, its files and digest before the child, the first domain's sum before, the child's report)."""
    node_cache.clear_in_process()
    cache = tmp_path_factory.mktemp("second_process")
    s = node_cache.shared_splits(smoke_cfg, cache)
    entry = node_cache.entry_dir(smoke_cfg, cache)
    before, digest, first = _entry_files(entry), _digest(entry), int(s.train[s.domains[0]].x.sum())
    p = start_child(cache, write=True)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0 and "WROTE" in out, err[-2000:]
    yield s, entry, before, digest, first, json.loads(out.strip().splitlines()[-1])
    node_cache.clear_in_process()


def test_second_process_maps_the_entry_without_loading(second_process):
    s, entry, before, _, _, rep = second_process
    assert rep["loads"] == 0
    assert rep["sums"] == [int(s.train[d].x.sum()) for d in s.domains]
    if HAS_PROC_MAPS:
        assert rep["mapped"]
    assert _entry_files(entry) == before


def test_two_processes_started_together_build_once(tmp_path, smoke_cfg):
    cache, sync = tmp_path / "nc", tmp_path / "sync"
    sync.mkdir()
    go = sync / "go"
    procs = [start_child(cache, slow=0.5, ready=sync / f"ready{i}", go=go) for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((sync / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "children did not start"
        time.sleep(0.02)
    go.touch()
    reps = [child_report(p) for p in procs]
    assert sorted(r["loads"] for r in reps) == [0, 1]  # exactly one built; the other waited and mapped it
    assert reps[0]["sums"] == reps[1]["sums"]
    entry = node_cache.entry_dir(smoke_cfg, cache)
    assert sorted(p.name for p in cache.iterdir()) == [node_cache.BUILD_LOG, entry.name, entry.name + ".lock"]
    assert node_cache.node_cache_builds(cache) == {entry.name: 1}  # the build log counts the one build


def test_a_write_through_a_tensor_never_reaches_the_shared_files(second_process):
    # copy-on-write maps: the writer's own pages change, the files and other processes' views do not
    s, entry, _, digest, first, _ = second_process
    assert _digest(entry) == digest
    assert int(s.train[s.domains[0]].x.sum()) == first
