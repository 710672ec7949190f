"""An asynchronous run (issue 44, fedsap_ray.engine.asyncmode) resumed from a checkpoint gives the tables of the run never
stopped: the checkpoint holds the engine's state (the event queue with every update in flight, its plan, result
and downloaded model, stored once per version; the buffer; the discarded arrivals; the clock; the dispatch
counters), and without it the tables differ. The state also round-trips taken in the middle of a step, with
buffered and discarded updates; plans and results come back field for field (hook payloads, shared masks); a
checkpoint without the state, or with an edited one, is refused by name. kill -9 + ``--resume``
of the command line: tests/test_cli_subprocess.py."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedsap_ray import results
from fedsap_ray.persist import checkpoint, treecodec
from fedsap_ray.algorithms.fedprox import ProximalTerm
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.engine.asyncmode import AsyncServer
from fedsap_ray.config import build_config
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.experiment import run_experiment
from fedsap_ray.common.messages import ClientPlan, ClientResult, ServerState, StartOverlay
from fedsap_ray.persist.messagetree import plan_from_tree, plan_tree, result_from_tree, result_tree
from fedsap_ray.runtime.local import LocalBackend
from fedsap_ray.run.session import RunSession
from tests.conftest import federation_fixture, steady, tiny_overrides

# HeteroFL on cyclic capacities (sub-models of five widths, masks shared by the clients of one width), devices of
# different speeds, FedBuff with a polynomial staleness weight, a server learning rate and a staleness bound
HETERO = tiny_overrides("heterofl", "data.num_clients=6", "training.eval_deployed=false")
FEDBUFF = ["devices.mode=async", "asynchronous.concurrency=5", "asynchronous.buffer_size=2",
           "asynchronous.staleness=polynomial", "asynchronous.staleness_a=0.5", "asynchronous.server_lr=0.7",
           "asynchronous.max_staleness=2", "training.rounds=10", "training.eval_every=5"]
SPEEDS = [0.5e9, 1e9, 0.6e9, 0.8e9, 0.45e9, 1e9]
# FedAsync on the full model: five equal fast devices arrive at one instant, one step each, so a step's
# checkpoint is written with arrivals of its instant still queued (the freed slots not yet started)
FULL = tiny_overrides("fedavg", "algorithm.width=full", "data.num_clients=6", "training.eval_deployed=false",
                      "capacity.scheme=full", "training.max_steps_per_epoch=1", "devices.down_bytes_s=1e6")
FEDASYNC = ["devices.mode=async", "asynchronous.concurrency=6", "asynchronous.buffer_size=1",
            "asynchronous.staleness=hinge", "asynchronous.staleness_a=2", "asynchronous.staleness_b=1",
            "asynchronous.max_staleness=6", "training.rounds=12", "training.eval_every=4"]
fed_cyclic = federation_fixture(HETERO, name="fed_cyclic")
fed_full = federation_fixture(FULL, name="fed_full")
# the same evaluated on the simulated clock (asynchronous.eval_every_s): its schedule reads the recorded time,
# which the checkpoint restores, so a resumed run evaluates at the same steps
TIMED = [*[o for o in FEDBUFF if not o.startswith("training.eval_every")], "asynchronous.eval_every_s=0.1"]
CASES = {"heterofl-fedbuff": (HETERO, FEDBUFF, SPEEDS, 7), "fedavg-fedasync": (FULL, FEDASYNC, [0.4e9] + [1e9] * 5, 7),
         "heterofl-fedbuff-timed": (HETERO, TIMED, SPEEDS, 6)}


def _config(tmp_path: Path, case: str, *extra: str):
    base, mode, speeds, _ = CASES[case]
    trace = tmp_path / "trace.csv"
    pd.DataFrame({"client_id": range(len(speeds)), "speed": speeds, "down_bytes_s": 1e12,
                  "up_bytes_s": 1e12}).to_csv(trace, index=False)
    return build_config(preset="smoke", overrides=[*base, *mode, f"devices.trace={trace}", *extra])


def _same_tables(a: results.Results, b: results.Results) -> None:
    """Every table equal but for the wall-clock columns (results.WALL_CLOCK)."""
    for table in ("rounds", "clients", "layers", "allocations"):
        pd.testing.assert_frame_equal(steady(getattr(a, table)), steady(getattr(b, table)))


def _cut(cfg, out: Path, fed, k: int) -> None:
    """Run ``cfg`` into ``out`` and stop it after step ``k`` (a KeyboardInterrupt, as Ctrl-C would)."""
    def stop(summary):
        if summary.round == k:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out, run_id="r", federation=fed, progress=stop)
    assert results.load(out).runs.loc[0, "rounds_done"] == k


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_async_run_equals_the_run_never_stopped(tmp_path, case, request, monkeypatch):
    fed = request.getfixturevalue("fed_cyclic" if case.startswith("heterofl") else "fed_full")
    cfg = _config(tmp_path, case)
    k = CASES[case][3]
    run_experiment(cfg, tmp_path / "whole", run_id="r", federation=fed)
    whole = results.load(tmp_path / "whole")
    cut = tmp_path / "cut"
    _cut(cfg, cut, fed, k)
    ck = checkpoint.load(cut, "r")
    engine, params = ck["engine"], ck["state"].params
    flight = engine["flight"]
    assert len(flight) >= 3 and engine["now"] > 0
    versions = {u["version"] for u in flight}
    assert min(versions) < k - 1  # stale updates in flight: trained on models older than the last step's
    # each version's downloaded model is stored once, however many updates downloaded it (here several did)
    assert set(engine["bases"]) == versions and len(flight) > len(versions)
    with np.load(checkpoint.path_for(cut, "r")) as z:
        model_sized = [z[n] for n in z.files if z[n].dtype == np.float32 and z[n].shape == params.shape]
    for v, base in engine["bases"].items():
        assert sum(np.array_equal(x, base) for x in model_sized) == 1, v
    for u in flight:  # a result's mask is its plan's mask object, as the client set it (messages.check_results)
        assert u["result"]["mask"] is u["plan"]["mask"] and u["plan"]["params"] == "base"
    if case.startswith("heterofl"):
        masks = [u["plan"]["mask"] for u in flight]
        assert len({id(m) for m in masks if m is not None}) > 1  # sub-models of several widths
        assert whole.clients.loc[whole.clients["round"] > k, "straggler"].any()  # a discard after the cut
    else:  # the step's instant still has arrivals queued: the freed slots start after them (dispatch_due False)
        assert engine["dispatch_due"] is False and sum(u["finish_s"] == engine["now"] for u in flight) >= 1
    assert (whole.clients["staleness_weight"].dropna() < 1).any()  # the staleness rule weighed some update
    aside = tmp_path / "cut-without-engine"
    shutil.copytree(cut, aside)

    outcome = run_experiment(cfg, cut, run_id="r", federation=fed, resume=True)
    assert outcome.status == "finished" and not checkpoint.path_for(cut, "r").exists()
    resumed = results.load(cut)
    _same_tables(resumed, whole)
    assert resumed.runs.loc[0, "rounds_done"] == cfg.training.rounds
    if case.endswith("timed"):  # the clock's schedule evaluated some steps, not all, on both sides of the cut
        evaluated = whole.rounds.drop_duplicates("round").set_index("round")["evaluated"]
        assert evaluated[evaluated.index <= k].any() and evaluated[evaluated.index > k].any() and not evaluated.all()

    # the engine's state is what makes it exact: resumed with a fresh engine (nothing in flight) the tables differ
    monkeypatch.setattr(AsyncServer, "load_state_dict", lambda self, tree, state, where: None)
    run_experiment(cfg, aside, run_id="r", federation=fed, resume=True)
    fresh = results.load(aside)
    after = fresh.clients["round"] > k
    assert not fresh.clients[after].reset_index(drop=True)[["client_id", "version_trained"]].equals(
        whole.clients[whole.clients["round"] > k].reset_index(drop=True)[["client_id", "version_trained"]])


class _Snapshot(Exception):
    """Raised from inside a step once the engine's state was taken (the test's interruption)."""


def test_the_engine_state_taken_mid_step_with_buffered_and_discarded_updates_continues_exactly(tmp_path, fed_cyclic):
    """A checkpoint is written after a step, when the buffer and the discarded list are empty and the next start
    draws afresh; the state holds them anyway, and this is what says they are stored right: the state taken inside
    a step (at the dispatch of freed slots, with arrivals buffered and one discarded, before a later selection draw
    of its version), passed through the checkpoint codec and loaded into a new session, continues to the
    uninterrupted tables. Loading it with ``dispatch_due`` set starts the step as the interrupted one was about to
    go on: by starting the freed slots (AsyncServer.round)."""
    cfg = _config(tmp_path, "heterofl-fedbuff", "asynchronous.concurrency=4", "asynchronous.max_staleness=1",
                  "training.rounds=8")
    run_experiment(cfg, tmp_path / "whole", run_id="r", federation=fed_cyclic)
    out = tmp_path / "cut"
    session = RunSession(cfg, out, "r", backend=LocalBackend("cpu", num_workers=1), federation=fed_cyclic)
    engine = session.engine
    assert engine is not None
    dispatch, taken = engine._dispatch, {}

    def snapshot_at_a_dispatch_with_buffered_and_discarded_updates(state: ServerState) -> None:
        # a later start on this version: its selection is drawn with the dispatch counter (AsyncServer._dispatch)
        if engine.buffer and engine.discarded and engine.dispatch_version == state.round and engine.dispatch_index:
            taken.update(tree=engine.state_dict(), round=state.round)
            raise _Snapshot
        dispatch(state)

    engine._dispatch = snapshot_at_a_dispatch_with_buffered_and_discarded_updates  # type: ignore[method-assign]
    session.start()
    with pytest.raises(_Snapshot):
        for t in range(1, cfg.training.rounds + 1):
            session.step(t)
    session.finish("interrupted")
    tree = taken["tree"]
    assert tree["buffer"] and tree["discarded"] and tree["flight"] and 1 <= taken["round"] < cfg.training.rounds
    encoded = treecodec.decode(*treecodec.encode({**tree, "dispatch_due": True}))

    resumed = RunSession(cfg, out, "r", backend=LocalBackend("cpu", num_workers=1), federation=fed_cyclic, resume=True)
    assert resumed.start() == taken["round"] and resumed.engine is not None and resumed.state is not None
    resumed.engine.load_state_dict(encoded, resumed.state, "test")  # the step before the one interrupted, its state
    assert [u.client_id for u in resumed.engine.buffer] == [u["client_id"] for u in tree["buffer"]]
    for t in range(taken["round"] + 1, cfg.training.rounds + 1):
        resumed.step(t)
    resumed.finish("finished")
    _same_tables(results.load(out), results.load(tmp_path / "whole"))


def test_plans_and_results_come_back_field_for_field_with_their_hook_payloads_and_shared_masks():
    """What an update in flight holds, through the checkpoint codec: every field of the same value and type (an
    np.float64 learning rate stays one), the hook payload rebuilt as its hook's Payload, the downloaded vector
    named (not stored) by the plans that share it, and one mask object for the plans of one width and their
    results (what the id-keyed deduplication in aggregation and coverage reads)."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal(40).astype(np.float32)
    mask = rng.random(40) < 0.5
    plans = [ClientPlan(client_id=c, round=3, params=base, mask=mask, local_epochs=2, batch_size=8, lr=np.float64(0.05),
                        seed=11 + c, capacity_used=0.5, hooks=(call(ProximalTerm, mu=0.01),), side_bytes_up=8)
             for c in (1, 2)]
    # a plan whose start mixes in a second shared vector (ClientPlan.overlay: FedSAP's Eq. 9) keeps it too
    plans[1] = dataclasses.replace(plans[1], overlay=StartOverlay(rng.standard_normal(40).astype(np.float32), rng.random(40) < 0.3))
    result = ClientResult(client_id=1, round=3, values=rng.standard_normal(int(mask.sum())).astype(np.float32),
                          n_samples=30, train_loss=0.7, stats={"norm": np.arange(3.0)}, steps=4, samples_seen=32,
                          gpu_id=None, mask=mask)
    tree = {"base": base, "plans": [plan_tree(p, base) for p in plans], "result": result_tree(result)}
    skeleton, arrays = treecodec.encode(tree)
    assert sum(a.shape == (40,) and a.dtype == np.float32 for a in arrays.values()) == 2  # the vector once, the overlay's
    assert sum(a.dtype == np.bool_ for a in arrays.values()) == 2  # the shared mask once, the overlay's
    back = treecodec.decode(skeleton, arrays)
    got = [plan_from_tree(t, back["base"]) for t in back["plans"]]
    res = result_from_tree(back["result"])
    assert got[0].params is got[1].params is back["base"] and got[0].mask is got[1].mask is res.mask
    for old, new in [*zip(plans, got), (result, res)]:
        for f in dataclasses.fields(old):
            a, b = getattr(old, f.name), getattr(new, f.name)
            assert type(a) is type(b), f.name
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b)
            elif f.name == "stats":
                assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
            elif f.name == "overlay" and a is not None:
                assert np.array_equal(a.values, b.values) and np.array_equal(a.where, b.where)
                assert new.values.tobytes() == old.values.tobytes()
            else:
                assert a == b, f.name
    assert got[0].payload(ProximalTerm).mu == 0.01 and type(got[0].hooks[0].payload) is ProximalTerm.Payload


