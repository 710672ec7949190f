"""The ``allocations`` table follows the round, not the federation: every client at round 1, at each
adaptation step and at the last round; the round's own clients in between (issue 29)."""
from __future__ import annotations

import pytest

from fedsap_ray.config import build_config
from conftest import federation_fixture, run_rounds_with_records, tiny_overrides

ROUNDS = 5
BASE = ["data.num_clients=8", "training.participation=0.5", f"training.rounds={ROUNDS}"]
fed = federation_fixture(tiny_overrides("heterofl", *BASE))


@pytest.mark.parametrize("algorithm,adapting", [("heterofl", set()), ("hasfl", {2, 3, 4, 5})])
def test_every_client_only_at_round_1_an_adaptation_step_and_the_last_round(fed, algorithm, adapting):
    cfg = build_config(preset="smoke", overrides=tiny_overrides(algorithm, *BASE))
    _, _, _, plans, _, records = run_rounds_with_records(cfg, fed, ROUNDS)
    for t in range(1, ROUNDS + 1):
        rows = records[t - 1].allocations
        ids = [r["client_id"] for r in rows]
        assert {r["adapted"] for r in rows} == {t in adapting}
        if t == 1 or t == ROUNDS or t in adapting:
            assert ids == list(range(8)), t  # a snapshot of the whole federation
        else:
            assert ids == sorted(plans[t - 1]) and len(ids) == 4, t  # only the round's clients
    if algorithm == "heterofl":  # a static rule: the rows left out repeat the snapshot
        first = {r["client_id"]: r["p"] for r in records[0].allocations}
        assert all(first[r["client_id"]] == r["p"] for rec in records for r in rec.allocations)
