"""fedsap_ray.persist.digest: the content digest every cache and checkpoint is checked by must see every change
that keeps shape and dtype (the changes a shape check misses), and nothing else."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from fedsap_ray.persist.digest import array_digest, arrays_digest, is_digest, json_digest


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(1, 300), pos=st.data(), seed=st.integers(0, 2**31 - 1))
def test_any_flipped_byte_changes_the_digest(n: int, pos: st.DataObject, seed: int) -> None:
    a = np.random.default_rng(seed).integers(0, 255, size=n, dtype=np.uint8)
    b = a.copy()
    i = pos.draw(st.integers(0, n - 1))
    b[i] ^= pos.draw(st.integers(1, 255))
    assert array_digest(a) != array_digest(b)


def test_same_bytes_other_meaning_differ() -> None:
    """Same bytes under another dtype, shape or name is another content (labels read as pixels)."""
    a = np.arange(12, dtype=np.int32)
    base = arrays_digest({"y": a})
    assert arrays_digest({"y": a.view(np.float32)}) != base
    assert arrays_digest({"y": a.reshape(3, 4)}) != base
    assert arrays_digest({"x": a}) != base
    assert arrays_digest({"y": a.astype(">i4")}) != base  # the byte order is part of the content
    assert arrays_digest({"y": a}, meta={"domains": ["a", "b"]}) != arrays_digest({"y": a}, meta={"domains": ["b", "a"]})


def test_order_of_insertion_and_layout_do_not_matter(tmp_path) -> None:
    a = np.arange(24, dtype=np.float64).reshape(4, 6)
    b = np.arange(5, dtype=np.uint8)
    assert arrays_digest({"a": a, "b": b}) == arrays_digest({"b": b, "a": a})
    assert arrays_digest({"a": a}) == arrays_digest({"a": np.asfortranarray(a)})  # C-order content either way
    np.save(tmp_path / "a.npy", a)
    assert arrays_digest({"a": np.load(tmp_path / "a.npy", mmap_mode="c")}) == arrays_digest({"a": a})
    assert json_digest({"x": 1, "y": [1, 2]}) == json_digest({"y": [1, 2], "x": 1})


def test_digest_format() -> None:
    d = array_digest(np.zeros(3))
    assert is_digest(d) and d.startswith("sha256:")
    assert not is_digest("sha256:" + "0" * 63) and not is_digest(d.upper()) and not is_digest(None)
