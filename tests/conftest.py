"""Shared fixtures and helpers: where the real data files are, small configs for fast runs, in-process
round loops, and the end-to-end "runs finish and are deterministic" checks."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedsap_ray import algorithms, results
from fedsap_ray.config import ConfigError, build_config
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import DomainData
from fedsap_ray.experiment import build_context, run_experiment
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import check_results
from fedsap_ray.models import build_model
from fedsap_ray.runtime.local import LocalBackend

REPO = Path(__file__).resolve().parents[1]

# The suite's two tiers (docs/guides/development.md#tests-and-ci). The fast tier, `python -m pytest -q`, is
# every unit and in-process test; the integration tier, `python -m pytest -q -m integration`, is what starts
# Ray, a sweep, a cluster, a notebook kernel, the documented commands or the CLI as a subprocess. The rule
# lives here, in one place: a module listed below, or any test that uses a fixture listed below.
INTEGRATION_MODULES = frozenset({
    "tests/analysis/test_notebooks.py",  # notebook kernels on the smoke sweeps' folders
    "tests/docs/test_doc_commands.py",  # every documented command
    "tests/runtime/test_ray.py", "tests/runtime/test_multinode.py", "tests/runtime/test_gpu.py",  # Ray
    "tests/runtime/test_reaper.py",  # killed drivers and their process groups
    "tests/sweeps/test_sweeps.py", "tests/sweeps/test_mask_stability_study.py",  # study scripts under Tune
    "tests/test_cli_subprocess.py",  # the console script as a subprocess, a Ray run from the command line
    # the fast tier's budget (5 min on 2 cores) bought back by slow suites that are not unit tests: the
    # results-folder fuzz harness (hundreds of hostile folders, ~23 s) and the checks on the real data files (~13 s)
    # (issue 53); the golden tool recording and checking a run end to end and as a script (~13 s), and the node
    # cache's processes sharing one entry (~16 s; its tampering cases also run in tests/data/test_cache_tamper.py)
    # (issue 55, whose equivalence tests joined the fast tier)
    "tests/results/test_folder_fuzz.py", "tests/data/test_data_real.py", "tests/dev/test_golden.py", "tests/data/test_node_cache.py",
    # Inductor's first compile of a process (tens of seconds cold on 2 loaded cores): resources.compile's own
    # numbers; its mechanics stay in the fast tier under Dynamo's eager backend (issue 56)
    "tests/runtime/test_compiled_ray.py",
    "tests/engine/test_compile_cache_runs.py",  # damaged Inductor cache entries rebuilt by a second process
})
INTEGRATION_FIXTURES = frozenset({"smoke_study"})


# The fast tier's longest modules (summed test time, in order), handed out first: pytest-xdist gives each worker one
# module at a time in collection order (``--dist loadfile --no-loadscope-reorder``, pyproject.toml), so a long module
# collected last would leave the other worker idle at the end. A stale list costs only balance, never a test.
LONGEST_FIRST = ("tests/algorithms/fedsap/test_fedsap_motion.py", "tests/data/test_devices.py",
                 "tests/engine/test_deployed_eval.py", "tests/test_run.py", "tests/engine/test_asyncmode_resume.py",
                 "tests/persist/test_checkpoint_safety.py", "tests/data/test_data_embedded.py",
                 "tests/models/test_sliced.py", "tests/results/test_results_store.py", "tests/engine/test_asyncmode.py")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the integration tier (above); the default ``-m "not integration"`` (pyproject.toml) leaves it out. Then
    order the modules for the xdist workers: :data:`LONGEST_FIRST`, then the rest by their number of tests, most
    first (each module's tests keep their order)."""
    mark = pytest.mark.integration
    rels = {}
    for item in items:
        rel = rels.setdefault(item, Path(str(item.fspath)).resolve().relative_to(REPO).as_posix())
        if rel in INTEGRATION_MODULES or INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(mark)
    if not getattr(config.option, "numprocesses", None):  # one process (-n 0, the integration tier): order as written
        return
    count = collections.Counter(rels.values())
    rank = {rel: i for i, rel in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(rels[item], len(rank)), -count[rels[item]], rels[item]))


