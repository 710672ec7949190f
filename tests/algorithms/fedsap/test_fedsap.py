"""FedSAP on hand-built tiny cases: Eq. 2, clip bounds, g_target floor, type-matched aggregation
(Eq. 8), the FedAvg special case, fixed masks, and the records a user reads."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fedsap_ray import results
from fedsap_ray.algorithms.fedsap import budget, roles
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.experiment import run_experiment
from fedsap_ray.algorithms.fedsap.tristate import DROPPED, GLOBAL, PRIVATE
from fedsap_ray.common.messages import ClientResult
from conftest import aggregate, make_strategy, run_rounds, run_rounds_with_plans, steady

TINY = ["data.num_clients=6", "data.max_test_per_domain=40", "model.width_mult=0.125", "training.local_epochs=1",
        "training.batch_size=16", "training.max_steps_per_epoch=2"]
# the DGA probe at 16 of a client's samples (the default, 256, is all of a tiny client's 80): the probe is half of a
# FedSAP client's work here, and these tests read masks, roles, swaps and records, not how well the DGA recovers
# domains (test_fedsap_motion.py's probe test does, at its own 128)
PROBE16 = "algorithm.probe_samples=16"


@pytest.fixture(scope="module")
def fed():
    return build_federation(build_config(preset="smoke", overrides=TINY))


_strategy, _loop = make_strategy, run_rounds


# --- Eq. 2 and the clip bounds -------------------------------------------------------------
@pytest.mark.parametrize("kappa", [0.2, 0.4, 0.6, 0.8, 1.0, 0.33, 0.1])
def test_layer_budget_eq2_within_one_channel_and_clip_bounds(kappa):
    rng = np.random.default_rng(0)
    channels = np.array([8, 8, 16, 16, 32, 32, 64, 64, 3])
    for _ in range(50):
        counts = budget.layer_channel_counts(kappa, channels, rng.random(len(channels)) * 3)
        assert budget.budget_error_channels(counts, channels, kappa) <= 1.0
        lo, hi = budget.clip_bounds(kappa)
        k = counts / channels
        assert (k >= lo - 1e-12).all() and (k <= hi + 1e-12).all()
    uniform = budget.layer_channel_counts(kappa, channels, adaptive=False)
    assert budget.budget_error_channels(uniform, channels, kappa) <= 1.0


def test_infeasible_budget_takes_the_nearest_feasible_total():
    channels = np.array([8, 8, 16, 16, 32, 32, 64, 64, 3])  # kappa=0.05: every layer keeps >= 1 channel
    counts = budget.layer_channel_counts(0.05, channels, np.ones(len(channels)))
    lo, _ = budget.clip_bounds(0.05)
    np.testing.assert_array_equal(counts, np.maximum(1, np.ceil(lo * channels)))


def test_adaptive_budget_favours_high_utility_layers():
    channels = np.array([32, 32, 32, 32])
    counts = budget.layer_channel_counts(0.5, channels, np.array([0.0, 0.0, 1.0, 1.0]))
    assert counts[2] > counts[0] and counts.sum() == 64


# --- roles: SGP and the g_target floor --------------------------------------------------------
def test_roles_threshold_and_g_target_floor():
    from fedsap_ray.models import build_model

    space = build_model("cnn_small", num_classes=10, input_shape=(3, 32, 32), width_mult=0.125).channel_space()
    n = space.total_channels
    active = np.zeros(n, bool)
    active[: n // 2] = True
    d = np.linspace(0, 1, n)  # later channels are more domain-sensitive
    st = roles.assign_roles(active, d, space, tau_var=0.05, g_target=0.0)
    assert ((st == PRIVATE) == (active & (d > 0.05))).all() and ((st == DROPPED) == ~active).all()
    for g in (0.5, 0.9, 1.0):
        st = roles.assign_roles(active, d, space, tau_var=0.05, g_target=g)
        for seg in roles.split(st, space).values():
            act = (seg != DROPPED).sum()
            assert (seg == GLOBAL).sum() >= math.ceil(g * act - 1e-9)
        # within each layer the Global channels are the most stable active ones (promotion by d~)
        for seg_st, seg_d in zip(roles.split(st, space).values(), roles.split(d, space).values()):
            if (seg_st == GLOBAL).any() and (seg_st == PRIVATE).any():
                assert seg_d[seg_st == GLOBAL].max() <= seg_d[seg_st == PRIVATE].min()
    assert (roles.assign_roles(active, d, space, tau_var=0.0, g_target=0.0, sgp=False)[active] == GLOBAL).all()


def test_dispersion_hand_computed():
    act = [np.array([1.0, 2.0]), np.array([3.0, 2.0]), np.array([5.0, 2.0])]
    on = [np.array([True, True])] * 3
    d = roles.dispersion(act, on, np.array([0, 0, 1]), eps=0.0)
    # channel 0: group means 2 and 5 -> var 2.25, mean 3.5 -> 2.25 / 12.25
    assert d[0] == pytest.approx(2.25 / 12.25) and d[1] == 0.0
    assert (roles.dispersion(act, on, np.array([0, 0, 0])) == 0).all()  # one group: no evidence


# --- type-matched aggregation (Eq. 8) -----------------------------------------------------------
def test_type_matched_aggregation_hand_built(fed):
    cfg = build_config(preset="smoke", overrides=TINY + ["algorithm.name=fedsap", "algorithm.regroup_every=100"])
    ctx, strat = _strategy(cfg, fed)
    assert not strat.is_dga_round(5)  # no regrouping: the private sets are Eq. 8's result
    state = strat.init_state()
    n = ctx.space.total_channels
    rng = np.random.default_rng(3)
    sts = {}
    for cid in range(3):
        st = rng.choice([GLOBAL, PRIVATE, DROPPED], size=n, p=[0.5, 0.3, 0.2]).astype(np.int8)
        sts[cid] = st
    state.strategy_state.states = {**state.strategy_state.states, **sts}
    state.strategy_state.groups = np.array([0, 0, 1, 1, 1, 1])
    state.strategy_state.private = {0: state.params + 1.0, 1: state.params + 2.0}
    state.strategy_state.stamp_p = {k: np.zeros(state.params.size, np.int32) for k in (0, 1)}  # never aggregated
    weights = {0: 10, 1: 30, 2: 20}
    res, full = [], {}
    for cid in range(3):
        g, p = strat._masks(sts[cid])
        full[cid] = rng.normal(size=ctx.layout.size).astype(np.float32)
        res.append(ClientResult(client_id=cid, round=5, values=full[cid][g | p], n_samples=weights[cid], train_loss=0.0, mask=g | p,
                                stats={"channel_activation": np.ones(n, np.float32), "channel_gradient": np.ones(n, np.float32)}))
    old = state.params.copy()
    old_priv = {k: v.copy() for k, v in state.strategy_state.private.items()}
    new = aggregate(strat, state, res, 5).state
    G = {c: strat._masks(sts[c])[0] for c in range(3)}
    P = {c: strat._masks(sts[c])[1] for c in range(3)}
    # Global: sample-weighted mean over exactly the clients holding the coordinate as Global
    wsum = sum(weights[c] * G[c] for c in range(3))
    acc = sum(weights[c] * G[c] * full[c].astype(np.float64) for c in range(3))
    covered = wsum > 0
    np.testing.assert_allclose(new.params[covered], (acc[covered] / wsum[covered]).astype(np.float32), rtol=1e-6)
    assert new.params[~covered].tobytes() == old[~covered].tobytes()  # nobody trained: bit-identical
    # Private of group 0 (clients 0, 1) only; group 1 (client 2) only
    for k, members in ((0, [0, 1]), (1, [2])):
        ws = sum(weights[c] * P[c] for c in members)
        ac = sum(weights[c] * P[c] * full[c].astype(np.float64) for c in members)
        cov = ws > 0
        np.testing.assert_allclose(new.strategy_state.private[k][cov], (ac[cov] / ws[cov]).astype(np.float32), rtol=1e-6)
        assert new.strategy_state.private[k][~cov].tobytes() == old_priv[k][~cov].tobytes()


def test_all_global_single_group_equals_fedavg(fed):
    common = TINY + ["capacity.scheme=full", "training.rounds=3"]
    sap = build_config(preset="smoke", overrides=common + [
        "algorithm.name=fedsap", PROBE16, "algorithm.sgp=false", "algorithm.adaptive_layer_budget=0", "algorithm.gamma=0",
        "algorithm.tau_sim=-1"])
    avg = build_config(preset="smoke", overrides=common + ["algorithm.name=fedavg"])
    f = build_federation(avg)
    _, _, s1 = _loop(sap, f, 3)
    _, _, s2 = _loop(avg, f, 3)
    np.testing.assert_array_equal(s1[-1].params, s2[-1].params)
    assert (s1[-1].strategy_state.groups == 0).all()


def test_without_sgp_the_grouping_changes_no_number_with_sgp_it_does(fed):
    """The ablation's reading (sweeps/ablation.py, docs/readings.md#without-sgp): with sgp=false every active channel is
    Global, so pseudo-groups route nothing and dga=gradient / dga=none give bit-identical models; with SGP
    on (Private channels exist at g_target 0.5) the grouping changes the model."""
    def final(*extra):
        cfg = build_config(preset="smoke", overrides=TINY + ["algorithm.name=fedsap", PROBE16, "training.rounds=3",
                                                             "algorithm.g_target=0.5", "algorithm.tau_var=0",
                                                             *extra])
        _, _, states = _loop(cfg, fed, 3)
        return states[-1]

    no_sgp = final("algorithm.sgp=false")
    np.testing.assert_array_equal(no_sgp.params, final("algorithm.sgp=false", "algorithm.dga=none").params)
    assert not any((st == PRIVATE).any() for st in no_sgp.strategy_state.states.values())
    grouped, alone = final("algorithm.dga=oracle"), final("algorithm.dga=none")  # domains vs. one group per client
    assert any((st == PRIVATE).any() for st in grouped.strategy_state.states.values())
    assert len(set(grouped.strategy_state.groups)) < len(alone.strategy_state.groups)  # DGA merged some clients
    assert not np.array_equal(grouped.params, alone.params)


def test_without_dga_a_private_vector_exists_only_for_clients_that_trained_one(fed):
    """dga=none puts each client in its own group; its Private vector (and its stamps) is made when the client
    first aggregates Private coordinates, so the state grows with the clients that trained, not the federation
    (made up front for every client, it cost N x P floats: 10.6 GB at 100,000 clients, issue 29)."""
    cfg = build_config(preset="smoke", overrides=TINY + ["algorithm.name=fedsap", "algorithm.dga=none",
                                                         "algorithm.g_target=0.5", "algorithm.tau_var=0",
                                                         "algorithm.warmup=1", "training.participation=0.5",
                                                         "training.rounds=3"])
    _, _, states, plans, _ = run_rounds_with_plans(cfg, fed, 3)
    assert not states[0].strategy_state.private and not states[0].strategy_state.stamp_p
    expected: set[int] = set()
    for t in range(1, 4):
        masks = states[t - 1].strategy_state.states  # what round t's clients trained under
        expected |= {c for c in plans[t - 1] if (masks[c] == PRIVATE).any()}
        st = states[t].strategy_state
        assert set(st.private) == set(st.stamp_p) == expected, t
    assert expected  # Private channels did train (after the warm-up round)


def test_fixed_masks_do_not_change_after_warmup(fed):
    cfg = build_config(preset="smoke", overrides=TINY + ["algorithm.name=fedsap_fixed", PROBE16, "algorithm.warmup=1",
                                                         "training.rounds=4"])
    _, _, states = _loop(cfg, fed, 4)
    after = [s.strategy_state.states for s in states[1:]]  # masks for rounds 2..5
    for later in after[1:]:
        for cid in later:
            np.testing.assert_array_equal(later[cid], after[0][cid])
    dyn = build_config(preset="smoke", overrides=TINY + ["algorithm.name=fedsap", PROBE16, "training.rounds=4"])
    _, _, dstates = _loop(dyn, fed, 4)
    changed = any(not np.array_equal(dstates[2].strategy_state.states[c], dstates[4].strategy_state.states[c]) for c in range(6))
    assert changed  # dynamic masks do move


# --- a smoke run end to end: what a user reads --------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory, fed):
    out = tmp_path_factory.mktemp("fedsap")
    cfg = build_config(preset="smoke", overrides=TINY + [PROBE16, "training.rounds=4"])
    assert cfg.algorithm.name == "fedsap"  # the default algorithm
    run_experiment(cfg, out, run_id="r", federation=fed)  # also the uninterrupted run a resume must equal
    return cfg, results.load(out)


def test_smoke_exercises_every_mechanism_and_records_it(smoke, fed):
    cfg, res = smoke
    o = cfg.algorithm.options
    assert o["warmup"] < cfg.training.rounds
    dga_rows = res.rounds.dropna(subset=["n_groups"]).drop_duplicates("round")
    assert len(dga_rows) >= 2  # at least two DGA regroupings
    assert dga_rows["ari_domain"].between(-1, 1).all() and dga_rows["ari_capacity"].between(-1, 1).all()
    assert set(res.rounds["eval_mode"].dropna()) == {"group", "global_only", "deployed"}
    c = res.clients
    assert c["pseudo_group"].notna().all()
    assert ((c["n_global"] + c["n_private"] + c["n_dropped"]) > 0).all()
    assert (c.loc[c["round"] > o["warmup"], "n_private"] >= 0).all()
    lay = res.layers
    assert set(lay.columns) >= {"run_id", "round", "client_id", "layer", "channels", "keep_ratio", "n_global",
                                "n_private", "n_dropped"}
    # Eq. 2 within one channel and clip bounds, every client and round
    cap = {cl.client_id: cl.capacity for cl in fed.clients}
    for (_, cid), g in lay.groupby(["round", "client_id"]):
        kappa = cap[cid]
        active = (g["n_global"] + g["n_private"]).sum()
        assert abs(active - kappa * g["channels"].sum()) <= 1.0
        if kappa < 1:
            lo, hi = budget.clip_bounds(kappa)
            assert (g["keep_ratio"] >= lo - 1e-9).all() and (g["keep_ratio"] <= hi + 1e-9).all()
        # g_target floor per layer
        act = g["n_global"] + g["n_private"]
        assert (g["n_global"] >= np.ceil(o.get("g_target", 0.9) * act - 1e-9)).all()
    # the dynamic masks changed between rounds: Dropped channels came back (the rounds table counts them)
    motion = res.rounds.drop_duplicates("round").set_index("round")
    assert motion.loc[motion.index < cfg.training.rounds, "n_reactivated"].sum() > 0


def test_bad_fedsap_options_are_rejected():
    from fedsap_ray.config import ConfigError

    for bad, needle in (("algorithm.dga=magic", "gradient, none, oracle, random"),
                        ("algorithm.masks=sometimes", "dynamic, fixed"),
                        ("algorithm.dga_layer=layer9", "conv1, layer1, layer2, layer3"),
                        ("algorithm.g_target=2", "[0, 1]")):
        with pytest.raises(ConfigError, match="algorithm."):
            try:
                build_config(preset="smoke", overrides=[bad])
            except ConfigError as e:
                assert needle in str(e)
                raise


def test_resumed_fedsap_run_equals_uninterrupted(tmp_path, fed, smoke):
    """Every eval mode's best-so-far and FedSAP's state survive a checkpoint (the run never stopped: ``smoke``, the
    same config, run id and federation)."""
    cfg = build_config(preset="smoke", overrides=TINY + [PROBE16, "training.rounds=4"])
    assert cfg == smoke[0]

    def stop_after_round_2(summary):
        if summary.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", run_id="r", federation=fed, progress=stop_after_round_2)
    from fedsap_ray.persist import checkpoint

    saved = checkpoint.load(tmp_path / "cut", "r")["server"]["best_by_mode"]
    g = results.load(tmp_path / "cut").rounds
    g = g[g.domain == "__global__"]
    assert saved == g.groupby("eval_mode")["accuracy"].max().to_dict()  # every mode's best, not just the primary
    run_experiment(cfg, tmp_path / "cut", run_id="r", federation=fed, resume=True)
    a, b = results.load(tmp_path / "cut"), smoke[1]
    for table in ("rounds", "clients", "layers"):
        left, right = steady(a[table]), steady(b[table])
        assert left.equals(right), table
