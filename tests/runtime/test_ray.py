"""Ray backend: same numbers as local, worker death recovery, client errors, GPU pinning."""
from __future__ import annotations

import json

import pandas as pd
import pytest

ray = pytest.importorskip("ray")

from fedsap_ray import algorithms, results  # noqa: E402
from fedsap_ray.engine.client import ClientError  # noqa: E402
from fedsap_ray.config import build_config  # noqa: E402
from fedsap_ray.data import DomainData, build_federation  # noqa: E402
from fedsap_ray.experiment import run_experiment  # noqa: E402
from fedsap_ray.runtime.allocator import tune_malloc  # noqa: E402
from tests.conftest import LOCAL_RUNS, backend_fixtures, make_strategy  # noqa: E402

TINY = ["algorithm.name=fedavg", "data.num_clients=6", "data.max_test_per_domain=40", "model.width_mult=0.0625", "training.rounds=3",
        "training.local_epochs=1", "training.batch_size=16", "training.max_steps_per_epoch=4",
        "algorithm.width=capacity"]
VOLATILE = [*results.WALL_CLOCK, "worker", "gpu_id", "node"]


# the session's local Ray (tests/conftest.py: 2 CPUs, 2 logical GPUs, namespace fedsap-tests), shared with the
# in-process smoke sweeps
pytestmark = pytest.mark.usefixtures("session_ray")


fed, local_run = backend_fixtures(TINY)


def _ray(out, fed, extra=(), **kw):
    cfg = build_config(preset="smoke", overrides=TINY + ["resources.backend=ray", *extra])
    return run_experiment(cfg, out, run_id="x", federation=fed, **kw)


def _same(a, b):
    key = ["round", "domain"]
    pd.testing.assert_frame_equal(a.rounds.drop(columns=VOLATILE, errors="ignore").sort_values(key).reset_index(drop=True),
                                  b.rounds.drop(columns=VOLATILE, errors="ignore").sort_values(key).reset_index(drop=True))
    key = ["round", "client_id"]
    pd.testing.assert_frame_equal(a.clients.drop(columns=VOLATILE, errors="ignore").sort_values(key).reset_index(drop=True),
                                  b.clients.drop(columns=VOLATILE, errors="ignore").sort_values(key).reset_index(drop=True))