#: The names an asynchronous checkpoint stores a plan under: ClientPlan's fields. Renaming one breaks the resume of
#: every checkpoint written before, unless messagetree reads the old name too (issue 54 kept them all).
PLAN_FIELDS = {"client_id", "round", "params", "mask", "local_epochs", "batch_size", "lr", "momentum", "weight_decay",
               "grad_clip", "max_steps_per_epoch", "seed", "submodel", "capacity_used", "hooks", "side_bytes_down",
               "side_bytes_up", "overlay"}


def test_a_checkpointed_plan_names_its_fields_never_a_class_so_a_renamed_class_still_reads():
    """A plan's start overlay is stored as its fields (``values``, ``where``) under the plan's field ``overlay``;
    no class name reaches the file, so renaming the class (``Overlay`` to ``StartOverlay``, issue 54) leaves
    checkpoints written before readable: the tree such a checkpoint holds, written out here by hand, loads."""
    rng = np.random.default_rng(1)
    base = rng.standard_normal(12).astype(np.float32)
    values, where = rng.standard_normal(12).astype(np.float32), rng.random(12) < 0.5
    plan = ClientPlan(client_id=0, round=2, params=base, mask=None, local_epochs=1, batch_size=4, lr=0.1,
                      overlay=StartOverlay(values, where))
    tree = plan_tree(plan, base)
    assert set(tree) == PLAN_FIELDS and set(tree["overlay"]) == {"values", "where"}
    skeleton, _ = treecodec.encode(tree)
    assert "Overlay" not in repr(skeleton)
    before = {**{k: v for k, v in tree.items() if k != "overlay"}, "overlay": {"values": values, "where": where}}
    got = plan_from_tree(before, base)
    assert type(got.overlay) is StartOverlay and np.array_equal(got.overlay.values, values)
    assert np.array_equal(got.overlay.where, where)


