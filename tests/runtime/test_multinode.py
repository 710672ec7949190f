"""The Ray backend on a cluster of several nodes, all on this machine (issue 29).

``ray.cluster_utils.Cluster`` starts a head and further nodes as separate raylets, each with its own
logical CPUs and GPU and its own node-local data cache folder (``FEDSAP_RAY_CACHE`` in that raylet's
environment, which its workers inherit), dashboard off: how Ray tests itself. The nodes listen on the
address Ray picks for this machine, not 127.0.0.1: a driver that joins ``127.0.0.1:PORT`` has it
rewritten to that address by Ray (``resolve_ip_for_localhost``), so a loopback-only cluster cannot be
joined by address. Nothing leaves the machine either way.

Four nodes of one CPU each and three workers of one CPU: the workers land on three different nodes
(which three is Ray's choice), and the fourth is where a lost worker's replacement can start.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from fedsap_ray import results  # noqa: E402
from fedsap_ray.config import build_config  # noqa: E402
from fedsap_ray.experiment import run_experiment  # noqa: E402
from fedsap_ray.run.progress import ProgressPrinter  # noqa: E402
from tests.conftest import backend_fixtures, stop_session_ray  # noqa: E402

TINY = ["algorithm.name=fedavg", "data.num_clients=6", "data.max_test_per_domain=40", "model.width_mult=0.0625",
        "training.rounds=3", "training.local_epochs=1", "training.batch_size=16", "training.max_steps_per_epoch=3",
        "algorithm.width=capacity"]
ON_CLUSTER = ["resources.num_workers=3", "resources.cpus_per_worker=1"]
NODES = ("head", "n1", "n2", "spare")
PLACEMENT = [*results.WALL_CLOCK, "worker", "gpu_id", "node"]
ABLATION_VARIANTS = ("full", "no-dga", "no-sgp", "uniform-budget", "fedavg-het")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    stop_session_ray()  # this driver joins the cluster; the session's local Ray starts again when next needed
    caches = tmp_path_factory.mktemp("node-caches")
    env = {name: {"FEDSAP_RAY_CACHE": str(caches / name)} for name in NODES}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 1, "include_dashboard": False,
                                                      "env_vars": env["head"]})
    c.caches = caches
    c.workers_nodes = {name: c.add_node(num_cpus=1, num_gpus=1, env_vars=env[name]) for name in NODES[1:]}
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, namespace="fedsap-multinode")
    yield c
    ray.shutdown()
    c.shutdown()


fed, local_run = backend_fixtures(TINY)


def _same(a, b) -> None:
    for name, key in (("rounds", ["round", "eval_mode", "domain"]), ("clients", ["round", "client_id"])):
        x, y = (getattr(r, name).drop(columns=PLACEMENT, errors="ignore").sort_values(key).reset_index(drop=True)
                for r in (a, b))
        pd.testing.assert_frame_equal(x, y)


def test_a_cli_run_spreads_its_workers_over_the_nodes_and_equals_the_local_run(cluster, local_run, tmp_path):
    out = tmp_path / "out"
    sets = [a for o in [*TINY, *ON_CLUSTER] for a in ("--set", o)]
    proc = subprocess.run([sys.executable, "-m", "fedsap_ray.cli", "run", "--preset", "smoke", "--backend", "ray",
                           "--address", cluster.address, "--out", str(out), "--run-id", "x", "--quiet", *sets],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = results.load(out)
    nodes = set(res.clients["node"])
    alive = {n["NodeID"][:12] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 3 and nodes <= alive  # one worker on each of three nodes
    _same(local_run, res)
    # the results are the driver's: every table in --out, nothing written into the nodes' own folders
    assert {p.name for p in out.iterdir()} >= {"runs", "rounds", "clients", "allocations"}
    assert not list(Path(cluster.caches).rglob("*.parquet"))


def test_a_node_lost_mid_run_costs_no_number_and_is_named(cluster, fed, local_run, tmp_path):
    lost: dict[str, str] = {}
    head = cluster.head_node.node_id[:12]
    by_id = {n.node_id[:12]: n for n in cluster.workers_nodes.values()}
    lines = io.StringIO()
    printer = ProgressPrinter(3, stream=lines)

    def remove_a_worker_node_after_round_1(summary):
        printer(summary)
        if summary.round != 1:
            return
        used = set(results.load(tmp_path).clients["node"]) - {head}
        node = sorted(used)[0]
        cluster.remove_node(by_id[node])  # its raylet and every worker on it die now
        lost["node"] = node

    cfg = build_config(preset="smoke", overrides=[*TINY, "resources.backend=ray", *ON_CLUSTER])
    outcome = run_experiment(cfg, tmp_path, run_id="x", federation=fed, progress=remove_a_worker_node_after_round_1)
    assert lost and outcome.worker_restarts >= 1
    res = results.load(tmp_path)
    _same(local_run, res)
    assert lost["node"] not in set(res.clients.loc[res.clients["round"] > 1, "node"])
    shown = lines.getvalue().splitlines()
    assert f"node {lost['node']} lost" in shown[1] and "replaced" in shown[1]  # round 2 names the lost node
    assert "lost" not in shown[0] and "lost" not in shown[2]


def test_a_sweep_spreads_its_trials_builds_data_once_per_node_and_resumes_after_its_driver_is_killed(cluster, tmp_path):
    """``sweeps/ablation.py --smoke-test --address``: more trials than live nodes, so some node runs two and
    must still build the node cache once; each trial's client worker sits in the trial's placement group (a
    trial is one node's CPU: the trial and its worker); the driver is killed mid-sweep and ``--resume``
    completes it."""
    import json

    from fedsap_ray.data import node_cache
    from tests.conftest import REPO, check_complete, run_study, sweep_statuses, wait_part_way

    alive = {n["NodeID"][:12] for n in ray.nodes() if n["Alive"]}
    names = {cluster.head_node.node_id[:12]: "head", **{n.node_id[:12]: k for k, n in cluster.workers_nodes.items()}}
    variants = list(ABLATION_VARIANTS)[:len(alive) + 1]
    out = tmp_path / "out"
    args = ["--smoke-test", "--address", cluster.address, "--out", str(out), "--max-concurrent", "2",
            "--set", "training.rounds=5", "--set", "data.num_clients=4", "--variants", *variants]
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(REPO / "sweeps" / "ablation.py"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_part_way(proc, out)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver: its trials on the nodes end with it (Ray's job cleanup)
    finally:
        proc.wait()
    before = sweep_statuses(out)
    assert "finished" in before.values() and set(before.values()) != {"finished"}
    resumed = run_study("ablation", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"{list(before.values()).count('finished')} finished earlier" in resumed.stderr
    res = check_complete(out, {f"{v}-s0" for v in variants}, 5)
    runs_on = res.clients.groupby("node")["run_id"].nunique()
    assert set(runs_on.index) <= alive and len(runs_on) >= 2  # spread over the nodes
    assert runs_on.max() >= 2  # more trials than nodes: some node ran two
    for node in runs_on.index:  # each node that ran trials built the dataset once, however many it ran
        builds = node_cache.node_cache_builds(Path(cluster.caches) / names[node] / "node_splits")
        assert list(builds.values()) == [1], (names[node], builds)
    # every round of the resumed sweep's trials reported its ClientWorker inside the trial's own placement
    # group (Tune's per-round results; the resumed invocation's Tune folder holds the trials it ran)
    reports = [json.loads(line) for f in (out / "_tune" / "ablation").glob("*/result.json")
               for line in f.read_text().splitlines() if line.strip()]
    resumed_ids = {k for k, v in before.items() if v != "finished"} | ({f"{v}-s0" for v in variants} - set(before))
    assert resumed_ids <= {r["run_id"] for r in reports} <= {f"{v}-s0" for v in variants}
    assert all(r["workers_in_trial_placement_group"] is True for r in reports)
