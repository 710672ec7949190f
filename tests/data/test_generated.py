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


def test_a_federation_of_100000_clients_of_five_samples():
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
