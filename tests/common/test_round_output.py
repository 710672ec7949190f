"""RoundOutput's two ways of building a round's output besides ``Strategy.aggregate`` (the straggler path of
``Server.round``): a round no update reached, and stragglers' rows added to what the others computed."""
from __future__ import annotations

import numpy as np

from fedsap_ray.common.messages import RoundOutput, RoundRecords, ServerState


def test_an_unchanged_round_keeps_every_parameter_and_records_nothing() -> None:
    params = np.arange(5, dtype=np.float32)
    state = ServerState(round=3, params=params, strategy_state={"k": 1})
    out = RoundOutput.unchanged(state, 4)
    assert out.state.round == 4 and state.round == 3  # renumbered, the old state untouched
    assert out.state.params is params and out.state.strategy_state == {"k": 1}  # not copied, not changed
    assert out.records == RoundRecords()


def test_client_rows_are_added_beside_the_aggregated_ones() -> None:
    records = RoundRecords(rounds={"x": 1.0}, clients={0: {"train_macs": 10}, 1: {"train_macs": 20}}, layers=({"a": 1},))
    out = RoundOutput(ServerState(round=2, params=np.zeros(2, np.float32)), records)
    added = out.with_client_rows({2: {"train_macs": 5}, 3: {"train_macs": 7}})
    assert dict(added.records.clients) == {0: {"train_macs": 10}, 1: {"train_macs": 20}, 2: {"train_macs": 5},
                                           3: {"train_macs": 7}}
    assert added.records.rounds == {"x": 1.0} and added.records.layers == ({"a": 1},) and added.state is out.state
    assert set(out.records.clients) == {0, 1}  # the output it came from is unchanged
