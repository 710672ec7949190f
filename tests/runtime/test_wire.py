"""What a round's plans weigh on the wire (fedsap_ray.runtime.wire, issue 42): each worker receives one copy of
each distinct vector and packed mask of its share plus the plans' own small parts, and gets the plans back
exactly; a round is shared longest first."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedsap_ray.algorithms.hooks import HookCall
from fedsap_ray.common.messages import ClientPlan
from fedsap_ray.runtime import wire

P = 200_003  # odd, so a packed mask has a partial last byte


def _plans(n: int = 20) -> tuple[list[ClientPlan], np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    server = rng.normal(size=P).astype(np.float32)
    group = rng.normal(size=P).astype(np.float32)  # a second vector (a group's view)
    masks = [np.arange(P) < P // k for k in (2, 3, 4)]  # three widths, shared by their clients
    plans = []
    for cid in range(n):
        mask = None if cid % 4 == 0 else masks[cid % 3]
        plans.append(ClientPlan(client_id=cid, round=3, params=group if cid == 7 else server, mask=mask,
                                local_epochs=1, batch_size=8, lr=0.1, seed=cid,
                                hooks=(HookCall("x", {"own": np.full(5, cid, np.float32)}),)))
    return plans, server, masks


def _old_bytes(p: ClientPlan) -> int:
    """What one plan weighed before batches: its own copy of the covered values and a full bool mask."""
    return 4 * p.covered + (0 if p.mask is None else p.mask.size)


def test_a_batch_carries_each_distinct_vector_and_mask_once_and_gives_the_plans_back():
    plans, server, masks = _plans()
    shared = wire.RoundArrays()
    shares = wire.longest_first(plans, [float(p.covered) for p in plans], 2)
    batches = [wire.pack(s, shared) for s in shares]
    assert len(shared.arrays) == 2 + 3  # two vectors, three masks: each registered once for the whole round
    for batch, share in zip(batches, shares):
        got = batch.plans([shared.arrays[k] for k in batch.keys])
        assert [p.client_id for p in got] == [p.client_id for p in share]
        for a, b in zip(got, share):
            assert a.params.tobytes() == b.params.tobytes()
            assert (a.mask is None) == (b.mask is None) and (a.mask is None or np.array_equal(a.mask, b.mask))
            assert a.values.tobytes() == b.values.tobytes()
            plain = [f.name for f in dataclasses.fields(ClientPlan) if f.name not in ("params", "mask", "hooks")]
            assert [getattr(a, f) for f in plain] == [getattr(b, f) for f in plain]
            assert a.hooks[0].name == b.hooks[0].name
            assert np.array_equal(a.hooks[0].payload["own"], b.hooks[0].payload["own"])
        # what the worker receives: one copy of each distinct vector and packed mask it uses, plus small parts
        vectors = {id(p.params): p.params.nbytes for p in share}
        packed = {id(p.mask): (P + 7) // 8 for p in share if p.mask is not None}
        own = sum(wire.payload_bytes(p.hooks) for p in share)
        received = wire.batch_bytes(batch, shared)
        assert received <= sum(vectors.values()) + sum(packed.values()) + own + 1024 * len(share)
        assert received < sum(_old_bytes(p) for p in share) / 3  # 10 plans: 10 copies before, 1-2 now


def test_payload_bytes_counts_numpy_buffers_without_copying_them():
    arr = np.zeros(1_000_000, np.float32)
    n = wire.payload_bytes({"a": arr, "b": arr[:10]})
    assert arr.nbytes + 40 <= n <= arr.nbytes + 40 + 1024


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_longest_first_balances_and_is_deterministic(workers):
    plans, _, _ = _plans(23)
    work = [float((p.client_id * 7919) % 13 + 1) for p in plans]
    shares = wire.longest_first(plans, work, workers)
    assert sorted(p.client_id for s in shares for p in s) == list(range(23))
    load = [sum(work[p.client_id] for p in s) for s in shares]
    # Graham's bound for longest-processing-time-first: the busiest worker ends within max(work) of the mean
    assert max(load) <= sum(work) / workers + max(work)
    for s in shares:  # each worker's clients in dispatch order: longest first
        ws = [work[p.client_id] for p in s]
        assert ws == sorted(ws, reverse=True)
    assert [[p.client_id for p in s] for s in shares] == [[p.client_id for p in s]
                                                           for s in wire.longest_first(plans, work, workers)]


def test_a_result_travels_back_without_its_plans_mask_and_with_a_hooks_own_packed():
    """A result's coordinates (ClientResult.mask, messages.py) on the way back: the plan's own mask object becomes
    a marker and is restored as that very object; a mask a hook chose travels packed and comes back equal."""
    from fedsap_ray.common.messages import ClientResult

    plans, _, masks = _plans(4)
    plan = plans[1]  # masked
    same = ClientResult(client_id=1, round=3, values=plan.values.copy(), n_samples=4, train_loss=0.5, mask=plan.mask)
    back = wire.restore_result(wire.strip_result(same, plan), plan)
    assert back.mask is plan.mask
    chosen = np.random.default_rng(5).random(P) < 0.4
    own = ClientResult(client_id=1, round=3, values=np.zeros(int(chosen.sum()), np.float32), n_samples=4,
                       train_loss=0.5, mask=chosen.copy())
    sent = wire.strip_result(own, plan)
    assert sent.mask.nbytes == (P + 7) // 8
    assert np.array_equal(wire.restore_result(sent, plan).mask, chosen)
    full = ClientResult(client_id=0, round=3, values=plans[0].values, n_samples=4, train_loss=0.5, mask=None)
    assert wire.restore_result(wire.strip_result(full, plans[0]), plans[0]).mask is None


def test_a_share_is_cut_into_pieces_by_the_bytes_its_results_send_back():
    plans, _, _ = _plans(10)  # 4 full plans of P coordinates, 6 masked (P/2 .. P/4)
    back = sum(4 * p.covered for p in plans)
    assert wire.pieces(plans, 4, back + 1) == [plans]  # little to send back: one call
    cut = wire.pieces(plans, 4, back // 3)  # about three pieces' worth
    assert len(cut) == 4 or len(cut) == 3
    assert [p for piece in cut for p in piece] == plans  # consecutive, nothing lost or repeated
    assert len(wire.pieces(plans, 4, 1)) == 4 and len(wire.pieces(plans[:2], 4, 1)) == 2  # at most `most`, one plan each
    assert wire.pieces([], 4, 1) == []


def test_pieces_of_one_worker_count_each_shared_array_once():
    """The Ray pool's count across a worker's pieces: an array the worker already holds this round is not
    counted again (batch_bytes with ``held``)."""
    plans, server, _ = _plans(8)
    shared = wire.RoundArrays()
    first, second = wire.pack(plans[:4], shared), wire.pack(plans[4:], shared)
    held: set[int] = set()
    a, b = wire.batch_bytes(first, shared, held), wire.batch_bytes(second, shared, held)
    assert a == wire.batch_bytes(first, shared)  # nothing held before the first piece
    assert b < wire.batch_bytes(second, shared) - server.nbytes + 1  # the server vector is not sent again
    assert held == set(first.keys) | set(second.keys)


# --- FedSAP's plans: W_G and each group's Private vector once, the client's mix as its own bits ----------------
FEDSAP = ["algorithm.name=fedsap", "data.num_clients=6", "data.max_test_per_domain=40", "model.width_mult=0.125",
          "training.local_epochs=1", "training.max_steps_per_epoch=2"]


def test_fedsaps_plans_name_shared_vectors_and_carry_only_their_own_mix():
    """Eq. 9's W_i = W_G overlaid with the group's Private vector by the client's own mask (ClientPlan.overlay):
    after warm-up the plans start from exactly client_view's W_i, a worker receives W_G and each Private vector
    of its share once (no per-client copy of W_i), and the batch gives the plans back exactly."""
    from fedsap_ray.algorithms.fedsap.state import client_view
    from fedsap_ray.config import build_config
    from fedsap_ray.data import build_federation
    from conftest import run_rounds

    cfg = build_config(preset="smoke", overrides=FEDSAP)
    fed = build_federation(cfg)
    ctx, strat, states = run_rounds(cfg, fed, 1)  # after round 1 of this federation, three clients hold Private channels
    state = states[-1]
    plans = strat.configure_round(state, 2)
    private = state.strategy_state.private
    with_overlay = [p for p in plans.values() if p.overlay is not None]
    assert private and with_overlay, "the test needs groups with Private vectors and clients that read them"
    for p in plans.values():
        eq9, _, take = client_view(state, p.client_id, strat._masks)
        assert p.params is state.params  # W_G itself, never a copy
        assert p.values.tobytes() == eq9[p.mask].tobytes()  # the client starts from Eq. 9's W_i exactly
        if p.overlay is not None:
            assert any(p.overlay.values is v for v in private.values()) and np.array_equal(p.overlay.where, take)
    shared = wire.RoundArrays()
    share = list(plans.values())
    batch = wire.pack(share, shared)
    vectors = {id(p.params): p.params.nbytes for p in share} | {id(p.overlay.values): p.overlay.values.nbytes
                                                               for p in with_overlay}
    assert len(vectors) <= 1 + len(private)
    packed = sum((state.params.size + 7) // 8 for _ in range(len(share) + len(with_overlay)))  # masks, at most
    own = sum(wire.payload_bytes(p.hooks) for p in share)
    received = wire.batch_bytes(batch, shared)
    assert received <= sum(vectors.values()) + packed + own + 2048 * len(share)
    assert received < sum(state.params.nbytes for _ in share)  # less than one W_i copy per client
    for a, b in zip(batch.plans([shared.arrays[k] for k in batch.keys]), share):
        assert a.values.tobytes() == b.values.tobytes() and a.start_vector().tobytes() == b.start_vector().tobytes()
        assert (a.overlay is None) == (b.overlay is None)
