"""benchmarks/round_overhead.py --repeats: lines interleaved with the order rotated, each repeat's ratios against
its own references, medians at the end (the measurement itself is never run here: ``run_line`` is replaced)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "round_overhead.py"


@pytest.fixture()
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("round_overhead_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_repeats_rotate_and_divide_by_their_own_repeat(bench, monkeypatch, capsys):
    calls: list[tuple[str, int, int]] = []
    # repeat 1 runs on a machine twice as slow: ratios within a repeat must not change with it
    speed = {0: 1.0, 1: 2.0, 2: 1.0}
    base = {("reference", 1): 4.0, ("reference", 2): 2.5, ("local", 1): 4.2, ("local", 2): 2.6, ("ray", 1): 4.4,
            ("ray", 2): 2.8}

    def fake(args, fed, n, backend, count, rep, compile="off"):
        calls.append((backend, count, rep))
        threads, workers = (count, 1) if backend == "reference" else (1, count)
        return {"backend": backend, "threads": threads, "workers": workers, "repeat": rep,
                "per_round_s": base[(backend, count)] * speed[rep]}

    monkeypatch.setattr(bench, "run_line", fake)
    monkeypatch.setattr(bench, "make_federation", lambda *a, **k: None)
    monkeypatch.setattr(bench, "start_local_ray", lambda: None)
    monkeypatch.setitem(sys.modules, "ray", type(sys)("ray"))
    sys.modules["ray"].shutdown = lambda: None  # type: ignore[attr-defined]
    assert bench.main(["--clients", "3", "--workers", "1", "2", "--reference-threads", "1", "2",
                       "--repeats", "3"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    jobs = [("reference", 1), ("reference", 2), ("local", 1), ("ray", 1), ("local", 2), ("ray", 2)]
    firsts = [calls[i * len(jobs)][:2] for i in range(3)]
    assert firsts == jobs[:3]  # repeat r starts at the r-th line: no system always first
    assert sorted(calls) == sorted((b, c, r) for r in range(3) for b, c in jobs)  # every line once a repeat
    assert len(rows) == 18
    for row in rows:
        limit = base[("reference", row["workers"] if row["backend"] != "reference" else row["threads"])]
        mine = base[(row["backend"], row["threads"] if row["backend"] == "reference" else row["workers"])]
        assert row["ratio_to_limit"] == pytest.approx(mine / limit, abs=1e-3)  # the slow repeat cancels
    summary = err[err.index("medians of 3 repeats"):]
    assert "local x1.048" in summary  # ray 1 worker against local 1 worker, 4.4 / 4.2, every repeat
    assert "limit x1.050" in summary  # local with 1 worker against the 1-thread loop


def test_repeats_must_be_positive(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--repeats", "0"])
    assert e.value.code == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_compiled_lines_divide_by_their_own_loop(bench, monkeypatch, capsys):
    """--compile off train: the framework once per mode, the plain loop eager and compiled; ratio_to_limit stays
    against the eager loop, ratio_to_compiled_limit against the compiled one."""
    base = {("reference", "off"): 4.0, ("reference", "train"): 2.0, ("local", "off"): 4.4, ("local", "train"): 3.0}
    calls: list[tuple[str, int, str]] = []

    def fake(args, fed, n, backend, count, rep, compile="off"):
        calls.append((backend, count, compile))
        row = {"backend": backend, "threads": 1, "workers": 1, "repeat": rep, "per_round_s": base[(backend, compile)]}
        row.update({"compiled": compile != "off"} if backend == "reference" else {"compile": compile})
        return row

    monkeypatch.setattr(bench, "run_line", fake)
    monkeypatch.setattr(bench, "make_federation", lambda *a, **k: None)
    assert bench.main(["--clients", "3", "--workers", "1", "--reference-threads", "1", "--backends", "reference,local",
                       "--compile", "train", "off"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert calls == [("reference", 1, "off"), ("reference", 1, "train"), ("local", 1, "off"), ("local", 1, "train")]
    got = {(r["backend"], r.get("compile", "train" if r.get("compiled") else "off")): r for r in rows}
    assert got[("local", "train")]["ratio_to_limit"] == pytest.approx(3.0 / 4.0)
    assert got[("local", "train")]["ratio_to_compiled_limit"] == pytest.approx(3.0 / 2.0)
    assert got[("reference", "train")]["ratio_to_limit"] == pytest.approx(0.5)  # the compiled loop against eager


def test_cuda_is_refused_without_a_device(bench, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--device", "cuda"])
    assert e.value.code == 2
    assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err