SHARED_DATA = Path(os.environ.get("FEDSAP_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return SHARED_DATA


def shared_file(rel: str) -> Path:
    """Path of a file under ../shared/data, skipping the test (with the reason) when it is absent."""
    p = SHARED_DATA / rel
    if not p.exists():
        pytest.skip(f"real data file not found at {p} (set FEDSAP_SHARED_DATA to the folder holding it)")
    return p


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models: one intra-op thread avoids OpenMP spin-waits on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY_BASE = ["data.max_test_per_domain=40", "model.width_mult=0.0625", "training.local_epochs=1",
             "training.batch_size=16", "training.max_steps_per_epoch=3"]


def tiny_overrides(algorithm: str, *extra: str) -> list[str]:
    """Overrides of a tiny, fast config of ``algorithm`` on the smoke preset; ``extra`` comes last, so it wins."""
    return [f"algorithm.name={algorithm}", *TINY_BASE, *extra]


def federation_fixture(overrides, name: str = "fed", preset: str = "smoke"):
    """A module-scoped fixture called ``name`` holding the federation of ``overrides`` (built once per module,
    with one torch thread); a test module binds it at top level: ``fed = federation_fixture(TINY)``."""
    @pytest.fixture(scope="module", name=name)
    def _federation(single_thread):
        return build_federation(build_config(preset=preset, overrides=list(overrides)))

    return _federation


#: overrides -> the folder of ``backend_fixtures``' local run (run id ``x``), for a test that compares files with it
#: (the kept models of a Ray run equal the local run's byte for byte: tests/runtime/test_ray.py)
LOCAL_RUNS: dict[tuple[str, ...], Path] = {}


def backend_fixtures(overrides):
    """``(fed, local_run)``, module-scoped fixtures for the backend tests (a Ray module binds both at top level:
    ``fed, local_run = backend_fixtures(TINY)``): the federation of ``overrides`` on the smoke preset, and the
    local backend's tables of one run on it, the reference a Ray run must equal (its folder: :data:`LOCAL_RUNS`)."""
    @pytest.fixture(scope="module", name="fed")
    def _fed():
        return build_federation(build_config(preset="smoke", overrides=list(overrides)))

    @pytest.fixture(scope="module", name="local_run")
    def _local_run(tmp_path_factory, fed):
        out = tmp_path_factory.mktemp("local")
        run_experiment(build_config(preset="smoke", overrides=list(overrides)), out, run_id="x", federation=fed)
        LOCAL_RUNS[tuple(overrides)] = out
        return results.load(out)

    return _fed, _local_run


def make_strategy(cfg, fed):
    """(RunContext, Strategy) for ``cfg`` on a prebuilt federation, without a backend."""
    ctx = build_context(cfg, fed)
    return ctx, algorithms.get(cfg.algorithm.name)(ctx, cfg.algorithm.opts)


def aggregate(strat, state, results, t):
    """``strat.aggregate`` on hand-made ``results``, with the plans ``configure_round(state, t)`` gives their
    clients (the RoundOutput)."""
    plans = strat.configure_round(state, t)
    missing = {r.client_id for r in results} - set(plans)
    assert not missing, f"clients {sorted(missing)} are not sampled in round {t}"
    check_results(plans, results, type(strat).__name__)  # hand-made results keep the contract too (messages.py)
    return strat.aggregate(state, {r.client_id: plans[r.client_id] for r in results}, results, t)


def run_rounds_with_records(cfg, fed, rounds):
    """Run the strategy in-process for ``rounds`` rounds; return (ctx, strategy, states, plans, results, records):
    states[0] initial and states[t] after round t; plans[t - 1], results[t - 1] and records[t - 1] are round t's
    plan dict, the clients' results in the order the backend returned them (the order aggregate saw) and the
    RoundRecords aggregate returned."""
    ctx, strat = make_strategy(cfg, fed)
    backend = LocalBackend("cpu", num_workers=1)
    backend.start(ctx)
    states, plans, outs, records = [strat.init_state()], [], [], []
    try:
        for t in range(1, rounds + 1):
            plans.append(strat.configure_round(states[-1], t))
            outs.append(backend.train(plans[-1]))
            out = strat.aggregate(states[-1], plans[-1], outs[-1], t)
            states.append(out.state)
            records.append(out.records)
    finally:
        backend.close()
    return ctx, strat, states, plans, outs, records


def run_rounds_with_plans(cfg, fed, rounds):
    """:func:`run_rounds_with_records` without the records: (ctx, strategy, states, plans, results)."""
    ctx, strat, states, plans, outs, _ = run_rounds_with_records(cfg, fed, rounds)
    return ctx, strat, states, plans, outs


def run_rounds(cfg, fed, rounds):
    """Run the strategy in-process; return (ctx, strat, states): states[0] initial, states[t] after round t."""
    ctx, strat, states, _, _ = run_rounds_with_plans(cfg, fed, rounds)
    return ctx, strat, states


def tiny_mlp(seed: int = 0) -> tuple[torch.nn.Module, ParamLayout, DomainData]:
    """A seeded 6-input, 3-class MLP at width 1/32, its layout, and 12 seeded samples for client-side tests."""
    torch.manual_seed(seed)
    model = build_model("mlp", num_classes=3, input_shape=(6,), width_mult=1 / 32)
    g = torch.Generator().manual_seed(seed)
    data = DomainData(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g))
    return model, ParamLayout.from_model(model), data


def assert_options_rejected(base_overrides, *bad: str, preset: str = "smoke") -> None:
    """Every override in ``bad`` (``"algorithm.tau=0"``), added to ``base_overrides``, is a ConfigError
    whose message names the option (``algorithm.tau``)."""
    for override in bad:
        key = override.split("=", 1)[0]
        with pytest.raises(ConfigError, match=re.escape(key)):
            build_config(preset=preset, overrides=[*base_overrides, override])


# --- end-to-end runs ----------------------------------------------------------------------------
E2E_BASE = ["model.width_mult=0.0625", "data.max_test_per_domain=40", "training.max_steps_per_epoch=3",
            "training.rounds=2"]


def e2e_overrides(algorithm: str, *extra: str) -> list[str]:
    """Overrides of a small two-round end-to-end run of ``algorithm`` on the smoke preset, plus ``extra``."""
    return [f"algorithm.name={algorithm}", *E2E_BASE, *extra]


def run_twice(overrides, tmp_path: Path, federation=None, *, run_id: str = "r", preset: str = "smoke"):
    """Build the config from ``overrides``, run it with run_experiment into ``tmp_path / "a"`` and
    ``tmp_path / "b"`` on the same federation (``federation``, or one built from the config), check that
    both runs finished with a finite final global accuracy, and return their loaded (Results, Results)."""
    cfg = build_config(preset=preset, overrides=list(overrides))
    fed = federation if federation is not None else build_federation(cfg)
    loaded = []
    for name in ("a", "b"):
        outcome = run_experiment(cfg, tmp_path / name, run_id=run_id, federation=fed)
        assert outcome.status == "finished", outcome
        assert np.isfinite(outcome.final_global_accuracy), outcome
        loaded.append(results.load(tmp_path / name))
    return loaded[0], loaded[1]


def two_runs_fixture(overrides, name: str = "two_runs"):
    """A module-scoped fixture called ``name`` holding ``run_twice(overrides, <fresh folder>)``, for modules
    whose tests share one pair of runs: ``two_runs = two_runs_fixture(E2E)``."""
    @pytest.fixture(scope="module", name=name)
    def _two_runs(tmp_path_factory, single_thread):
        return run_twice(overrides, tmp_path_factory.mktemp(name))

    return _two_runs


def global_rows(res) -> pd.DataFrame:
    """The ``rounds`` rows of the global (all-domain) evaluation of the strategy's own models (the
    ``deployed`` rows, one more per evaluated round, are left out)."""
    r = res.rounds
    return r[(r.domain == results.GLOBAL_DOMAIN) & (r.eval_mode != "deployed")]


def assert_finite_global_accuracy(res, rounds: int) -> None:
    """One global row per round, each with a finite accuracy."""
    acc = global_rows(res)["accuracy"].to_numpy(dtype=float)
    assert len(acc) == rounds and np.isfinite(acc).all(), acc


def assert_same_tables(a, b) -> None:
    """The ``rounds`` and ``clients`` tables of two runs are equal but for their wall-time columns."""
    pd.testing.assert_frame_equal(steady(a.rounds), steady(b.rounds))
    pd.testing.assert_frame_equal(steady(a.clients), steady(b.clients))


def steady(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without its wall-clock columns (results.WALL_CLOCK), the part two runs of one config share."""
    return df.drop(columns=[c for c in results.WALL_CLOCK if c in df.columns])


# --------------------------------------------------------------------------------------------------
# One local Ray for the session
# --------------------------------------------------------------------------------------------------
# The session's local Ray: a new one (address "local": never a cluster that RAY_ADDRESS or Ray's
# current-cluster file names), two logical CPUs and two logical GPUs (the GPU-pinning test), bound to
# 127.0.0.1, no dashboard, worker logs off the console, plans and results inline as
# fedsap_ray.runtime.ray.connect carries them, in its own namespace (a test finds the backend's named worker
# actors there).
SESSION_RAY = {"address": "local", "num_cpus": 2, "num_gpus": 2, "include_dashboard": False, "_node_ip_address": "127.0.0.1",
               "log_to_driver": False, "namespace": "fedsap-tests"}


@pytest.fixture(scope="session")
def _session_ray_owner():
    """Shuts the session's Ray down at the end of the session (if it is running then)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def session_ray(_session_ray_owner):
    """The session's one local Ray (:func:`start_session_ray`): every test that needs a local Ray of these
    arguments shares it (tests/runtime/test_ray.py, the in-process smoke sweeps), paying Ray's start-up (and
    its workers' imports) once. A module that needs Ray to itself (the four-node cluster,
    tests/runtime/test_multinode.py) shuts it down first (:func:`stop_session_ray`); the next test that asks
    for it starts it again."""
    return start_session_ray()


def start_session_ray():
    """Start the session's Ray (:data:`SESSION_RAY`) unless a Ray is running; return the ``ray`` module.

    Its workers import ``sweeps`` from this checkout (``PYTHONPATH``, as ``fedsap_ray.runtime.ray.connect``
    sets it for a sweep driver); no reaper watches it: this process ends it (``_session_ray_owner``)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        from fedsap_ray.runtime.ray import SYSTEM_CONFIG

        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [old])])  # the raylet's, its workers'
        try:
            ray.init(**SESSION_RAY, _system_config=SYSTEM_CONFIG)
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
    return ray


def stop_session_ray() -> None:
    """Shut down the session's Ray (if running) before a module starts a Ray of its own; :func:`session_ray`
    starts it again when a later test needs it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


# --------------------------------------------------------------------------------------------------
# Study scripts (sweeps/*.py): as users run them (a subprocess, its own local Ray), or their main() in this
# process on the session's Ray
# --------------------------------------------------------------------------------------------------


def run_study(study: str, *args: str, timeout: float = 900, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python sweeps/<study>.py ARGS`` from ``cwd`` (the repository root); returns the finished process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(REPO / "sweeps" / f"{study}.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def load_study(study: str):
    """The module of ``sweeps/<study>.py``, loaded from its file (as the scripts are run: not as a package)."""
    import importlib.util

    path = REPO / "sweeps" / f"{study}.py"
    spec = importlib.util.spec_from_file_location(f"sweep_{study}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_study_in_process(study: str, *args: str) -> subprocess.CompletedProcess:
    """``sweeps/<study>.py``'s ``main(ARGS)`` in this process, on the Ray already running here (the script's
    ``run_trials`` joins a running Ray and leaves it running); its stdout and stderr captured and returned,
    with its exit code, as a CompletedProcess like :func:`run_study`'s. Tune's SIGINT/SIGUSR1 handlers (it
    installs them in the main thread and leaves them) are put back afterwards."""
    import contextlib
    import io
    import signal

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGUSR1)}
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = load_study(study).main(list(args))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess([f"sweeps/{study}.py", *args], code, out.getvalue(), err.getvalue())


def sweep_statuses(out: Path) -> dict[str, str]:
    """run id -> status of every runs row in a sweep's folder that reads back now (one being replaced is skipped)."""
    import pyarrow.parquet as pq

    folder, found = out / "runs", {}
    for f in (folder.glob("*.parquet") if folder.is_dir() else []):
        try:
            found[f.stem] = pq.read_table(f).to_pylist()[0]["status"]
        except Exception:  # being replaced right now
            pass
    return found


def wait_part_way(proc: subprocess.Popen, out: Path, timeout: float = 600, finished: bool = True) -> None:
    """Return once one trial of the sweep writing ``out`` finished (unless ``finished=False``) and another
    is at round 1-3 of 5.

    At most round 3 of 5: the trial is still mid-way when a kill lands (a trial seen at round 4 or 5 could
    finish before Ray ends it, leaving nothing partial; the next trial is taken)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        st = sweep_statuses(out)
        done = [k for k, v in st.items() if v == "finished"]
        if (done or not finished) and any(v == "running" for v in st.values()):
            try:
                rounds = results.load(out).rounds
            except OSError:  # a rounds file listed, then replaced by its writer before it was read: look again
                time.sleep(0.2)
                continue
            mid = rounds[~rounds["run_id"].isin(done)]
            if len(mid) and 1 <= mid["round"].max() <= 3:
                return
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
        time.sleep(0.2)
    pytest.fail("the sweep did not get part-way in time")


def check_complete(out: Path, expected_ids: set[str], rounds: int) -> results.Results:
    """The sweep in ``out`` holds exactly one finished runs row per expected run and every round once."""
    res = results.load(out)
    assert set(res.runs["run_id"]) == expected_ids
    assert len(res.runs) == len(expected_ids)  # exactly one runs row per trial
    assert (res.runs["status"] == "finished").all(), res.runs[["run_id", "status", "error"]]
    key = ["run_id", "round", "domain", "eval_mode"]
    assert not res.rounds.duplicated(key).any()
    per_run = res.rounds.groupby("run_id")["round"].agg(["min", "max", "nunique"])
    assert (per_run["min"] == 1).all() and (per_run["max"] == rounds).all() and (per_run["nunique"] == rounds).all()
    return res


@pytest.fixture(scope="session")
def smoke_study(tmp_path_factory, _session_ray_owner):
    """``smoke_study(study)``: the results folder of ``sweeps/<study>.py --smoke-test``, run once per session
    (the sweep tests, the notebook tests and the documented commands read the same folders).

    Each study's ``main`` runs in this process on the session's Ray (:func:`start_session_ray`,
    :func:`run_study_in_process`): the same trials under Tune, the same folder and printed table, without
    an interpreter, torch and Ray start-up per study. The script run as users run it (a subprocess starting
    its own Ray, its exit code) is tested by tests/sweeps/test_sweeps.py (a failing trial, the Optuna study
    across invocations, a killed driver) and tests/runtime/test_multinode.py (a killed sweep resumed).

    Every study trains its clients in the trial process (``--workers-per-trial 0``, as the documented commands
    do in CI): the same numbers, without an actor start per trial (about 40% of a smoke sweep's time on 2
    cores). Worker actors inside each trial's placement group are checked by the multi-node sweep test
    (tests/runtime/test_multinode.py), which runs them."""
    done: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def get(study: str) -> Path:
        if study not in done:
            out = tmp_path_factory.mktemp(f"smoke-{study}") / "out"
            start_session_ray()
            proc = run_study_in_process(study, "--smoke-test", "--workers-per-trial", "0", "--out", str(out))
            assert proc.returncode == 0, f"{study} --smoke-test failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            done[study] = (out, proc)
        return done[study][0]

    get.proc = lambda study: done[study][1]  # the finished run (stdout holds the printed table)
    return get


class EvaluatedSizes:
    """Spies on :mod:`fedsap_ray.engine.evaluate`'s ``name`` (``evaluate`` or ``evaluate_by_class``): ``sizes`` is the
    parameter count of every network it evaluated, so a test sees how often and at what size evaluation ran."""

    def __init__(self, monkeypatch, name: str) -> None:
        from fedsap_ray.engine import evaluate as ev

        self.sizes: list[int] = []
        inner = getattr(ev, name)

        def spy(model, layout, params, *a, **k):
            self.sizes.append(layout.size)
            return inner(model, layout, params, *a, **k)

        monkeypatch.setattr(ev, name, spy)
