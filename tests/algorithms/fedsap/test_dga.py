"""FedSAP Domain-Guided Assignment (papers/000 Eq. 4, Appendix C; docs/readings.md#dga)."""
from __future__ import annotations

import numpy as np
import pytest

from fedsap_ray.algorithms.fedsap.dga import (DGA_MODES, agreement, assign_groups, canonical_labels,
                                              cosine_similarity_matrix, groups_from_similarity, n_groups,
                                              oracle_groups, random_groups_like, singleton_groups)
from fedsap_ray.config import ConfigError

METHODS = ("components", "agglomerative")


def _two_domain_grads(rng: np.random.Generator, per: int = 4, d: int = 64, noise: float = 0.05) -> np.ndarray:
    """Clients 0..per-1 near direction a, the rest near an orthogonal direction b (interleaved order)."""
    a = np.zeros(d)
    a[: d // 2] = 1.0
    b = np.zeros(d)
    b[d // 2:] = 1.0
    rows = [(a if i % 2 == 0 else b) + noise * rng.standard_normal(d) for i in range(2 * per)]
    return np.stack(rows)


# ---------------------------------------------------------------- Eq. 4 similarity
def test_cosine_matrix_hand_computed():
    g = np.array([[1.0, 0.0], [1.0, 1.0], [-2.0, 0.0]])
    r = 1 / np.sqrt(2)
    expected = np.array([[1.0, r, -1.0],
                         [r, 1.0, -r],
                         [-1.0, -r, 1.0]])
    S = cosine_similarity_matrix(g)
    np.testing.assert_allclose(S, expected, atol=1e-12)
    assert S.dtype == np.float64 and np.array_equal(S, S.T)


def test_cosine_flattens_trailing_shape_and_is_scale_invariant():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((3, 2, 3, 3))  # e.g. raw first-conv gradients (out, in, kh, kw)
    S = cosine_similarity_matrix(g)
    np.testing.assert_allclose(S, cosine_similarity_matrix(g.reshape(3, -1)), atol=1e-12)
    scaled = g * np.array([1e-200, 1.0, 1e200])[:, None, None, None]  # no under/overflow
    np.testing.assert_allclose(cosine_similarity_matrix(scaled), S, atol=1e-12)


def test_zero_gradient_similarity():
    S = cosine_similarity_matrix(np.array([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]))
    np.testing.assert_array_equal(S, np.eye(3))  # 0 to others (even another zero), 1 to itself
    assert groups_from_similarity(S).tolist() == [0, 1, 2]


def test_non_finite_gradient_raises_naming_client():
    with pytest.raises(ValueError, match=r"client\(s\) \[1\]"):
        cosine_similarity_matrix(np.array([[1.0, 0.0], [np.nan, 1.0]]))


# ---------------------------------------------------------------- grouping
@pytest.mark.parametrize("method", METHODS)
def test_identical_gradients_share_a_group(method):
    g = np.array([[1.0, 2.0, 3.0]] * 4)
    assert groups_from_similarity(cosine_similarity_matrix(g), method=method).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("method", METHODS)
def test_orthogonal_and_opposite_gradients_are_split(method):
    g = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 0.0]])
    groups = groups_from_similarity(cosine_similarity_matrix(g), method=method)
    assert groups.tolist() == [0, 1, 2, 0]


def test_components_threshold_is_inclusive():
    S_at = np.array([[1.0, 0.5], [0.5, 1.0]])
    S_below = np.array([[1.0, 0.5 - 1e-12], [0.5 - 1e-12, 1.0]])
    assert groups_from_similarity(S_at, 0.5, "components").tolist() == [0, 0]      # S_ij >= tau joins
    assert groups_from_similarity(S_below, 0.5, "components").tolist() == [0, 1]


def test_agglomerative_threshold_is_strict():
    S_at = np.array([[1.0, 0.5], [0.5, 1.0]])
    S_above = np.array([[1.0, 0.5 + 1e-9], [0.5 + 1e-9, 1.0]])
    assert groups_from_similarity(S_at, 0.5, "agglomerative").tolist() == [0, 1]   # D == 1 - tau not merged
    assert groups_from_similarity(S_above, 0.5, "agglomerative").tolist() == [0, 0]


def test_components_are_transitive():
    # 0~1 and 1~2 above tau, 0-2 below: connected components join all three.
    S = np.array([[1.0, 0.6, 0.1], [0.6, 1.0, 0.6], [0.1, 0.6, 1.0]])
    assert groups_from_similarity(S, 0.5, "components").tolist() == [0, 0, 0]


def test_agglomerative_agrees_with_components_on_clean_two_clusters():
    g = _two_domain_grads(np.random.default_rng(1))
    S = cosine_similarity_matrix(g)
    comp = groups_from_similarity(S, method="components")
    aggl = groups_from_similarity(S, method="agglomerative")
    assert comp.tolist() == [0, 1] * 4
    np.testing.assert_array_equal(aggl, comp)


