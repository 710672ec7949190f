"""Partitions, capacities, ground-truth TV and build_federation (docs/guides/data.md#partitions-and-capacities)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from fedsap_ray.config import CapacityConfig, ConfigError, DataConfig, ExperimentConfig
from fedsap_ray.data import ClientSpec, DomainData, Federation, build_federation, embedded, load_splits
from fedsap_ray.data.capacity import assign_capacities, tier_counts
from fedsap_ray.data.federation import _cap_splits
from fedsap_ray.data.partition import (
    as_rng,
    assign_domains,
    dirichlet_label_skew,
    domain_protocol,
    iid_split,
    label_counts,
    natural_partition,
    office_split,
    tv_distance,
)
from fedsap_ray.data.registry import DomainSplits, get_source


def _same(a: list, b: list) -> bool:
    def arr(p):
        return p[1] if isinstance(p, tuple) else p
    return len(a) == len(b) and all(np.array_equal(arr(x), arr(y)) for x, y in zip(a, b)) and all(
        x[0] == y[0] for x, y in zip(a, b) if isinstance(x, tuple))


# ---------------------------------------------------------------------------- domain protocol
SIZES = {"a": 1000, "b": 200, "c": 50}


def test_domain_protocol_sizes_order_and_disjointness():
    parts = domain_protocol(SIZES, 7, 0.05, rng=3)
    assert [d for d, _ in parts[:3]] == ["a", "b", "c"]  # one client per domain first, in order
    want = {"a": 50, "b": 10, "c": 3}  # round_half_up(0.05 * 50 = 2.5) = 3
    for d, idx in parts:
        assert idx.dtype == np.int64 and len(idx) == want[d]
        assert idx.min() >= 0 and idx.max() < SIZES[d] and len(np.unique(idx)) == len(idx)
    for d in SIZES:
        all_idx = np.concatenate([idx for dd, idx in parts if dd == d])
        assert len(np.unique(all_idx)) == len(all_idx)  # disjoint within a domain


def test_domain_protocol_seeded():
    assert _same(domain_protocol(SIZES, 10, 0.02, rng=1), domain_protocol(SIZES, 10, 0.02, rng=1))
    runs = [domain_protocol(SIZES, 10, 0.02, rng=s) for s in range(4)]
    assert not all(_same(runs[0], r) for r in runs[1:])
    # a Generator argument is used as given
    g1, g2 = np.random.default_rng(9), np.random.default_rng(9)
    assert _same(domain_protocol(SIZES, 10, 0.02, g1), domain_protocol(SIZES, 10, 0.02, g2))


def test_assign_domains_uniform_extras():
    doms = assign_domains(["a", "b", "c", "d"], 4004, rng=0)
    assert doms[:4] == ["a", "b", "c", "d"]
    counts = np.array([doms[4:].count(d) for d in "abcd"])
    assert counts.sum() == 4000 and np.all(np.abs(counts - 1000) < 100)  # ~4.7 sigma


def test_domain_protocol_errors():
    with pytest.raises(ValueError, match=r"client_fraction=0\.3"):
        domain_protocol({"a": 10}, 5, 0.3, rng=0)  # 5 clients x 3 > 10
    with pytest.raises(ValueError, match="every domain needs a client"):
        domain_protocol(SIZES, 2, 0.01, rng=0)
    assert [len(i) for _, i in domain_protocol({"a": 100}, 3, 1e-4, rng=0)] == [1, 1, 1]  # at least one
    with pytest.raises(TypeError):
        domain_protocol(SIZES, 4, 0.01, rng="seed")


def test_office_split():
    tr, te = office_split(25)
    assert te.tolist() == [8, 9, 18, 19]
    assert tr.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 24]


# ---------------------------------------------------------------------------- dirichlet / iid / natural
LABELS = np.repeat(np.arange(10), 100)


def test_dirichlet_covers_every_index_once_and_honours_min_samples():
    # the first draw for this seed leaves some client below 25 (only ~11% of draws pass), so a redraw is needed
    assert min(len(p) for p in dirichlet_label_skew(LABELS, 20, alpha=0.5, rng=5, min_samples=1)) < 25
    parts = dirichlet_label_skew(LABELS, 20, alpha=0.5, rng=5, min_samples=25)
    allidx = np.concatenate(parts)
    assert np.array_equal(np.sort(allidx), np.arange(len(LABELS)))
    assert min(len(p) for p in parts) >= 25
    assert _same(parts, dirichlet_label_skew(LABELS, 20, alpha=0.5, rng=5, min_samples=25))
    assert not _same(parts, dirichlet_label_skew(LABELS, 20, alpha=0.5, rng=6, min_samples=25))


def test_dirichlet_alpha_controls_skew():
    glob = label_counts(LABELS, 10)

    def mean_tv(alpha: float) -> float:
        parts = dirichlet_label_skew(LABELS, 10, alpha, rng=0, min_samples=1)
        return float(np.mean([tv_distance(label_counts(LABELS[p], 10), glob) for p in parts]))

    assert mean_tv(0.1) > 0.5 > 0.15 > mean_tv(100.0)


def test_dirichlet_impossible_is_a_clear_error():
    with pytest.raises(ValueError, match="min_samples"):
        dirichlet_label_skew(LABELS, 20, 0.3, rng=0, min_samples=60)  # 20 x 60 > 1000
    with pytest.raises(ValueError, match=r"no draw in 5 tries.*alpha=0\.01"):
        dirichlet_label_skew(LABELS, 20, 0.01, rng=0, min_samples=45, max_tries=5)


def test_iid_split():
    parts = iid_split(103, 10, rng=2)
    assert sorted(len(p) for p in parts) == [10] * 7 + [11] * 3
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(103))
    assert _same(parts, iid_split(103, 10, rng=2)) and not _same(parts, iid_split(103, 10, rng=3))
    with pytest.raises(ValueError):
        iid_split(3, 4, rng=0)


def test_natural_partition_largest_roles_ties_by_name():
    nat = {"ROMEO": np.arange(5), "JULIET": np.arange(5, 10), "NURSE": np.arange(10, 13), "FRIAR": np.arange(13, 20)}
    got = natural_partition(nat, 3)
    assert [n for n, _ in got] == ["FRIAR", "JULIET", "ROMEO"]
    assert np.array_equal(got[1][1], np.arange(5, 10))
    with pytest.raises(ValueError, match="only 4 natural clients"):
        natural_partition(nat, 5)


# ---------------------------------------------------------------------------- ground truth
def test_tv_distance_hand_computed():
    want = 0.5 * (abs(0.75 - 1 / 3) + abs(0.25 - 1 / 3) + abs(0 - 1 / 3))
    assert tv_distance(np.array([3, 1, 0]), np.array([2, 2, 2])) == pytest.approx(want)
    assert want == pytest.approx(5 / 12)
    assert tv_distance(np.array([1, 0]), np.array([0, 7])) == pytest.approx(1.0)
    assert tv_distance(np.array([2, 4]), np.array([1, 2])) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        tv_distance(np.array([0, 0]), np.array([1, 1]))
    with pytest.raises(ValueError):
        tv_distance(np.array([1, 0, 0]), np.array([1, 1]))


def test_label_counts():
    assert label_counts(np.array([0, 2, 2, 4]), 5).tolist() == [1, 0, 2, 0, 1]
    assert label_counts(np.array([[1, 1], [0, 1]]), 2).tolist() == [1, 3]  # per-token targets
    with pytest.raises(ValueError, match="outside"):
        label_counts(np.array([0, 5]), 5)


# ---------------------------------------------------------------------------- capacities
def test_tiers_exact_counts_mean_and_seeded_shuffle():
    cfg = CapacityConfig(scheme="tiers")
    rho, cap = assign_capacities(cfg, 20, seed=0)
    assert np.all(rho == 0)
    assert [int(np.sum(cap == p)) for p in (0.25, 0.5, 0.75, 1.0)] == [7, 7, 3, 3]
    assert cap.mean() == pytest.approx(0.525)
    assert np.array_equal(cap, assign_capacities(cfg, 20, seed=0)[1])
    orders = {tuple(assign_capacities(cfg, 20, seed=s)[1]) for s in range(5)}
    assert len(orders) > 1 and tuple(np.repeat([0.25, 0.5, 0.75, 1.0], [7, 7, 3, 3])) not in orders


def test_tier_counts_largest_remainder():
    assert tier_counts((7, 7, 3, 3), 20).tolist() == [7, 7, 3, 3]
    assert tier_counts((7, 7, 3, 3), 10).tolist() == [4, 4, 1, 1]  # quotas 3.5/3.5/1.5/1.5, ties to lower tiers
    assert tier_counts((7, 7, 3, 3), 7).tolist() == [3, 2, 1, 1]  # quotas 2.45/2.45/1.05/1.05
    assert tier_counts((1, 0, 1), 3).tolist() == [2, 0, 1]
    with pytest.raises(ValueError):
        tier_counts((0, 0), 4)


def test_cyclic_full_explicit():
    rho, cap = assign_capacities(CapacityConfig(scheme="cyclic"), 12, seed=0)
    assert rho.tolist() == pytest.approx([0, .2, .4, .6, .8] * 2 + [0, .2])
    assert cap.tolist() == pytest.approx([1, .8, .6, .4, .2] * 2 + [1, .8])
    rho, cap = assign_capacities(CapacityConfig(scheme="full"), 3, seed=0)
    assert rho.tolist() == [0, 0, 0] and cap.tolist() == [1, 1, 1]
    rho, cap = assign_capacities(CapacityConfig(scheme="explicit", keep_ratios=(1.0, 0.3)), 2, seed=0)
    assert cap.tolist() == [1.0, 0.3] and rho.tolist() == pytest.approx([0.0, 0.7])
    with pytest.raises(ValueError, match="exactly 3"):
        assign_capacities(CapacityConfig(scheme="explicit", keep_ratios=(1.0, 0.3)), 3, seed=0)


# ---------------------------------------------------------------------------- federation
@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory):
    """A root of its own holding a copy of this machine's embedded file (built there at most once, as every smoke
    run needs it): these tests read the federation, not the build, whose two cold builds test_data_embedded.py
    times and compares (a cold build here cost about 6 s)."""
    src = get_source("embedded_digits")
    embedded.load_arrays(src.default_root())
    root = tmp_path_factory.mktemp("embedded_copy")
    shutil.copy(src.default_root() / embedded.CACHE_FILE, root / embedded.CACHE_FILE)
    return root


def _cfg(root, seed: int = 0, capacity: CapacityConfig | None = None, **data) -> ExperimentConfig:
    base = dict(name="embedded_digits", root=str(root), num_clients=10, client_fraction=0.02,
                max_test_per_domain=50, max_train_per_domain=2000)
    base.update(data)
    return ExperimentConfig(seed=seed, data=DataConfig(**base), capacity=capacity or CapacityConfig())


def _check_ground_truth(f: Federation) -> None:
    used = sorted({c.domain for c in f.clients})
    glob = sum(np.bincount(f.train[d].y.numpy(), minlength=f.num_classes) for d in used)
    for c in f.clients:
        y = f.client_data(c.client_id).y.numpy()
        assert len(y) == c.n_samples > 0
        assert c.label_counts.tolist() == np.bincount(y, minlength=f.num_classes).tolist()
        assert c.tv_distance == pytest.approx(0.5 * np.abs(c.label_counts / c.label_counts.sum() - glob / glob.sum()).sum())


def test_build_federation_domain_protocol(cache_root):
    f = build_federation(_cfg(cache_root))
    assert isinstance(f, Federation) and f.dataset == "embedded_digits"
    assert f.domains == ["mnist", "uci_digits", "street", "synth"] and f.num_classes == 10
    assert f.input_kind == "image" and f.input_shape == (3, 32, 32) and "NOT the real Digits" in f.notes
    assert [c.domain for c in f.clients[:4]] == f.domains
    assert {d: len(f.train[d]) for d in f.domains} == {"mnist": 2000, "uci_digits": 1437, "street": 2000, "synth": 2000}
    assert all(len(f.test[d]) == 50 for d in f.domains)
    assert all(isinstance(c, ClientSpec) and c.client_id == i for i, c in enumerate(f.clients))
    for c in f.clients:
        assert c.n_samples == {"uci_digits": 29}.get(c.domain, 40)  # round(0.02 * 1437 = 28.74), 0.02 * 2000
    for d in f.domains:
        idx = np.concatenate([c.indices for c in f.clients if c.domain == d])
        assert len(np.unique(idx)) == len(idx) and idx.max() < len(f.train[d])
    assert [c.capacity for c in f.clients] == pytest.approx([1, .8, .6, .4, .2] * 2)
    _check_ground_truth(f)
    x = f.client_data(3).x
    assert x.dtype == torch.uint8 and tuple(x.shape[1:]) == (3, 32, 32)


def test_build_federation_seeded(cache_root):
    a, b = build_federation(_cfg(cache_root, seed=1)), build_federation(_cfg(cache_root, seed=1))
    assert [(c.domain, c.indices.tolist()) for c in a.clients] == [(c.domain, c.indices.tolist()) for c in b.clients]
    c = build_federation(_cfg(cache_root, seed=2))
    assert [(x.domain, x.indices.tolist()) for x in a.clients] != [(x.domain, x.indices.tolist()) for x in c.clients]
    for d in a.domains:  # held-out subsets do not move with the run seed
        assert torch.equal(a.test[d].y, c.test[d].y) and torch.equal(a.test[d].x, c.test[d].x)
    # splits load once per process: another seed reuses the same loaded object
    assert load_splits(_cfg(cache_root, seed=1)) is load_splits(_cfg(cache_root, seed=7))


def test_build_federation_dirichlet_and_iid_per_domain(cache_root):
    cfg = _cfg(cache_root, seed=4, capacity=CapacityConfig(scheme="tiers"), partition="dirichlet", num_clients=8,
               alpha=0.3, min_samples=10, max_train_per_domain=500)
    f = build_federation(cfg)
    assert [c.domain for c in f.clients[:4]] == f.domains
    for d in f.domains:  # each domain's whole pool is split among its clients, each index once
        idx = np.concatenate([c.indices for c in f.clients if c.domain == d])
        assert np.array_equal(np.sort(idx), np.arange(len(f.train[d])))
    assert min(c.n_samples for c in f.clients) >= 10
    assert sorted(c.capacity for c in f.clients) == sorted(assign_capacities(CapacityConfig(scheme="tiers"), 8, 4)[1])
    _check_ground_truth(f)
    g = build_federation(_cfg(cache_root, seed=4, partition="iid", num_clients=6, max_train_per_domain=500))
    for d in g.domains:  # iid: near-equal shares of the whole pool
        sizes = [c.n_samples for c in g.clients if c.domain == d]
        assert sum(sizes) == len(g.train[d]) and max(sizes) - min(sizes) <= 1
    _check_ground_truth(g)


def test_cap_splits_remaps_natural_indices():
    x = torch.arange(100).view(100, 1)  # each sample's value is its original index
    dd = DomainData(x, torch.zeros(100, dtype=torch.long))
    splits = DomainSplits(dataset="t", domains=["all"], train={"all": dd}, test={"all": dd}, num_classes=1,
                          input_kind="text", input_shape=(1,), natural_train={"A": np.arange(60), "B": np.arange(60, 100)})
    train, _, nat = _cap_splits(splits, DataConfig(max_train_per_domain=30), seed=0)
    assert len(train["all"]) == 30
    got = np.concatenate([train["all"].x[nat[k]].view(-1).numpy() for k in ("A", "B")])
    assert sorted(got.tolist()) == sorted(train["all"].x.view(-1).tolist())  # every kept sample, once
    assert np.all(train["all"].x[nat["A"]].view(-1).numpy() < 60) and np.all(train["all"].x[nat["B"]].view(-1).numpy() >= 60)


def test_as_rng_purposes_differ():
    a = as_rng(5, 1).integers(0, 1 << 30, 4)
    assert np.array_equal(a, as_rng(5, 1).integers(0, 1 << 30, 4))
    assert not np.array_equal(a, as_rng(5, 2).integers(0, 1 << 30, 4))


def _role_splits() -> DomainSplits:
    """Four roles whose rows hold their role number: A (50 train / 5 test), B (40 / 4), C (30 / 3), D (5 / 2)."""
    sizes = {"A": (50, 5), "B": (40, 4), "C": (30, 3), "D": (5, 2)}
    tr_owner = np.concatenate([np.full(n, k) for k, (n, _) in enumerate(sizes.values())])
    te_owner = np.concatenate([np.full(m, k) for k, (_, m) in enumerate(sizes.values())])
    rng = np.random.default_rng(0)
    tr_owner, te_owner = rng.permutation(tr_owner), rng.permutation(te_owner)  # roles interleaved in the pool
    names = list(sizes)
    dd = lambda o: DomainData(torch.as_tensor(o).view(-1, 1), torch.as_tensor(o))  # noqa: E731
    return DomainSplits(dataset="t", domains=["all"], train={"all": dd(tr_owner)}, test={"all": dd(te_owner)},
                        num_classes=4, input_kind="text", input_shape=(1,),
                        natural_train={n: np.flatnonzero(tr_owner == k) for k, n in enumerate(names)},
                        natural_test={n: np.flatnonzero(te_owner == k) for k, n in enumerate(names)})


def test_natural_test_set_is_the_chosen_roles_own_held_out_rows():
    """Issue 14 item 6: the test set holds the federation's roles' held-out rows only (natural_test)."""
    train, test, nat = _cap_splits(_role_splits(), DataConfig(partition="natural", num_clients=2), seed=0)
    assert sorted(test["all"].y.tolist()) == [0] * 5 + [1] * 4  # A's and B's held-out rows, no C or D
    assert sorted(train["all"].y.tolist()) == [0] * 50 + [1] * 40
    assert set(nat) == {"A", "B"} and all((train["all"].y[nat[r]] == "AB".index(r)).all() for r in nat)


def test_natural_roles_chosen_before_the_training_cap():
    """Issue 14 item 6: the cap subsamples the chosen roles' windows; it never decides which roles are chosen."""
    for seed in range(5):
        train, _, nat = _cap_splits(_role_splits(), DataConfig(partition="natural", num_clients=2,
                                                               max_train_per_domain=20), seed=seed)
        assert len(train["all"]) == 20 and set(train["all"].y.tolist()) <= {0, 1}
        assert set(nat) == {"A", "B"}
        got = np.concatenate([train["all"].y[nat[r]].numpy() for r in ("A", "B")])
        assert sorted(got.tolist()) == sorted(train["all"].y.tolist())
    with pytest.raises(ConfigError, match="data.num_clients"):
        _cap_splits(_role_splits(), DataConfig(partition="natural", num_clients=5), seed=0)
