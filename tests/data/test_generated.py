"""``generated_blobs``: the same draw every time, and a federation of 100,000 clients of about 5 samples (issue 29)."""
from __future__ import annotations

import numpy as np

from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation, generated


def test_the_draw_is_fixed_and_the_domains_differ():
    a, b = generated.draw(n_train=200, n_test=50), generated.draw(n_train=200, n_test=50)
    for d in generated.DOMAINS:
        for x, y in zip(a[d], b[d]):
            np.testing.assert_array_equal(x, y)
    means = np.stack([a[d][0].mean(axis=0) for d in generated.DOMAINS])
    assert np.abs(means[:, None] - means[None]).max() > 0.5  # a per-domain offset and scale: feature shift


def test_a_federation_of_100000_clients_of_about_five_samples():
    n = 100_000
    cfg = build_config(preset="smoke", overrides=[
        "data.name=generated_blobs", "model.name=mlp", "data.partition=iid", "data.client_fraction=1.0",
        f"data.num_clients={n}", f"data.max_train_per_domain={5 * n // 4}", f"training.participation={100 / n}"])
    fed = build_federation(cfg)
    sizes = np.array([c.n_samples for c in fed.clients])
    # domains get their clients at random (the domain protocol), so a client holds 5 samples on average
    assert len(sizes) == n and sizes.sum() == 5 * n and 4 <= sizes.min() and sizes.max() <= 6
    assert fed.input_kind == "features" and fed.input_shape == (generated.FEATURES,)
    for d in fed.domains:  # each domain's pool split among its clients without overlap
        taken = np.concatenate([c.indices for c in fed.clients if c.domain == d])
        assert len(np.unique(taken)) == len(taken) == 5 * n // 4


def test_a_federation_crosses_a_process_boundary_as_columns_and_comes_back_equal():
    """Pickled (what Ray sends the server actor and the workers), the clients travel as one array per field;
    unpickled, every client has its fields back with their dtypes, its arrays viewing the shared columns."""
    import pickle

    cfg = build_config(preset="smoke", overrides=[
        "data.name=generated_blobs", "model.name=mlp", "data.partition=iid", "data.num_clients=2000",
        "data.max_train_per_domain=5000", "training.participation=0.05"])
    fed = build_federation(cfg)
    blob = pickle.dumps(fed, protocol=5)
    back = pickle.loads(blob)
    assert [f for f in fed.__dataclass_fields__ if getattr(back, f) is None] == [f for f in fed.__dataclass_fields__
                                                                                  if getattr(fed, f) is None]
    assert back.domains == fed.domains and back.num_classes == fed.num_classes and back.notes == fed.notes
    for a, b in zip(fed.clients, back.clients, strict=True):
        assert (a.client_id, a.domain, a.pruning_ratio, a.capacity, a.tv_distance) == \
               (b.client_id, b.domain, b.pruning_ratio, b.capacity, b.tv_distance)
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.label_counts, b.label_counts)
        assert a.indices.dtype == b.indices.dtype and a.label_counts.dtype == b.label_counts.dtype
    base = back.clients[1].indices.base
    assert base is not None and back.clients[2].indices.base is base  # views of one column, not N arrays
    assert back.clients[1].label_counts.base is back.clients[2].label_counts.base is not None
    np.testing.assert_array_equal(back.client_data(7).x, fed.client_data(7).x)
    assert len(blob) < len(pickle.dumps(fed.clients, protocol=5)) + len(pickle.dumps((fed.train, fed.test), protocol=5))