def _edit(out: Path, edit) -> None:
    """Rewrite run r's checkpoint in ``out`` with ``edit(ck)`` applied (to the loaded dict)."""
    ck = checkpoint.load(out, "r")
    edit(ck)
    st = ck["state"]
    checkpoint.save(out, "r", ServerState(st.round, st.params, st.strategy_state), ck["server"], tables=ck["tables"],
                    rows=ck.get("rows"), engine=ck.get("engine"))


def _set_flight(ck, field, value) -> None:
    ck["engine"]["flight"][0][field] = value


def _nan_in_a_base(ck) -> None:
    """A NaN in the model a version's clients downloaded (named as that field, not as the model's ``params``)."""
    bases = ck["engine"]["bases"]
    k = min(bases)
    bases[k] = np.where(np.arange(bases[k].size) == 0, np.float32("nan"), bases[k]).astype(np.float32)


@pytest.fixture(scope="module")
def cut4(tmp_path_factory, fed_cyclic):
    """HeteroFL-FedBuff for 4 steps, interrupted after step 2 (its config: the trace it names lives beside it); the
    tests below edit copies of the folder."""
    root = tmp_path_factory.mktemp("cut4")
    cfg = _config(root, "heterofl-fedbuff", "training.rounds=4")
    _cut(cfg, root / "cut", fed_cyclic, 2)
    return cfg, root / "cut"


