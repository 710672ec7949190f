"""Open metrics and ground truth kept from strategies.

- A strategy declares its own results columns (``Strategy.columns``): the results schema, the rows,
  the progress line and the generated results reference take them from there, with no core edit.
- A strategy sees what a real server could know (``FederationView``): no true domains, TV
  distances or label counts; ground truth reaches evaluation (``EvalDomains``), the recorder
  (``ari_domain``, ``true_domain``, ``tv_distance``) and, explicitly, the ``dga=oracle`` control.
"""
from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from fedsap_ray import algorithms, results
from fedsap_ray.dev import docgen
from fedsap_ray.algorithms import registry
from fedsap_ray.algorithms.declarations import declared_columns
from fedsap_ray.algorithms.fedavg import FedAvg
from fedsap_ray.algorithms.fedsap.strategy import progress_template
from fedsap_ray.algorithms.grouping import canonical_labels
from fedsap_ray.common.columns import Column
from fedsap_ray.config import build_config
from fedsap_ray.experiment import run_experiment
from fedsap_ray.common.messages import RoundRecords
from fedsap_ray.run.progress import ProgressPrinter
from conftest import federation_fixture, make_strategy, run_rounds_with_records, tiny_overrides

FED_OVERRIDES = tiny_overrides("fedavg", "data.num_clients=8")
fed = federation_fixture(FED_OVERRIDES)
GROUND_TRUTH = ("domain", "tv_distance", "label_counts", "indices")


# --------------------------------------------------------------------------- ground truth kept from strategies
@pytest.mark.parametrize("name", algorithms.names())
def test_a_strategy_sees_no_domain_nor_tv_distance(name, fed):
    cfg = build_config(preset="smoke", overrides=tiny_overrides(name, "data.num_clients=8"))
    _, strat = make_strategy(cfg, fed)
    view = strat.ctx.federation
    for attr in ("domains", "train", "test", "domain_notes", "client_data"):
        assert not hasattr(view, attr), attr
    assert [c.client_id for c in view.clients] == [c.client_id for c in fed.clients]
    for info, spec in zip(view.clients, fed.clients):
        for attr in GROUND_TRUTH:
            assert not hasattr(info, attr), attr
        assert (info.n_samples, info.capacity, info.pruning_ratio) == (spec.n_samples, spec.capacity,
                                                                      spec.pruning_ratio)
    assert strat.ctx.oracle is None  # no method is handed ground truth


def test_the_oracle_control_gets_the_true_domains_explicitly_and_recovers_them(fed):
    over = tiny_overrides("fedsap", "data.num_clients=8", "algorithm.dga=oracle", "algorithm.warmup=1",
                          "algorithm.regroup_every=1")
    cfg = build_config(preset="smoke", overrides=over)
    _, strat, states, _, _, records = run_rounds_with_records(cfg, fed, 2)
    truth = [c.domain for c in fed.clients]
    assert strat.ctx.oracle is not None and list(strat.ctx.oracle.client_domains) == truth
    assert not hasattr(strat.ctx.federation, "domains")  # the general view still has none
    for t in (1, 2):
        np.testing.assert_array_equal(records[t - 1].groups, canonical_labels(truth))
    gradient = build_config(preset="smoke", overrides=[*over[:-3], "algorithm.dga=gradient"])
    assert make_strategy(gradient, fed)[1].ctx.oracle is None


def test_the_recorder_scores_the_oracle_groups_against_the_true_domains(tmp_path, fed):
    over = tiny_overrides("fedsap", "data.num_clients=8", "algorithm.dga=oracle", "algorithm.warmup=1",
                          "algorithm.regroup_every=1", "training.rounds=2")
    run_experiment(build_config(preset="smoke", overrides=over), tmp_path, run_id="o", federation=fed)
    res = results.load(tmp_path)
    per_round = res.rounds.drop_duplicates("round").set_index("round")
    assert per_round["ari_domain"].tolist() == [1.0, 1.0]  # computed by the Server, not the strategy
    assert per_round["n_groups"].tolist() == [len(fed.domains)] * 2
    c = res.clients
    assert (c["true_domain"] == [fed.clients[i].domain for i in c["client_id"]]).all()
    assert (c["tv_distance"] == [fed.clients[i].tv_distance for i in c["client_id"]]).all()


# --------------------------------------------------------------------------- open metrics
class ToyMetric(FedAvg):
    """FedAvg with two metrics of its own: only this class declares and writes them."""

    columns = {"rounds": (Column("toy_round", pa.int64(), "ten times the round"),),
               "clients": (Column("toy_client", pa.float64(), "client id + 0.5"),)}

    def records(self, state, plans, results, t) -> RoundRecords:
        out = super().records(state, plans, results, t)
        return replace(out, rounds={**out.rounds, "toy_round": 10 * state.round}, progress="  toy {toy_round}")

    def client_columns(self, state, plan, result) -> dict[str, Any]:
        return {**super().client_columns(state, plan, result), "toy_client": plan.client_id + 0.5}


