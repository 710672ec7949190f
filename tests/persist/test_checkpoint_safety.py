"""Checkpoints cannot run code: the state is a JSON skeleton plus npz arrays read with allow_pickle=False
(fedsap_ray.persist.treecodec); a pickle where a checkpoint belongs is refused without being run; pickled
checkpoints of older versions are never opened; every strategy's state round-trips exactly."""
from __future__ import annotations

import collections
import enum
import io
import json
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from faultkit import TINY, cli, sets, tiny_run
from fedsap_ray import algorithms
from fedsap_ray.persist import checkpoint, treecodec
from fedsap_ray.algorithms.statetree import state_from_tree, state_tree
from fedsap_ray.config import build_config
from fedsap_ray.common.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def same(a: Any, b: Any) -> bool:
    """Equal values of exactly the same types, all the way down (NaN equals NaN, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(map(repr, a)) == list(map(repr, b)) and all(type(k) is type(j) and same(a[k], b[j])
                                                                for k, j in zip(a, b))
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and np.shape(a) == np.shape(b) and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16
                                                                         else a, b.view(torch.uint8)
                                                                         if b.dtype == torch.bfloat16 else b)
    return bool(a == b)


def round_trip(tree: Any) -> Any:
    buf = io.BytesIO()
    treecodec.write(buf, tree)
    buf.seek(0)
    return treecodec.read(buf)[1]


# ---------------------------------------------------------------------------------------------
# The codec: exact round trips (Hypothesis), refusals naming the key
# ---------------------------------------------------------------------------------------------
DTYPES = st.sampled_from([np.float32, np.float64, np.float16, np.int8, np.int32, np.int64, np.uint8, np.uint32,
                          np.bool_, np.complex64])
arrays = DTYPES.flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, max_side=4)))
numpy_scalars = arrays.map(lambda a: a.reshape(-1)[0] if a.size else a.dtype.type(0))
keys = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70), st.text(max_size=5),
                 st.floats(allow_nan=False), st.tuples(st.integers(), st.text(max_size=3)))
leaves = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**80, max_value=2**80),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), arrays, numpy_scalars)
trees = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.lists(kids, max_size=4).map(tuple),
    st.dictionaries(keys, kids, max_size=4)), max_leaves=20)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_any_state_tree_round_trips_with_its_exact_types(tree):
    assert same(round_trip(tree), tree)


def test_the_state_a_run_holds_round_trips_rng_states_tensors_and_aliases():
    rng = np.random.default_rng(7)
    rng.random(3)
    arr = np.arange(5, dtype=np.float32)
    tree = {"gen": rng.bit_generator.state, "mt": np.random.MT19937(3).state, "py": random.Random(4).getstate(),
            "torch_rng": torch.get_rng_state(), "bf16": torch.arange(3, dtype=torch.bfloat16), 3: {7: (1, [2])},
            "a": arr, "same_a": arr, "nested": [arr], "f64": np.float64(0.1), "i64": np.int64(-3), "nan": float("nan")}
    back = round_trip(tree)
    assert same(back, tree)
    assert back["a"] is back["same_a"] is back["nested"][0]  # one object in, one object out (as pickle keeps it)
    again = np.random.default_rng()
    again.bit_generator.state = back["gen"]
    assert again.random() == rng.random()  # the generator continues where it stopped
    r = random.Random()
    r.setstate(back["py"])
    assert r.random() == random.Random(4).random()


class Colour(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize("bad, where, kind", [
    ({"x": {3: [{1, 2}]}}, "state['x'][3][0]", "builtins.set"),
    ({"od": collections.OrderedDict(a=1)}, "state['od']", "collections.OrderedDict"),
    ({"dd": collections.defaultdict(list)}, "state['dd']", "collections.defaultdict"),
    ({"e": Colour.RED}, "state['e']", "Colour"),
    ({"o": np.array([None, 1], dtype=object)}, "state['o']", "dtype object"),
    ({"m": np.ma.masked_array([1, 2])}, "state['m']", "MaskedArray"),
    ({"f": lambda: 0}, "state['f']", "function"),
    ({frozenset([1]): 1}, "dict key frozenset", "frozenset"),
])
def test_a_value_the_format_does_not_store_is_refused_at_save_time_naming_its_key(tmp_path, bad, where, kind):
    with pytest.raises(treecodec.TreeTypeError) as e:
        treecodec.encode(bad)
    assert where in str(e.value) and kind in str(e.value), str(e.value)
    state = checkpoint.ServerState(round=1, params=np.zeros(3, np.float32), strategy_state=bad)
    with pytest.raises(treecodec.TreeTypeError):
        checkpoint.save(tmp_path, "r", state, {})
    assert not list((tmp_path / "checkpoints").iterdir())  # no checkpoint, no temporary file


def test_a_checkpoint_of_another_run_or_format_version_is_unreadable(tmp_path):
    state = checkpoint.ServerState(round=2, params=np.zeros(4, np.float32), strategy_state={1: np.ones(2)})
    checkpoint.save(tmp_path, "a", state, {"best": 0.5}, tables=["rounds"])
    ck = checkpoint.load(tmp_path, "a")
    assert ck["state"].round == 2 and ck["server"] == {"best": 0.5} and ck["tables"] == ["rounds"]
    assert same(ck["state"].strategy_state, state.strategy_state)
    (tmp_path / "checkpoints" / "b.npz").write_bytes(checkpoint.path_for(tmp_path, "a").read_bytes())
    with pytest.raises(checkpoint.CheckpointUnreadable, match="not the checkpoint of run 'b'"):
        checkpoint.load(tmp_path, "b")
    buf = io.BytesIO()
    np.savez(buf, **{treecodec.META: np.frombuffer(b'{"format": "fedsap_ray.tree", "version": 99, "tree": null}',
                                                   dtype=np.uint8)})
    checkpoint.path_for(tmp_path, "c").write_bytes(buf.getvalue())
    with pytest.raises(checkpoint.CheckpointUnreadable, match="format version 99"):
        checkpoint.load(tmp_path, "c")


# ---------------------------------------------------------------------------------------------
# Every strategy's state survives the format exactly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", algorithms.names())
def test_every_strategys_state_round_trips_exactly_through_its_checkpoint(tmp_path, algo):
    from fedsap_ray.runtime import make_backend
    from fedsap_ray.run.session import RunSession

    # evaluated at round 2 only (what the server's metrics hold then is what is round-tripped; a round's evaluation,
    # deployed models included, cost about half of it)
    cfg = build_config(preset="smoke", overrides=[*TINY, f"algorithm.name={algo}", "training.rounds=2",
                                                  "training.eval_every=2"])
    s = RunSession(cfg, tmp_path, "r", backend=make_backend(cfg))
    s.start()
    for t in (1, 2):
        s.step(t)
    s.backend.close()
    ck = checkpoint.load(tmp_path, "r")
    assert ck["state"].round == 2 and same(ck["state"].params, s.state.params)
    # a typed state (FedSAP's, HAS-FL's) is stored by its fields and comes back as its own dataclass
    assert same(ck["state"].strategy_state, state_tree(s.strategy, s.state.strategy_state)), algo
    back = state_from_tree(s.strategy, ck["state"].strategy_state)
    assert type(back) is type(s.state.strategy_state), algo
    assert same(state_tree(s.strategy, back), state_tree(s.strategy, s.state.strategy_state)), algo
    assert same(ck["server"], s.recorder.metrics_state())


# ---------------------------------------------------------------------------------------------
# Resuming never runs code from the results folder
# ---------------------------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates ``marker``: what a crafted checkpoint would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _malicious(marker: Path) -> bytes:
    payload = pickle.dumps({"state": _Payload(marker), "server": {}, "tables": []})
    probe = marker.with_name("probe")
    pickle.loads(pickle.dumps(_Payload(probe)))  # the payload works: unpickling it does create its file
    assert probe.exists()
    return payload


def _malicious_npz(marker: Path) -> bytes:
    """A well-formed checkpoint whose parameter array is an object array: a pickle inside the npz."""
    skeleton = {"format": treecodec.FORMAT, "version": treecodec.VERSION, "kind": "checkpoint", "run_id": "k1",
                "tree": {"d": [["state", {"d": [["round", 1], ["params", {"a": "a0"}], ["extra", {"d": []}]]}],
                               ["server", {"d": []}], ["tables", {"l": []}]]}}

    def npz(m: Path) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, allow_pickle=True, **{treecodec.META: np.frombuffer(json.dumps(skeleton).encode(), np.uint8),
                                            "a0": np.array([_Payload(m)], dtype=object)})
        return buf.getvalue()

    probe = marker.with_name("probe-npz")
    with np.load(io.BytesIO(npz(probe)), allow_pickle=True) as z:
        z["a0"]  # read with pickles allowed, the payload runs
    assert probe.exists()
    return npz(marker)


@pytest.mark.parametrize("where", ["checkpoint", "pickle-in-npz", "legacy"])
def test_resume_refuses_a_malicious_pickle_without_running_it(tmp_path, capsys, where, cut_run):
    out = tmp_path / "o"
    shutil.copytree(cut_run, out)  # an interrupted run, its checkpoint about to be replaced
    marker = tmp_path / "pwned"
    target = checkpoint.legacy_path_for(out, "k1") if where == "legacy" else checkpoint.path_for(out, "k1")
    checkpoint.path_for(out, "k1").unlink()
    target.write_bytes(_malicious_npz(marker) if where == "pickle-in-npz" else _malicious(marker))
    rc, lines = cli(capsys, "run", "--quiet", "--out", str(out), "--resume", "k1")
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("fedsap-ray: error: invalid --resume='k1': ") and str(target) in lines[0], lines
    if where == "legacy":
        assert "pickled checkpoint of an older fedsap_ray" in lines[0] and "--overwrite" in lines[0], lines
    else:
        assert "unreadable" in lines[0], lines
    assert not marker.exists()  # nothing in the file ran
    with pytest.raises(checkpoint.CheckpointUnreadable):
        checkpoint.load(out, "k1")
    assert not marker.exists()
    # the way out the message names: a fresh run under the same id (one round is enough to have overwritten it)
    rc, lines = cli(capsys, "run", "--preset", "smoke", "--quiet", "--out", str(out), "--run-id", "k1", "--overwrite",
                    *sets([*TINY, "training.rounds=1"]))
    assert rc == 0, lines
    assert not target.exists() and not marker.exists()


@pytest.mark.parametrize("uri", [False, True])
def test_a_sweep_resume_refuses_a_pickled_checkpoint_before_ray_starts(tmp_path, uri):
    from fedsap_ray.results.destination import ResultsDestination
    from sweeps.study import refuse_legacy_checkpoints

    folder = tmp_path / "sweep"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "v-s0.pkl").write_bytes(_malicious(tmp_path / "pwned"))
    dest = ResultsDestination(folder.as_uri() if uri else folder, staging_root=tmp_path / "staging")
    refuse_legacy_checkpoints(dest, ["other-s0"])  # not one of ours: fine
    with pytest.raises(ConfigError, match=r"invalid --resume: .*v-s0\.pkl is a pickled checkpoint"):
        refuse_legacy_checkpoints(dest, ["v-s0"])
    assert not (tmp_path / "pwned").exists()


def test_no_code_reads_results_files_with_pickle():
    """No pickle.load/loads, torch.load without weights_only=True, np.load(allow_pickle=True),
    Tuner.restore (unpickles tuner.pkl) or Trial.get_pickled_error (unpickles a trial's error.pkl) in
    the package, the sweeps or the analysis code; the one Unpickler (CIFAR-10 batches) refuses every
    global but numpy's array reconstructors."""
    bad = re.compile(r"pickle\.loads?\(|cloudpickle\.loads?\(|torch\.load\((?![^)]*weights_only=True)|"
                     r"allow_pickle=True|Tuner\.restore\(|get_pickled_error\(|joblib\.load|pd\.read_pickle|dill\.")
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for folder in ("fedsap_ray", "sweeps", "analysis", "benchmarks")
             for p in sorted((REPO / folder).rglob("*.py")) for i, line in enumerate(p.read_text().splitlines(), 1)
             if bad.search(line)]
    assert found == []
    unpicklers = sorted(str(p.relative_to(REPO)) for folder in ("fedsap_ray", "sweeps", "analysis", "benchmarks")
                        for p in (REPO / folder).rglob("*.py") if "pickle.Unpickler" in p.read_text())
    assert unpicklers == ["fedsap_ray/data/cifar.py"]
    from fedsap_ray.data.cifar import _BatchUnpickler

    assert set(_BatchUnpickler.allowed) == {("numpy.core.multiarray", "_reconstruct"),
                                            ("numpy._core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
                                            ("numpy", "dtype")}


@pytest.mark.parametrize("algo", ["fedsap", "hasfl"])
def test_a_checkpoint_from_before_the_typed_round_flow_resumes_exactly(tmp_path, algo):
    """Pre-issue-26 checkpoints kept the strategy state under ``extra``, with the last round's outputs
    (FedSAP's ``round_info``, HAS-FL's ``adapted``) in it: such a checkpoint resumes to the same tables."""
    import pyarrow.parquet as pq

    tiny_run(tmp_path / "whole", "k1", f"algorithm.name={algo}")
    cut = tmp_path / "cut"
    tiny_run(cut, "k1", f"algorithm.name={algo}", stop_after=2)
    path = checkpoint.path_for(cut, "k1")
    header, tree = treecodec.read(path)
    state = tree["state"]
    old = dict(state.pop("strategy"))
    old["round_info"] = {"n_global": 3, "swap": 0.25}
    old["adapted"] = True
    state["extra"] = old
    with open(path, "wb") as f:
        treecodec.write(f, tree, header={k: header[k] for k in ("kind", "run_id", "round")})
    assert "extra" in treecodec.read(path)[1]["state"]
    tiny_run(cut, "k1", f"algorithm.name={algo}", resume=True)
    for table in ("rounds", "clients"):
        a = pq.read_table(tmp_path / "whole" / table / "k1.parquet").to_pandas()
        b = pq.read_table(cut / table / "k1.parquet").to_pandas()
        time_cols = [c for c in a.columns if c.endswith("_s") or "time" in c]
        assert a.drop(columns=time_cols).equals(b.drop(columns=time_cols)), table


# ---------------------------------------------------------------------------------------------
# The content digest: what changed after the run wrote it is refused; a recomputed digest is trusted
# ---------------------------------------------------------------------------------------------
def rewrite_keeping_digest(path: Path, change) -> None:
    """The file at ``path`` with ``change(meta, arrays)`` applied to its JSON and its arrays, written whole again
    (fresh zip CRCs) with the digest it carried before: an edit that did not recompute it."""
    with np.load(path) as z:
        arrays = {n: z[n] for n in z.files if n != treecodec.META}
        meta = json.loads(z[treecodec.META].tobytes())
    change(meta, arrays)
    text = json.dumps(meta, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        np.savez(f, **{treecodec.META: np.frombuffer(text, np.uint8), **arrays})


def _params_name(meta: dict) -> str:
    """The array name of ``state.params`` in a checkpoint's skeleton."""
    state = dict(meta["tree"]["d"])["state"]
    return dict(state["d"])["params"]["a"]


def _nudge_params(meta, arrays) -> None:
    name = _params_name(meta)
    arrays[name] = arrays[name] + np.float32(1e-3)


def _set_skeleton_round(meta, arrays) -> None:
    state = dict(meta["tree"]["d"])["state"]
    for pair in state["d"]:
        if pair[0] == "round":
            pair[1] = 1
    meta["round"] = 1


EDITS = {
    "params-nudged": (_nudge_params, "its content does not match its digest"),
    "an-array-zeroed": (lambda meta, arrays: arrays.update({n: np.zeros_like(a) for n, a in list(arrays.items())[-1:]}),
                        "its content does not match its digest"),
    "round-edited": (_set_skeleton_round, "its content does not match its digest"),
    "header-edited": (lambda meta, arrays: meta.update(kind="checkpoint", note="x"), "its content does not match"),
    "digest-removed": (lambda meta, arrays: meta.pop("digest"), "it carries no content digest"),
    "digest-garbled": (lambda meta, arrays: meta.update(digest="sha256:" + "0" * 63), "it carries no content digest"),
}


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory) -> Path:
    """A tiny run interrupted after round 2 (its checkpoint is there); tests edit copies of it."""
    out = tmp_path_factory.mktemp("cut") / "o"
    tiny_run(out, "k1", stop_after=2)
    return out


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_checkpoint_changed_after_it_was_written_is_refused_by_name(tmp_path, capsys, edit, cut_run):
    """A file that still opens (its zip CRCs were recomputed by the rewrite), keeps its shapes and dtypes and whose
    values the content checks would accept, but is not what the run wrote: one line, exit 2, nothing changed."""
    change, needle = EDITS[edit]
    tmp_path = tmp_path / "o"
    shutil.copytree(cut_run, tmp_path)
    path = checkpoint.path_for(tmp_path, "k1")
    rewrite_keeping_digest(path, change)
    with pytest.raises(checkpoint.CheckpointUnreadable, match=rf"checkpoint {re.escape(str(path))} was changed after "
                                                              rf"the run wrote it \({needle}"):
        checkpoint.load(tmp_path, "k1")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    rc, lines = cli(capsys, "run", "--out", str(tmp_path), "--resume", "k1")
    assert rc == 2 and len(lines) == 1 and "invalid --resume='k1'" in lines[0] and needle in lines[0], lines
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_consistent_edit_with_its_digest_recomputed_is_taken_on_trust(tmp_path, cut_run):
    """What docs/guides/running.md says: whoever rewrites a checkpoint with a new digest (the codec's own writer)
    is trusted like any file a run is pointed at; the content checks still hold it to the run's shapes."""
    tmp_path = tmp_path / "o"
    shutil.copytree(cut_run, tmp_path)
    path = checkpoint.path_for(tmp_path, "k1")
    header, tree = treecodec.read(path)
    tree["state"]["params"] = tree["state"]["params"] + np.float32(1e-3)
    with open(path, "wb") as f:
        treecodec.write(f, tree, header=header)
    assert checkpoint.load(tmp_path, "k1")["state"].params[0] == tree["state"]["params"][0]
    assert tiny_run(tmp_path, "k1", resume=True).status == "finished"


def test_a_version_1_checkpoint_without_a_digest_still_resumes(tmp_path, cut_run):
    """Checkpoints an older fedsap_ray wrote (format version 1, before the digest) are read as before: a run it
    interrupted continues to the tables of the run never stopped."""
    import pandas as pd

    from fedsap_ray import results
    from tests.conftest import steady

    tiny_run(tmp_path / "whole", "k1")
    cut = tmp_path / "cut"
    shutil.copytree(cut_run, cut)

    def as_version_1(meta, arrays) -> None:
        meta["version"] = 1
        del meta["digest"]

    rewrite_keeping_digest(checkpoint.path_for(cut, "k1"), as_version_1)
    with np.load(checkpoint.path_for(cut, "k1")) as z:
        assert json.loads(z[treecodec.META].tobytes())["version"] == 1
    assert tiny_run(cut, "k1", resume=True).status == "finished"
    for table in ("rounds", "clients"):
        pd.testing.assert_frame_equal(steady(results.load(cut)[table]), steady(results.load(tmp_path / "whole")[table]))


def test_the_digest_covers_every_array_the_skeleton_names_and_the_json_and_nothing_else():
    """A version 2 file's digest is fedsap_ray.persist.digest's over the JSON (less the digest) and the named arrays: an
    array the skeleton does not name is never read, so it is no part of the content."""
    from fedsap_ray.persist import digest

    buf = io.BytesIO()
    treecodec.write(buf, {"a": np.arange(5), "b": (1.5, "x")}, header={"kind": "k"})
    buf.seek(0)
    with np.load(buf) as z:
        meta = json.loads(z[treecodec.META].tobytes())
        arrays = {n: z[n] for n in z.files if n != treecodec.META}
    assert meta["version"] == 2 and digest.is_digest(meta["digest"])
    assert meta["digest"] == digest.arrays_digest(arrays, meta={k: v for k, v in meta.items() if k != "digest"})