def _copy(cut4, tmp_path: Path):
    cfg, folder = cut4
    shutil.copytree(folder, tmp_path / "cut")
    return cfg, tmp_path / "cut"


@pytest.mark.parametrize("edit, message", [
    (lambda ck: ck.pop("engine"), r"holds no asynchronous engine state .* start the run again"),
    (lambda ck: ck["engine"].update(version=2), r"engine is format 'fedbuff' version 2; this fedsap_ray reads 'fedbuff' version 1"),
    (lambda ck: _set_flight(ck, "version", 99), r"engine\.flight\[0\]\.version is 99; a version whose vector"),
    (lambda ck: _set_flight(ck, "finish_s", 1e9), r"engine\.flight\[0\] has start_s .* finish_s = start_s \+ sim_s"),
    (lambda ck: ck["engine"]["flight"][0]["result"].update(values=np.zeros(3, np.float32)),
     r"engine\.flight\[0\]: round \d+, client \d+ \(HeteroFL\): ClientResult\.values holds 3 values"),
    (lambda ck: ck["engine"]["flight"][0]["plan"]["hooks"].append(["no-such-hook", {}]),
     r"engine\.flight\[0\]: plan\.hooks\[0\] names the client hook 'no-such-hook'"),
    (lambda ck: ck["engine"]["flight"].append(ck["engine"]["flight"][0]), r"engine holds two updates of one client"),
    (lambda ck: _nan_in_a_base(ck), r"engine\.bases\[\d+\] holds 1 non-finite value\(s\)"),
], ids=["old-checkpoint", "other-version", "unknown-version", "times", "values", "hook", "twice", "base-nan"])
def test_a_checkpoint_without_the_engine_state_or_with_an_edited_one_is_refused_by_name(tmp_path, fed_cyclic, cut4,
                                                                                      edit, message):
    cfg, out = _copy(cut4, tmp_path)
    _edit(out, edit)
    before = sorted(p.relative_to(out) for p in out.rglob("*.parquet"))
    with pytest.raises(ConfigError, match=rf"invalid --resume='r': checkpoint .*r\.npz:? {message}"):
        run_experiment(cfg, out, run_id="r", federation=fed_cyclic, resume=True)
    assert sorted(p.relative_to(out) for p in out.rglob("*.parquet")) == before  # refused before anything changed