@pytest.mark.parametrize("workers", [2, 3])
def test_ray_reproduces_local_tables_exactly(tmp_path, fed, local_run, workers):
    outcome = _ray(tmp_path, fed, [f"resources.num_workers={workers}", "resources.cpus_per_worker=0.5"])
    assert outcome.status == "finished"
    res = results.load(tmp_path)
    _same(local_run, res)
    assert res.runs.loc[0, "backend"] == "ray"
    assert res.clients["worker"].nunique() == workers  # clients really were spread over the workers
    # what the backend moved (issue 42): each worker receives one copy of the round's vector and of each distinct
    # packed mask it needs, beside the plans' own small parts; one copy of the covered values per client before
    size = make_strategy(build_config(preset="smoke", overrides=TINY), fed)[0].layout.size
    widths = len({c.capacity for c in fed.clients})
    down = res.rounds.groupby("round")["backend_bytes_down"].first()
    assert (down > 4 * size).all() and (down <= workers * (4 * size + widths * (size + 7) // 8) + 4096 * len(fed.clients)).all()
    assert (res.rounds["backend_bytes_up"] > 0).all() and (local_run.rounds["backend_bytes_down"] == 0).all()
    # the kept final model and the clients' deployed parts (issue 53): the local run's, byte for byte (the JSON files
    # name the backend in their stored config, so their tensors' digests are compared)
    local = LOCAL_RUNS[tuple(TINY)] / "models" / "x"
    for name in ("final.safetensors", "final.deployed.safetensors"):
        assert (tmp_path / "models" / "x" / name).read_bytes() == (local / name).read_bytes(), name
    for name in ("final.json", "final.deployed.json"):
        ray_meta, local_meta = (json.loads((d / name).read_text()) for d in (tmp_path / "models" / "x", local))
        assert ray_meta["tensors_digest"] == local_meta["tensors_digest"] and ray_meta["round"] == local_meta["round"]


def test_async_mode_on_ray_reproduces_local_tables(tmp_path, fed):
    """devices.mode=async (issue 44): the clients started at one simulated instant go to the pool together and
    the event queue orders arrivals by simulated time, so two Ray workers give the local backend's tables. Run
    private (issue 57), which adds only server-side work to every step (clipping, the noise drawn from the run's
    seed and step, adaptive C), so the one case checks both."""
    privacy = ["privacy.mode=central", "privacy.target_epsilon=8", "privacy.clipping=adaptive", "privacy.count_noise=5"]
    extra = ["devices.mode=async", "asynchronous.concurrency=4", "asynchronous.buffer_size=2",
             "asynchronous.staleness=polynomial", *privacy]
    run_experiment(build_config(preset="smoke", overrides=[*TINY, *extra]), tmp_path / "local", run_id="x",
                   federation=fed)
    outcome = _ray(tmp_path / "ray", fed, ["resources.num_workers=2", "resources.cpus_per_worker=0.5", *extra])
    assert outcome.status == "finished"
    local, remote = results.load(tmp_path / "local"), results.load(tmp_path / "ray")
    assert remote.clients["staleness"].max() > 0  # stale updates were applied
    _same(local, remote)
    assert remote.rounds["dp_epsilon"].max() <= 8 and remote.rounds["dp_clip_norm"].nunique() > 1


def test_worker_killed_mid_round_is_replaced(tmp_path, fed, local_run):
    killed = {}

    def worker0_names() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("-w0")}

    earlier = worker0_names()  # pools of earlier tests may still be listed while their kill completes

    def kill_a_worker_during_round_2(summary):
        """Kill worker 0 as round 1 ends: ray.kill is asynchronous, so round 2's first plans go to a dying
        worker (in flight or refused), whichever way the timing falls."""
        if summary.round != 1:
            return
        names = sorted(worker0_names() - earlier)
        actor = ray.get_actor(names[0], namespace="fedsap-tests")
        killed["malloc_tuned"] = ray.get(actor.info.remote()).malloc_tuned  # fedsap_ray.runtime.allocator
        ray.kill(actor)
        killed["name"] = names[0]

    outcome = _ray(tmp_path, fed, ["resources.num_workers=2", "resources.cpus_per_worker=0.5"],
                   progress=kill_a_worker_during_round_2)
    assert killed and outcome.worker_restarts >= 1
    assert killed["malloc_tuned"] is (tune_malloc() is not None)  # as this process, whose environment it inherits
    _same(local_run, results.load(tmp_path))


def test_client_error_names_round_and_client(tmp_path):
    cfg = build_config(preset="smoke", overrides=TINY)
    broken = build_federation(cfg)
    c = broken.clients[2]
    pool = broken.train[c.domain]
    y = pool.y.clone()  # the loaded splits are cached per process: never mutate them
    y[c.indices[:3]] = 99  # labels outside the 10 classes: cross-entropy raises
    broken.train = {**broken.train, c.domain: DomainData(pool.x, y)}
    with pytest.raises(ClientError, match="client 2 failed in round 1"):
        _ray(tmp_path, broken, ["resources.num_workers=2", "resources.cpus_per_worker=0.5"])
    assert results.load(tmp_path).runs.loc[0, "status"] == "failed"


def test_gpu_pinning_four_workers_two_per_logical_gpu(tmp_path, fed):
    from fedsap_ray.runtime.ray import pool_size

    cfg = build_config(preset="smoke", overrides=TINY + ["resources.backend=ray", "resources.gpus_per_worker=0.5",
                                                         "resources.cpus_per_worker=0.5", "data.num_clients=4"])
    assert pool_size(cfg, 4) == 4
    assert pool_size(cfg, 100, {"CPU": 64.0, "GPU": 2.0}) == 4  # GPUs bound the pool
    assert pool_size(cfg, 3, {"CPU": 64.0, "GPU": 2.0}) == 3  # never more workers than clients
    fed4 = build_federation(cfg)
    run_experiment(cfg, tmp_path, run_id="g", federation=fed4)
    clients = results.load(tmp_path).clients
    per_worker = clients.groupby("worker")["gpu_id"].unique()
    assert len(per_worker) == 4 and all(len(g) == 1 for g in per_worker)  # each worker sees one GPU id
    workers_per_gpu = clients.drop_duplicates("worker").groupby("gpu_id")["worker"].count()
    assert workers_per_gpu.to_dict() == {0: 2, 1: 2}


# Options that make a short run reach a strategy's server-held state (regrouping, adaptation); every other
# registered strategy runs two rounds of its defaults. "fedsap-probe" adds FedSAP's probe-gradient DGA.
SCHEDULES = {
    "fedsap": ["algorithm.warmup=1", "algorithm.regroup_every=1"],
    "random_budget": ["algorithm.warmup=1", "algorithm.t_adapt=1"],
}
# FedSAP with the paper's DGA signal (its default is the probe); FedAvg with simulated stragglers (issue 28:
# over-selection leaves one of four sampled clients out of every round, by jittered device time)
VARIANTS = {"fedsap-train": ["algorithm.name=fedsap", *SCHEDULES["fedsap"], "algorithm.dga_source=train"],
            "fedavg-stragglers": ["algorithm.name=fedavg", "training.rounds=2", "training.participation=0.5",
                                  "devices.policy=over_select", "devices.jitter=0.5"],
            # the authors'-code readings whose plans carry client hooks of their own (docs/readings.md)
            "heterofl-authors": ["algorithm.name=heterofl", "training.rounds=2", "algorithm.weighting=count",
                                 "algorithm.label_mask=true"],
            "fjord-authors": ["algorithm.name=fjord", "training.rounds=2", "algorithm.od_sampling=batch",
                              "algorithm.od_bn=per_width"]}


PRIVATE_FEDAVG = ["privacy.mode=central", "privacy.noise_multiplier=0.8", "privacy.clip_norm=0.5",
                  "privacy.denominator=coverage"]


def strategy_cases() -> dict[str, list[str]]:
    """Every registered strategy (the registry, not a list kept here) and the variants above."""
    cases = {name: [f"algorithm.name={name}", *SCHEDULES.get(name, ["training.rounds=2"])]
             for name in algorithms.names()}
    # FedAvg's case runs private (issue 57: clipping, the noise from the seed and round, the coverage denominator),
    # which adds only server-side work: the non-private FedAvg on Ray is test_ray_reproduces_local_tables_exactly's
    cases["fedavg"] += PRIVATE_FEDAVG
    return {**cases, **VARIANTS}


CASES = strategy_cases()
READING_HOOKS = {"heterofl-authors": "heterofl_label_mask", "fjord-authors": "fjord_batch_widths"}


@pytest.fixture(scope="module")
def covered_by(fed) -> dict[str, str]:
    """Registered strategy -> an earlier one (registry order) whose round-1 plans carry every client hook its own
    plans carry.

    What differs between the backends is only the client side: plans and results crossing a process
    boundary and the plan's hooks running in a worker, each hook on its own payload. A strategy whose hooks all
    crossed with an earlier strategy's (or that carries none, like an earlier one: the mask-only methods) takes
    no path there that the earlier one did not, so it would add a Ray start and no coverage; the variants always
    run."""
    base = [o for o in TINY if not o.startswith("algorithm.")]
    seen: dict[frozenset[str], str] = {}
    out = {}
    for name in algorithms.names():
        strat = make_strategy(build_config(preset="smoke", overrides=base + CASES[name]), fed)[1]
        hooks = frozenset(h.name for p in strat.configure_round(strat.init_state(), 1).values() for h in p.hooks)
        earlier = next((other for carried, other in seen.items() if hooks <= carried and (hooks or not carried)), None)
        if earlier is not None:
            out[name] = earlier
        else:
            seen[hooks] = name
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_strategy_runs_on_ray_with_the_same_numbers(tmp_path, fed, name, covered_by):
    if name in covered_by:
        pytest.skip(f"its plans carry no client hook that {covered_by[name]}'s do not, whose Ray case covers them")
    extra = CASES[name]
    base = [o for o in TINY if not o.startswith("algorithm.")]
    cfg_local = build_config(preset="smoke", overrides=base + extra)
    if name in READING_HOOKS:  # the reading's own hook crosses the process boundary
        strat = make_strategy(cfg_local, fed)[1]
        assert READING_HOOKS[name] in {h.name for p in strat.configure_round(strat.init_state(), 1).values() for h in p.hooks}
    run_experiment(cfg_local, tmp_path / "local", run_id="f", federation=fed)
    cfg_ray = build_config(preset="smoke", overrides=base + extra + ["resources.backend=ray",
                                                                     "resources.num_workers=2",
                                                                     "resources.cpus_per_worker=0.5"])
    run_experiment(cfg_ray, tmp_path / "ray", run_id="f", federation=fed)
    a, b = results.load(tmp_path / "local"), results.load(tmp_path / "ray")
    _same(a, b)
    if name == "fedavg-stragglers":
        assert a.clients["straggler"].sum() == 2  # one a round, on both backends (the tables are equal)
    pd.testing.assert_frame_equal(a.layers, b.layers)
    pd.testing.assert_frame_equal(a.allocations, b.allocations)


def test_workers_of_the_projects_ray_run_at_niceness_zero(monkeypatch):
    """Ray starts worker processes at niceness 15; at 15 anything else on the node takes the cores from the client
    workers (fedsap_ray.runtime.ray.SYSTEM_CONFIG, measured there). connect() starts a local Ray with that config,
    and a worker of a Ray started with it (the session's, tests/conftest.py) runs at the niceness of the process
    that started it (0 unless the suite itself runs under nice)."""
    import os

    from fedsap_ray.runtime import ray as fray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)  # the driver's (the raylet's): not raised by 15 (19 at most)
    seen: dict = {}
    monkeypatch.setattr(fray.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(fray.ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(fray.reaper, "start", lambda: None)
    fray.connect(address="local")
    assert seen["_system_config"]["worker_niceness"] == 0
