"""FedSAP's stable masks in motion (docs/readings.md#stable-masks): on a generated federation where a
narrow client's utilities are noise around a true ordering, the stability rules keep the client's
channels while a channel clearly better for the federation still enters and a Dropped channel still
comes back; the smoothing starts where the docstring says; beta_ema = 0 reproduces today's selection;
end to end, the swap budget bounds every client's swaps and fixed masks stay fixed."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from fedsap_ray.algorithms.fedsap import budget, roles
from fedsap_ray.config import build_config
from fedsap_ray.algorithms.fedsap.tristate import DROPPED
from fedsap_ray.models import build_model
from conftest import assert_options_rejected, federation_fixture, run_rounds_with_records

TINY = ["data.num_clients=6", "data.max_test_per_domain=40", "model.width_mult=0.125", "training.local_epochs=1",
        "training.batch_size=16", "training.max_steps_per_epoch=2"]
# the DGA probe at 16 of a client's samples (the default, 256, is all of a tiny client's 80): the probe is half of a
# FedSAP client's work here, and these tests read masks, swaps and records, not how well the DGA recovers
# domains (test_fedsap_motion.py's probe test does, at its own 128)
PROBE16 = "algorithm.probe_samples=16"
fed = federation_fixture(TINY)


@pytest.fixture(scope="module")
def space():
    return build_model("resnet10", num_classes=10, input_shape=(3, 32, 32), width_mult=0.25).channel_space()  # laptop's network


def _counts(space, keep: float) -> np.ndarray:
    return budget.layer_channel_counts(keep, np.array([layer.channels for layer in space.layers]), adaptive=False)


# --- the selection rule at rest: what it reduces to ----------------------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=hst.integers(0, 10_000), keep=hst.sampled_from([0.2, 0.4, 0.6, 1.0]))
def test_without_margin_or_budget_the_stable_rule_is_top_k(space, seed, keep):
    rng = np.random.default_rng(seed)
    scores = rng.random(space.total_channels)  # continuous: no ties
    held = rng.random(space.total_channels) < 0.5
    counts = _counts(space, keep)
    np.testing.assert_array_equal(roles.stable_select(scores, held, counts, space),
                                  roles.select_active(scores, counts, space))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=hst.integers(0, 10_000), share=hst.sampled_from([0.05, 0.1, 0.3]), margin=hst.sampled_from([0.0, 0.1]))
def test_the_budget_bounds_the_new_channels_and_eq2_counts_hold(space, seed, share, margin):
    rng = np.random.default_rng(seed)
    counts = _counts(space, 0.4)
    held = roles.select_active(rng.random(space.total_channels), counts, space)
    scores = rng.random(space.total_channels)
    limit = roles.swap_limit(share, int(counts.sum()))
    active = roles.stable_select(scores, held, counts, space, margin=margin, max_swaps=limit)
    assert int((active & ~held).sum()) <= limit
    off = roles.layer_offsets(space)
    for i in range(len(space.layers)):
        assert active[off[i]:off[i + 1]].sum() == counts[i]  # Eq. 2's counts, not the rule, fix the sizes
    # the exchanges it made are the best ones: every entrant beats every channel it left out by score order
    entered, left = active & ~held, held & ~active
    if entered.any():
        unmade = roles.stable_select(scores, held, counts, space, margin=margin)  # the unbudgeted choice
        assert set(np.flatnonzero(entered)) <= set(np.flatnonzero(unmade & ~held))
        assert left.sum() == entered.sum()


def test_hysteresis_keeps_a_held_channel_unless_beaten_by_the_margin(space):
    counts = _counts(space, 0.5)
    off = roles.layer_offsets(space)
    held = roles.select_active(-np.arange(space.total_channels, dtype=float), counts, space)  # the first n_l
    scores = np.where(held, 0.5, 0.0)
    first_out = off[0] + int(counts[0])  # layer 0's best dropped channel
    scores[first_out] = 0.58  # beats the held channels, but by less than the margin
    active = roles.stable_select(scores, held, counts, space, margin=0.1)
    np.testing.assert_array_equal(active, held)
    scores[first_out] = 0.65  # now by more than the margin: it replaces exactly one held channel
    active = roles.stable_select(scores, held, counts, space, margin=0.1)
    assert active[first_out] and int((active & ~held).sum()) == 1


def test_swap_limit():
    assert roles.swap_limit(0.1, 96) == 9
    assert roles.swap_limit(0.1, 5) == 1  # at least one: a better channel can always enter
    assert roles.swap_limit(0.0, 96) == 0


# --- smoothing -------------------------------------------------------------------------------------------------
def test_smoothing_continues_held_channels_and_starts_new_ones_from_the_federation_estimate():
    prev = np.array([0.8, 0.4, 0.0, 0.0])
    prev_held = np.array([True, True, False, False])
    held = np.array([True, False, True, True])  # channel 1 left; 2 and 3 are new
    new = np.array([0.2, 0.0, 0.9, 0.6])
    estimate = np.array([0.5, 0.5, 0.7, np.nan])
    out = roles.smooth_utility(prev, prev_held, new, held, estimate, beta=0.5)
    assert out[0] == pytest.approx(0.5 * 0.8 + 0.5 * 0.2)  # its own EMA
    assert out[1] == 0.0  # not held: nothing measured
    assert out[2] == pytest.approx(0.5 * 0.7 + 0.5 * 0.9)  # new: from the estimate that brought it in
    assert out[3] == pytest.approx(0.6)  # new and never measured by anyone: its first observation
    np.testing.assert_array_equal(roles.smooth_utility(prev, prev_held, new, held, estimate, beta=0.0), new)
    np.testing.assert_array_equal(roles.smooth_utility(None, None, new, held, estimate, beta=0.5), new)


# --- a generated federation: a narrow client's utilities are noise around a true ordering ---------------------
def _simulate(space, *, rule: str, rounds: int = 30, sigma: float = 0.3, seed: int = 0, beta: float = 0.5,
              star_from: int | None = None):
    """One keep-0.2 client among a federation whose pooled estimate is accurate: each round the client measures
    its held channels as truth + N(0, sigma) noise; ``star_from``: from that round on, one channel the client
    does not hold becomes clearly best for the federation. Returns (per-round new-channel counts, masks)."""
    rng = np.random.default_rng(seed)
    n = space.total_channels
    truth = np.linspace(0.9, 0.4, n) + rng.normal(0, 0.02, n)
    counts = _counts(space, 0.2)
    held = roles.select_active(rng.random(n), counts, space)
    util = measured = None
    star = None
    new_counts, masks = [], [held.copy()]
    for t in range(rounds):
        truth_t = truth.copy()
        if star_from is not None and t >= star_from:
            if star is None:
                star = int(np.flatnonzero(~held)[-1])
            truth_t[star] = 1.5
        estimate = truth_t + rng.normal(0, 0.02, n)  # the federation's many clients: a good estimate
        u = np.where(held, truth_t + rng.normal(0, sigma, n), 0.0)
        util = roles.smooth_utility(util, measured, u, held, estimate, beta if rule != "raw" else 0.0)
        measured = held.copy()
        scores = roles.selection_scores(util, measured, estimate, space)
        if rule == "raw":
            nxt = roles.select_active(scores, counts, space)
        elif rule == "hysteresis":
            nxt = roles.stable_select(scores, held, counts, space, margin=0.3)
        else:
            nxt = roles.stable_select(scores, held, counts, space, max_swaps=roles.swap_limit(0.1, int(counts.sum())))
        new_counts.append(int((nxt & ~held).sum()))
        held = nxt
        masks.append(held.copy())
    return np.array(new_counts), masks, star, int(counts.sum())


def test_raw_selection_churns_a_noisy_narrow_client(space):
    """The defect the rules fix, reproduced: without them a noisy narrow client swaps a large share every round."""
    new, _, _, active = _simulate(space, rule="raw")
    assert new[5:].mean() / active > 0.15


@pytest.mark.parametrize("rule", ["hysteresis", "swap_budget"])
def test_stable_rules_keep_a_noisy_narrow_clients_channels(space, rule):
    new, _, _, active = _simulate(space, rule=rule)
    raw, _, _, _ = _simulate(space, rule="raw")
    assert new[5:].mean() < 0.5 * raw[5:].mean()
    if rule == "swap_budget":  # its stated share, every round
        assert (new <= roles.swap_limit(0.1, active)).all()


@pytest.mark.parametrize("rule", ["hysteresis", "swap_budget"])
def test_a_channel_clearly_better_for_the_federation_still_enters(space, rule):
    _, masks, star, _ = _simulate(space, rule=rule, star_from=10)
    assert not masks[10][star]  # the client did not hold it when it became best
    entered = [t for t in range(10, len(masks)) if masks[t][star]]
    assert entered and entered[0] <= 12  # within two rounds of selection
    assert all(m[star] for m in masks[entered[0]:])  # and it stays


@pytest.mark.parametrize("rule", ["hysteresis", "swap_budget"])
def test_dropped_channels_still_come_back_under_the_stable_rules(space, rule):
    _, masks, _, _ = _simulate(space, rule=rule, rounds=40)
    back = sum(int((~a & b).sum()) for a, b in zip(masks, masks[1:]))
    assert back > 0


# --- end to end through the strategy -----------------------------------------------------------------------------
def _states(fed, overrides, rounds=4):
    cfg = build_config(preset="smoke", overrides=TINY + ["algorithm.name=fedsap", PROBE16, f"training.rounds={rounds}",
                                                         *overrides])
    return run_rounds_with_records(cfg, fed, rounds)


def test_beta_zero_statistics_smoothing_reproduces_todays_selection(fed):
    _, _, today, _, _, _ = _states(fed, ["algorithm.beta_ema=0", "algorithm.smoothing=dispersion"])
    _, _, smooth, _, _, _ = _states(fed, ["algorithm.beta_ema=0", "algorithm.smoothing=statistics"])
    for a, b in zip(today, smooth):
        for cid in range(6):
            np.testing.assert_array_equal(a.strategy_state.states[cid], b.strategy_state.states[cid])
        np.testing.assert_array_equal(a.params, b.params)


def test_swap_budget_end_to_end_bounds_swaps_records_them_and_masks_still_move(fed):
    _, strat, states, plans, outs, records = _states(fed, ["algorithm.stability=swap_budget", "algorithm.swap_budget=0.1",
                                             "algorithm.smoothing=statistics"], rounds=5)
    moved = 0
    for t in range(1, 5):
        info = records[t - 1].rounds
        shares = []
        for cid in range(6):
            before, after = states[t - 1].strategy_state.states[cid], states[t].strategy_state.states[cid]
            new = int(((before == DROPPED) & (after != DROPPED)).sum())
            assert new <= roles.swap_limit(0.1, int((after != DROPPED).sum()))
            shares.append(new / (after != DROPPED).sum())
            moved += new
        assert info["swap_share"] == pytest.approx(np.mean(shares))
        # the clients column of round t+1: its active channels not active in the mask the client last trained
        # under (every client trains every round here: round t's)
        assert set(records[t].clients) == set(plans[t]) == set(range(6))
        for cid, row in records[t].clients.items():
            trained, now = states[t - 1].strategy_state.states[cid] != DROPPED, states[t].strategy_state.states[cid] != DROPPED
            assert row["n_new_channels"] == int((now & ~trained).sum())
    assert moved > 0  # masks still move under the budget
    assert all(r["n_new_channels"] is None for r in records[0].clients.values())  # first round: nothing trained before


def test_fixed_masks_stay_fixed_with_the_stable_options(fed):
    _, _, states, _, _, records = _states(fed, ["algorithm.masks=fixed", "algorithm.warmup=1",
                                                 "algorithm.smoothing=statistics", "algorithm.stability=hysteresis"])
    for s, rec in zip(states[2:], records[1:]):
        for cid in range(6):
            np.testing.assert_array_equal(s.strategy_state.states[cid], states[1].strategy_state.states[cid])
        assert rec.rounds["swap_share"] == 0.0


def test_pooled_ranking_gives_equal_clients_nested_masks(fed):
    """One shared ranking: two clients with the same layer counts hold the same channels."""
    _, _, states, _, _, _ = _states(fed, ["algorithm.ranking=pooled", "algorithm.adaptive_layer_budget=0"])
    ex = states[-1].strategy_state
    caps = {}
    for c in fed.clients:
        caps.setdefault(c.capacity, []).append(c.client_id)
    same = [ids for ids in caps.values() if len(ids) > 1]
    assert same
    for ids in same:
        for other in ids[1:]:
            np.testing.assert_array_equal(ex.states[ids[0]] != DROPPED, ex.states[other] != DROPPED)


def test_bad_stability_options_are_refused():
    assert_options_rejected(["algorithm.name=fedsap"], "algorithm.stability=sticky", "algorithm.smoothing=all",
                            "algorithm.ranking=global", "algorithm.swap_budget=0", "algorithm.swap_budget=1.5",
                            "algorithm.margin=-0.1")