def test_a_synchronous_run_refuses_a_checkpoint_with_engine_state(tmp_path, fed_cyclic):
    cfg = build_config(preset="smoke", overrides=[*HETERO, "training.rounds=3"])
    out = tmp_path / "cut"
    _cut(cfg, out, fed_cyclic, 1)
    _edit(out, lambda ck: ck.update(engine={"format": "fedbuff"}))
    with pytest.raises(ConfigError, match=r"holds an asynchronous engine's state; this run has devices\.mode=sync"):
        run_experiment(cfg, out, run_id="r", federation=fed_cyclic, resume=True)


def _keeping_digest(out: Path, edit) -> None:
    """Run r's checkpoint in ``out`` with ``edit(tree)`` applied, written as the codec writes it but with the digest
    it carried before: a consistent edit whose author did not recompute the digest."""
    import json

    path = checkpoint.path_for(out, "r")
    with np.load(path) as z:
        meta = json.loads(z[treecodec.META].tobytes())
    header, tree = treecodec.read(path)
    edit(tree)
    skeleton, arrays = treecodec.encode(tree)
    text = json.dumps({**meta, "tree": skeleton}, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        np.savez(f, **{treecodec.META: np.frombuffer(text, np.uint8), **arrays})


def _shift_times(tree, by: float = 0.5) -> None:
    engine = tree["engine"]
    engine["now"] += by
    engine["last_step_s"] += by
    for u in engine["flight"]:
        u["start_s"] += by
        u["finish_s"] = u["start_s"] + u["sim_s"]


def _nudge_a_base(tree) -> None:
    bases = tree["engine"]["bases"]
    k = min(bases)
    bases[k] = bases[k] + np.float32(1e-3)


@pytest.mark.parametrize("edit", [lambda tree: tree["engine"]["flight"].pop(), _shift_times, _nudge_a_base],
                         ids=["a-client-in-flight-forgotten", "times-shifted", "a-stored-vector-nudged"])
def test_an_async_checkpoint_edited_consistently_without_its_digest_is_refused(tmp_path, fed_cyclic, cut4, edit):
    """Edits the engine's own checks accept (each keeps the state self-consistent) and that, before the digest,
    resumed silently to other tables: without the digest recomputed they are refused, naming the file."""
    cfg, out = _copy(cut4, tmp_path)
    _keeping_digest(out, edit)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"invalid --resume='r': checkpoint .*r\.npz was changed after the run wrote "
                                          r"it \(its content does not match its digest\)"):
        run_experiment(cfg, out, run_id="r", federation=fed_cyclic, resume=True)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
