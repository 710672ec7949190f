"""The ``clients`` rows a strategy returns (``RoundRecords.clients``), built the same way for every method, so each
row holds the columns every client row has whether the client was aggregated or left out as a straggler."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.common.columns import Column
from fedsap_ray.common.messages import ClientPlan, ClientResult, RoundOutput, RoundRecords, ServerState

# clients-table columns of the strategies that report where a client's channels went (declared, shared)
CHANNEL_COUNT_COLUMNS: tuple[Column, ...] = (
    Column("n_global", pa.int64(), "channels trained on the Global (shared, aggregated) path"),
    Column("n_private", pa.int64(), "channels trained on a Private path (kept by a group or the client)"),
    Column("n_dropped", pa.int64(), "channels not trained"),
)


def client_cost(s: Strategy, plan: ClientPlan, result: ClientResult) -> dict[str, Any]:
    """What one client-round cost (``params_trained``, ``macs_per_sample``, ``train_macs``) and the width it was
    assigned (``assigned_width``), whether or not it was aggregated (a straggler's compute is counted too:
    fedsap_ray.data.devices): the columns every client row has, whichever way it was recorded."""
    return {"params_trained": s.params_trained(plan, result), "macs_per_sample": s.compute.mask_macs(plan.mask),
            "train_macs": s.train_macs(plan, result), "assigned_width": s.assigned_width(plan)}


def client_records(s: Strategy, state: ServerState, plans: Mapping[int, ClientPlan],
                   results: list[ClientResult]) -> dict[int, dict[str, Any]]:
    """``RoundRecords.clients``: per client that trained, :func:`client_cost` and the strategy's
    ``client_columns`` (which may refine ``macs_per_sample``); ``state`` is the state after the round."""
    out = {}
    for r in results:
        plan = plans[r.client_id]
        out[r.client_id] = {**client_cost(s, plan, r), **s.client_columns(state, plan, r)}
    return out


def clients_only(s: Strategy, state: ServerState, plans: Mapping[int, ClientPlan],
                 results: list[ClientResult]) -> RoundOutput:
    """The :class:`RoundOutput` of a round whose only records are its clients' (:func:`client_records`)."""
    return RoundOutput(state, RoundRecords(clients=client_records(s, state, plans, results)))