def test_canonical_labelling():
    # cluster of client 0 is group 0; ids 0..K-1 in order of first appearance
    S = cosine_similarity_matrix(np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.1], [0.0, 2.0], [-1.0, 0.0]]))
    for method in METHODS:
        assert groups_from_similarity(S, method=method).tolist() == [0, 1, 1, 0, 2]
    assert canonical_labels([7, 7, 3, 9, 3]).tolist() == [0, 0, 1, 2, 1]
    assert canonical_labels(["b", "a", "b"]).tolist() == [0, 1, 0]


def test_trivial_sizes():
    for method in METHODS:
        assert groups_from_similarity(np.ones((1, 1)), method=method).tolist() == [0]
        assert groups_from_similarity(np.zeros((0, 0)), method=method).tolist() == []


def test_bad_similarity_and_tau():
    with pytest.raises(ValueError, match="square"):
        groups_from_similarity(np.ones((2, 3)))
    with pytest.raises(ValueError, match="symmetric"):
        groups_from_similarity(np.array([[1.0, 0.9], [0.1, 1.0]]))
    with pytest.raises(ConfigError, match="algorithm.tau_sim"):
        groups_from_similarity(np.eye(2), tau_sim=1.5)
    with pytest.raises(ConfigError, match="algorithm.dga_method='kmeans'"):
        groups_from_similarity(np.eye(2), method="kmeans")


# ---------------------------------------------------------------- none / oracle / random
def test_singleton_and_oracle_groups():
    assert singleton_groups(4).tolist() == [0, 1, 2, 3]
    assert singleton_groups(0).tolist() == []
    doms = ["svhn", "mnist", "svhn", "usps", "mnist"]
    assert oracle_groups(doms).tolist() == [0, 1, 0, 2, 1]
    assert oracle_groups([]).tolist() == []


def _sizes(groups):
    return sorted(np.bincount(groups).tolist())


def test_random_groups_like_preserves_sizes_and_is_seeded():
    ref = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])
    a = random_groups_like(ref, np.random.default_rng(0))
    b = random_groups_like(ref, np.random.default_rng(0))
    c = random_groups_like(ref, np.random.default_rng(1))
    assert _sizes(a) == _sizes(c) == _sizes(ref)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.tolist() == canonical_labels(a).tolist() and a[0] == 0
    with pytest.raises(TypeError, match="Generator"):
        random_groups_like(ref, 0)


# ---------------------------------------------------------------- dispatcher
def test_assign_groups_modes():
    rng = np.random.default_rng(2)
    g = _two_domain_grads(rng)
    doms = ["a", "b"] * 4
    grad = assign_groups("gradient", grads=g)
    assert grad.tolist() == oracle_groups(doms).tolist() == assign_groups("oracle", domains=doms).tolist()
    assert assign_groups("gradient", grads=g, method="agglomerative").tolist() == grad.tolist()
    assert assign_groups("none", grads=g).tolist() == list(range(8))
    r1 = assign_groups("random", reference=grad, rng=np.random.default_rng(5))
    r2 = assign_groups("random", grads=g, rng=np.random.default_rng(5))
    np.testing.assert_array_equal(r1, r2)
    assert _sizes(r1) == [4, 4]


def test_assign_groups_errors_name_the_field():
    with pytest.raises(ValueError, match=r"algorithm\.dga='x': allowed values are gradient, none, oracle, random"):
        assign_groups("x", grads=np.eye(2))
    assert DGA_MODES == ("gradient", "none", "oracle", "random")
    with pytest.raises(ValueError, match="needs grads"):
        assign_groups("gradient")
    with pytest.raises(ValueError, match="needs domains"):
        assign_groups("oracle")
    with pytest.raises(ValueError, match="needs rng"):
        assign_groups("random", reference=[0, 0, 1])
    with pytest.raises(ValueError, match="needs reference"):
        assign_groups("random", rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="client count"):
        assign_groups("none")


# ---------------------------------------------------------------- agreement
def test_agreement_and_n_groups():
    assert agreement([0, 0, 1, 1, 2], ["x", "x", "y", "y", "z"]) == pytest.approx(1.0)
    assert agreement([2, 2, 0, 0, 1], [5, 5, 9, 9, 1]) == pytest.approx(1.0)
    rng = np.random.default_rng(3)
    n = 3000
    ari = agreement(rng.integers(0, 4, n), rng.choice(["a", "b", "c"], n))
    assert abs(ari) < 0.01
    # capacity-tier confound: grouping equals tiers, not domains
    tiers = [0.25, 0.25, 1.0, 1.0]
    groups = [0, 0, 1, 1]
    domains = ["a", "b", "a", "b"]
    assert agreement(groups, tiers) == pytest.approx(1.0)
    assert agreement(groups, domains) < 0
    with pytest.raises(ValueError, match="equal length"):
        agreement([0, 1], [0])
    assert n_groups([0, 0, 1, 2, 2]) == 3 and n_groups(["a", "b"]) == 2 and n_groups([]) == 0
