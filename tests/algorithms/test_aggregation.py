"""Coordinate-wise (heterogeneous) FedAvg against hand-computed and plain averages."""
from __future__ import annotations

import numpy as np

from fedsap_ray.algorithms.aggregation import masked_weighted_average


def test_full_masks_equal_plain_weighted_average():
    rng = np.random.default_rng(0)
    old = rng.normal(size=1000).astype(np.float32)
    ups = [rng.normal(size=1000).astype(np.float32) for _ in range(4)]
    w = [10.0, 30.0, 5.0, 55.0]
    got = masked_weighted_average(old, [(None, u, wi) for u, wi in zip(ups, w)])
    want = (sum(wi * u.astype(np.float64) for u, wi in zip(ups, w)) / sum(w)).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    # full-size boolean masks give the same result as None
    full = np.ones(1000, bool)
    np.testing.assert_array_equal(masked_weighted_average(old, [(full, u, wi) for u, wi in zip(ups, w)]), got)


def test_hand_computed_partial_coverage_and_untrained_bit_identical():
    old = np.array([1.0, 2.0, 3.0, np.float32(np.pi)], dtype=np.float32)
    m1 = np.array([True, True, False, False])
    m2 = np.array([True, False, True, False])
    got = masked_weighted_average(old, [(m1, np.array([10.0, 20.0], np.float32), 1.0),
                                        (m2, np.array([40.0, 60.0], np.float32), 3.0)])
    np.testing.assert_allclose(got[:3], [(10 + 120) / 4, 20.0, 60.0])
    assert got[3].tobytes() == old[3].tobytes()  # nobody trained it: bit-identical


def test_restrict_and_order_independence():
    rng = np.random.default_rng(1)
    old = rng.normal(size=50).astype(np.float32)
    masks = [rng.random(50) < 0.5 for _ in range(3)]
    contribs = [(m, rng.normal(size=int(m.sum())).astype(np.float32), float(i + 1)) for i, m in enumerate(masks)]
    restrict = np.arange(50) < 25
    a = masked_weighted_average(old, contribs, restrict=restrict)
    assert np.array_equal(a[25:], old[25:])
    b = masked_weighted_average(old, contribs[::-1], restrict=restrict)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)


# --- the chunked, threaded form against the plain one (issue 42) -----------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

from fedsap_ray.algorithms.aggregation import reference_average  # noqa: E402


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 700), clients=st.integers(1, 6),
       chunk=st.sampled_from([1, 7, 64, 1 << 16]), threads=st.integers(1, 4), restricted=st.booleans())
def test_chunked_threaded_average_is_bit_identical_to_the_plain_form(seed, n, clients, chunk, threads, restricted):
    """Random masks (some shared by several clients, some full, some empty), weights (zero included) and
    piece sizes: every bit equals the one-pass definition, so chunks and threads change only the speed."""
    rng = np.random.default_rng(seed)
    old = rng.normal(size=n).astype(np.float32)
    shared = rng.random(n) < 0.5
    contribs = []
    for _ in range(clients):
        kind = rng.integers(4)
        mask = None if kind == 0 else shared if kind == 1 else rng.random(n) < rng.random()
        size = n if mask is None else int(mask.sum())
        values = (rng.normal(size=size) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
        contribs.append((mask, values, float(rng.choice([0.0, 1.0, 3.0, rng.random() * 100]))))
    restrict = rng.random(n) < 0.7 if restricted else None
    want = reference_average(old, contribs, restrict)
    got = masked_weighted_average(old, contribs, restrict, chunk=chunk, threads=threads)
    assert got.tobytes() == want.tobytes()


def test_chunked_average_rejects_what_the_plain_form_rejects():
    import pytest

    old = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="weight must be >= 0"):
        masked_weighted_average(old, [(None, old, -1.0)])
    with pytest.raises(ValueError, match="mask covers 3 coordinates but 2 values"):
        masked_weighted_average(old, [(np.arange(10) < 3, np.zeros(2, np.float32), 1.0)])
    with pytest.raises(ValueError, match="full update has 9 values"):
        masked_weighted_average(old, [(None, np.zeros(9, np.float32), 1.0)])
