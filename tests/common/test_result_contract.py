"""What a result holds (issue 43, fedsap_ray/common/messages.py): ``ClientResult.values`` are the trained values at
``ClientResult.mask``'s coordinates, set by the client (the plan's mask, or the one a hook chose), read by every
consumer and checked at the boundary, naming the round, the client, the strategy and the field."""
from __future__ import annotations

import numpy as np
import pytest

from fedsap_ray import algorithms, results
from fedsap_ray.algorithms.aggregation import scatter
from fedsap_ray.config import build_config
from fedsap_ray.data import build_federation
from fedsap_ray.experiment import run_experiment
from fedsap_ray.common.messages import ClientPlan, ClientResult, check_results
from fedsap_ray.results.recorder import Recorder
from fedsap_ray.runtime.local import LocalBackend
from tests.conftest import tiny_overrides

BASE = ["data.num_clients=4", "training.rounds=2", "training.eval_deployed=false"]


@pytest.fixture(scope="module")
def fed(single_thread):
    return build_federation(build_config(preset="smoke", overrides=tiny_overrides("fedavg", *BASE)))


@pytest.mark.parametrize("name", algorithms.names())
def test_a_per_client_metric_written_as_the_guide_says_runs_on_every_strategy(name, fed, tmp_path, monkeypatch):
    """A metric added in the recorder (docs/guides/development.md: a core column is "written by the recorder",
    ``Recorder._clients_rows``) that reads each result's values at its own coordinates: the L2 norm of the
    trainable values a client uploaded. Before the contract, one built from the plan's mask crashed every DapperFL
    run (its hook uploads the pruned model). It must compute for every client of every strategy, and agree with
    the same norm taken on the full-size vector the result describes."""
    seen: list[tuple[ClientPlan, ClientResult]] = []
    inner = Recorder._clients_rows

    def with_metric(self, t, plans, results_, records, sim):
        rows = inner(self, t, plans, results_, records, sim)
        trainable = self.ctx.trainable
        for r in results_:
            at = trainable if r.mask is None else trainable[r.mask]  # the result's own coordinates
            norm = float(np.linalg.norm(r.values[at].astype(np.float64)))
            full = scatter(r.values, r.mask, trainable.size)
            covered = trainable if r.mask is None else trainable & r.mask
            assert norm == pytest.approx(float(np.linalg.norm(full[covered].astype(np.float64))), rel=1e-12)
            seen.append((plans[r.client_id], r))
        return rows

    monkeypatch.setattr(Recorder, "_clients_rows", with_metric)
    cfg = build_config(preset="smoke", overrides=tiny_overrides(name, *BASE))
    outcome = run_experiment(cfg, tmp_path, run_id="m", federation=fed)
    assert outcome.status == "finished", results.load(tmp_path).runs["error"].tolist()
    assert seen
    own = [(p, r) for p, r in seen if r.mask is not p.mask]
    if name == "dapperfl":  # the case that crashed: its hook chose the upload coordinates
        assert own and all(p.mask is None and r.mask is not None for p, r in own)
    else:
        assert not own  # every other strategy uploads its plan's coordinates: the plan's own mask object


def _plan(mask):
    return ClientPlan(client_id=3, round=2, params=np.zeros(mask.size if mask is not None else 5, np.float32), mask=mask,
                      local_epochs=1, batch_size=2, lr=0.1)


def test_the_boundary_check_names_round_client_strategy_and_field():
    mask = np.array([True, False, True, True, False])
    plan = _plan(mask)
    ok = ClientResult(client_id=3, round=2, values=np.ones(3, np.float32), n_samples=1, train_loss=0.1, mask=mask)
    check_results({3: plan}, [ok], "FedAvg")
    short = ClientResult(client_id=3, round=2, values=np.ones(2, np.float32), n_samples=1, train_loss=0.1, mask=mask)
    with pytest.raises(ValueError, match=r"round 2, client 3 \(FedAvg\): ClientResult.values holds 2 values but "
                                         r"ClientResult.mask covers 3 coordinates"):
        check_results({3: plan}, [short], "FedAvg")
    full = ClientResult(client_id=3, round=2, values=np.ones(3, np.float32), n_samples=1, train_loss=0.1)
    with pytest.raises(ValueError, match=r"client 3 \(DapperFL\): ClientResult.values holds 3 values but "
                                         r"ClientResult.mask is None \(every coordinate: 5\)"):
        check_results({3: plan}, [full], "DapperFL")
    wrong = ClientResult(client_id=3, round=2, values=np.ones(3, np.float32), n_samples=1, train_loss=0.1,
                         mask=np.ones(7, bool))
    with pytest.raises(ValueError, match=r"ClientResult.mask must be a bool vector of the model's 5 coordinates"):
        check_results({3: plan}, [wrong], "FedAvg")
    with pytest.raises(ValueError, match="no plan this round"):
        check_results({}, [ok], "FedAvg")


def test_a_run_whose_result_disagrees_with_its_coordinates_fails_naming_the_field(fed, tmp_path, monkeypatch):
    """The check runs in every round (Server.round): a backend that returns one value too few stops the run, and
    the runs table's error names the client, the strategy and the field."""
    inner = LocalBackend.train

    def short(self, plans):
        out = inner(self, plans)
        out[0].values = out[0].values[:-1]
        return out

    monkeypatch.setattr(LocalBackend, "train", short)
    cfg = build_config(preset="smoke", overrides=tiny_overrides("heterofl", *BASE))
    with pytest.raises(ValueError, match=r"round 1, client 0 \(HeteroFL\): ClientResult.values holds \d+ values but "
                                         r"ClientResult.mask"):
        run_experiment(cfg, tmp_path, run_id="bad", federation=fed)
    runs = results.load(tmp_path).runs
    assert runs["status"].tolist() == ["failed"] and "ClientResult.mask" in runs["error"].iloc[0]