class Undeclared(FedAvg):
    def records(self, state, plans, results, t) -> RoundRecords:
        return replace(super().records(state, plans, results, t), rounds={"not_declared": 1})


class Retyped(FedAvg):
    columns = {"clients": (Column("n_global", pa.float64(), "the inherited channel count, another type"),)}


class ToyInt(FedAvg):
    columns = {"rounds": (Column("toy_x", pa.int64(), "an int"),)}


class ToyFloat(FedAvg):
    columns = {"rounds": (Column("toy_x", pa.float64(), "the same name, a float"),)}


@pytest.fixture
def registered():
    """Register strategy classes for one test and remove them afterwards (the schema is the registry's)."""
    added = []

    def add(name, cls):
        registry.register(name)(cls)
        added.append(name)

    yield add
    for name in added:
        registry._REGISTRY.pop(name)


def test_a_strategy_declares_its_columns_and_nothing_else_changes(tmp_path, fed, registered):
    before = {t: [c.name for c in results.TABLES[t]] for t in results.TABLES}
    registered("toy_metric", ToyMetric)
    assert [c.name for c in results.TABLES["rounds"]] == [*before["rounds"], "toy_round"]
    assert [c.name for c in results.TABLES["clients"]] == [*before["clients"], "toy_client"]
    cfg = build_config(preset="smoke", overrides=tiny_overrides("toy_metric", "data.num_clients=8",
                                                                "training.rounds=2"))
    stream = io.StringIO()
    run_experiment(cfg, tmp_path, run_id="toy", federation=fed, progress=ProgressPrinter(2, stream))
    res = results.load(tmp_path)
    assert sorted(res.rounds["toy_round"].unique()) == [10, 20]
    assert (res.clients["toy_client"] == res.clients["client_id"] + 0.5).all()
    assert res.clients["n_global"].notna().all()  # the inherited declaration still applies
    assert results.schema("rounds").field("toy_round").metadata[b"doc"] == b"ten times the round"
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("  toy 10") and lines[1].endswith("  toy 20")
    page = docgen.results_page()
    assert "| `toy_round` | `int64` | ten times the round | `toy_metric` |" in page


def test_a_column_the_strategy_does_not_declare_is_refused(tmp_path, fed, registered):
    registered("undeclared_metric", Undeclared)
    cfg = build_config(preset="smoke", overrides=tiny_overrides("undeclared_metric", "data.num_clients=8",
                                                                "training.rounds=1"))
    with pytest.raises(KeyError, match="not_declared"):
        run_experiment(cfg, tmp_path, run_id="u", federation=fed)


def test_two_declarations_of_one_column_must_agree_on_its_type(registered):
    with pytest.raises(ValueError, match="n_global"):
        declared_columns(Retyped, "clients")
    registered("toy_int", ToyInt)
    assert results.schema("rounds").field("toy_x").type == pa.int64()
    registered("toy_float", ToyFloat)
    with pytest.raises(ValueError, match="toy_x"):
        results.schema("rounds")


def test_every_algorithm_column_is_declared_by_a_strategy_and_named_in_the_reference():
    page = docgen.results_page()
    for table in results.DATA_TABLES:
        for name, (col, by) in results.extension_columns(table).items():
            assert by and all(b in algorithms.names() for b in by)
            assert f"| `{name}` | `{col.type}` |" in page
    assert {"n_groups", "ari_capacity", "n_reactivated", "n_role_switches"} <= set(
        results.extension_columns("rounds"))
    assert {"pseudo_group", "n_global", "n_private", "n_dropped", "h_hat", "h_tilde"} <= set(
        results.extension_columns("clients"))
    assert results.extension_columns("clients")["pseudo_group"][1] == ["fedsap", "fedsap_fixed"]


def test_fedsap_writes_its_own_part_of_the_progress_line(fed):
    cfg = build_config(preset="smoke", overrides=tiny_overrides("fedsap", "data.num_clients=8"))
    _, _, _, _, _, records = run_rounds_with_records(cfg, fed, 1)
    assert "  masks +{n_reactivated} back" in records[0].progress  # a template the recorder fills

    def text(c):
        return progress_template(c).format_map(c)
    dga_round = {"n_groups": 2, "ari_domain": 1.0, "ari_capacity": -0.25, "n_reactivated": 3, "n_role_switches": 4}
    assert text(dga_round) == "  DGA 2 groups (ARI domains 1.00, capacities -0.25)  masks +3 back, 4 G<->P"
    assert text({"n_reactivated": 0, "n_role_switches": 0}) == "  masks +0 back, 0 G<->P"
    assert text({}) == ""
