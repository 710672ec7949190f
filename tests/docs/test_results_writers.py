"""What each method really writes (issue 53): docs/reference/results.md lists a strategy-declared column only under
the methods whose runs write it (``declarations.writes_under``: with their defaults, or with the option it names), and
every client row records the width the strategy assigned (``clients.assigned_width``). Both are checked against one
round of every registered method, and of every option setting the page names, on one tiny federation."""
from __future__ import annotations

import re

import numpy as np
import pytest

from fedsap_ray import algorithms
from fedsap_ray.dev import docgen
from fedsap_ray.algorithms.declarations import writes_under
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.results import extension_columns
from tests.conftest import run_rounds_with_records, tiny_overrides

BASE = ["data.num_clients=4", "model.name=cnn_small", "training.eval_deployed=false", "training.max_steps_per_epoch=1"]
TABLES = ("allocations", "layers")  # the tables whose rows only strategies write
# the methods whose clients train the full model, whatever their capacity (assigned width 1.0)
FULL_MODEL = {"fedavg", "fedprox", "moon", "fedsr", "fpl", "scaffold"}


def _cases() -> list[tuple[str, tuple[str, ...]]]:
    """Every method with its defaults, and each with the option setting under which the page says it writes."""
    out = []
    for name in algorithms.names():
        out.append((name, ()))
        for table in TABLES:
            setting = writes_under(algorithms.get(name), table)
            if setting:
                out.append((name, tuple(f"algorithm.{k}={v}" for k, v in setting.items())))
    return list(dict.fromkeys(out))


CASES = _cases()


@pytest.fixture(scope="module")
def fed(single_thread):
    return build_federation(build_config(preset="smoke", overrides=tiny_overrides("fedavg", *BASE)))


@pytest.fixture(scope="module")
def written(fed):
    """(method, options) -> (the RoundRecords of its first round, its config): what the recorder writes."""
    out = {}
    for name, extra in CASES:
        cfg = build_config(preset="smoke", overrides=tiny_overrides(name, *BASE, *extra))
        *_, records = run_rounds_with_records(cfg, fed, 1)
        out[(name, extra)] = (records[0], cfg)
    return out


def _listed(table: str) -> dict[str, str]:
    """method -> what the generated page's "written by" cell says of it, for the declared columns of ``table``."""
    page = docgen.results_page()
    section = page.split(f"\n## {table}\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for col in extension_columns(table):
        row = next(line for line in section.splitlines() if line.startswith(f"| `{col}` |"))
        for name, setting in re.findall(r"`(\w+)`(?: \(with ([^)]*)\))?", row.rsplit(" | ", 1)[1]):
            out[name] = setting
    return out


@pytest.mark.parametrize("table", TABLES)
def test_the_results_page_lists_exactly_the_methods_whose_runs_write_the_table(table, written):
    listed = _listed(table)
    wrote = {name: extra for (name, extra), (rec, _) in written.items() if getattr(rec, table)}
    # every method that wrote rows is listed, with the setting it ran under (none: its defaults)
    for name, extra in wrote.items():
        assert name in listed, f"{name} wrote {table} rows with {extra or 'its defaults'} but the page omits it"
        assert listed[name] == ", ".join(f"`{o}`" for o in extra), (name, listed[name], extra)
    # and no method is listed that wrote none (FedDrop, FedMP, NeFL inherit FedAvg's allocations columns)
    assert set(listed) == set(wrote), sorted(set(listed) ^ set(wrote))
    if table == "allocations":  # the case the issue met: channel-subset methods declare, never write
        assert {"feddrop", "fedmp", "nefl"}.isdisjoint(listed) and "heterofl" in listed


@pytest.mark.parametrize("name, extra", CASES, ids=[" ".join([n, *e]) for n, e in CASES])
def test_every_client_row_records_the_width_its_strategy_assigned(name, extra, written, fed):
    records, cfg = written[(name, extra)]
    assert records.clients
    alloc = {r["client_id"]: r["p"] for r in records.allocations}
    for cid, row in records.clients.items():
        width = row["assigned_width"]
        kappa = min(fed.clients[cid].capacity, 1.0)
        if cid in alloc:  # a nested-width method: the width its allocations row gives the client
            assert width == alloc[cid], (cid, width, alloc[cid])
        elif name in FULL_MODEL:
            assert width == 1.0
        else:  # channel subsets at kappa_i: FedDrop, FedMP, NeFL, FedSPU, DapperFL, FedSAP
            assert width == pytest.approx(kappa), (cid, width, kappa)
        assert 0 < width <= 1
    if name == "heterofl":  # p_i = kappa_i, and not 1: a width the old clients table had no column for
        assert sorted({r["assigned_width"] for r in records.clients.values()}) != [1.0]
        assert np.allclose([r["assigned_width"] for r in records.clients.values()],
                           [min(fed.clients[c].capacity, 1.0) for c in records.clients])
