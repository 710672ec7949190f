"""Fuzzing the command line and the config loader (Hypothesis, derandomized so CI is deterministic):
random section/field/value triples, random YAML documents, random ``--set`` strings and random sweep
flags. Every input either is accepted (and a sample of accepted ones runs a smoke round) or exits 2
with one line naming a field, a flag or a file; never a traceback, never exit 0 on a value outside
the documented range.

Cheap by construction: ``main()`` is called in this process, validation goes through
``--print-config`` (the config is resolved and checked, nothing runs) and the sweeps through
``--dry-run`` (every trial's config is checked, Ray never starts); only the last test runs rounds.
"""
from __future__ import annotations

import contextlib
import io
import math
import re
import string
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faultkit import TINY, sets
from fedsap_ray import algorithms
from fedsap_ray.cli import main
from fedsap_ray.config import ExperimentConfig

REPO = Path(__file__).resolve().parents[1]
FUZZ = dict(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
# one refusal line: "<prog>: error: invalid <field or flag or file>=..." or argparse's "argument --flag: ..."
REFUSAL = re.compile(r"^(?P<prog>[\w.\- ]+): error: (?:invalid (?P<name>(?:[^\s=:'\"]|'[^']*'|\"[^\"]*\")+|--set (?:'[^']*'|[^\s=:]+)"
                     r"|--config=\S+)[=:]|argument (?P<flag>--[\w-]+)|unrecognized arguments: )")

SECTIONS = ("data", "capacity", "model", "training", "resources")
FIELDS = [f"{sec}.{name}" for sec in SECTIONS
          for name in typing.get_type_hints(typing.get_type_hints(ExperimentConfig)[sec])] + ["seed", "study"]
OPTIONS = sorted({f"algorithm.{name}" for algo in algorithms.names()
                  for name in typing.get_type_hints(algorithms.get(algo).Options)})
INT_FIELDS = {f"{sec}.{name}" for sec in SECTIONS
              for name, hint in typing.get_type_hints(typing.get_type_hints(ExperimentConfig)[sec]).items()
              if hint in (int, int | None)} | {"seed"}

scalars = st.one_of(st.integers(min_value=-(2**66), max_value=2**66), st.floats(allow_nan=True, allow_infinity=True),
                    st.booleans(), st.none(), st.text(max_size=6),
                    st.sampled_from([0, 1, -1, 0.5, 1.5, 2**32, 2**63, math.nan, math.inf, -math.inf, "", "auto"]))
values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                      st.dictionaries(st.one_of(st.text(max_size=4), st.integers()),
                                                                      kids, max_size=3)), max_leaves=8)
# structural keys (a section, the algorithm, its options, the preset) as often as fields and options
STRUCTURAL = ["algorithm", "algorithm.name", "algorithm.options", "preset", "seed", "study", *SECTIONS]
names = st.one_of(st.sampled_from(STRUCTURAL), st.sampled_from(FIELDS), st.sampled_from(OPTIONS),
                  st.tuples(st.sampled_from((*SECTIONS, "algorithm", "nope")),
                            st.text(string.ascii_lowercase + "_", min_size=1, max_size=8)).map(".".join))


def run_cli(*args: str) -> tuple[int, list[str]]:
    """``main(args)`` in-process: (exit code, non-empty stderr lines); an exception is a failure."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse
            rc = int(e.code or 0)
    return rc, [line for line in err.getvalue().splitlines() if line.strip()]


def check_outcome(rc: int, lines: list[str], *, must_refuse: bool = False) -> None:
    assert rc in (0, 2), (rc, lines)
    if rc == 2:
        assert len(lines) == 1 and REFUSAL.match(lines[0]), lines
        assert "Traceback" not in lines[0] and "np.float64" not in lines[0]
    else:
        assert not must_refuse, f"accepted an out-of-range value: {lines}"


def yaml_text(v: object) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def out_of_range(name: str, value: object) -> bool:
    """Values outside every field's documented range: non-finite numbers anywhere, negative integers
    in an integer field (every one is a count, a size or a seed)."""
    if isinstance(value, float) and not math.isfinite(value):
        return True
    if isinstance(value, list):
        return any(out_of_range(name, v) for v in value)
    return name in INT_FIELDS and isinstance(value, int) and not isinstance(value, bool) and value < 0


@settings(max_examples=400, **FUZZ)
@given(st.lists(st.tuples(names, values), min_size=1, max_size=3))
def test_random_field_value_triples_either_resolve_or_exit_2_naming_the_field(triples):
    args = [a for name, value in triples for a in ("--set", f"{name}={yaml_text(value)}")]
    rc, lines = run_cli("run", "--preset", "smoke", "--print-config", *args)
    check_outcome(rc, lines, must_refuse=any(out_of_range(n, v) for n, v in triples))


@settings(max_examples=150, **FUZZ)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30))
def test_random_set_strings_either_resolve_or_exit_2(text):
    rc, lines = run_cli("run", "--preset", "smoke", "--print-config", "--set", text)
    check_outcome(rc, lines)


keys = st.one_of(st.sampled_from(["name", "options", "rounds", "lr", "root", "keep_ratios", "scheme"]),
                 st.sampled_from(FIELDS + OPTIONS).map(lambda s: s.split(".")[-1]), st.integers(-3, 3),
                 st.sampled_from(["", None, True]))
documents = st.one_of(
    st.dictionaries(st.one_of(st.sampled_from((*SECTIONS, "algorithm", "seed", "preset", "study")), keys),
                    st.one_of(st.dictionaries(keys, values, max_size=3), values),
                    max_size=3).map(lambda d: yaml.safe_dump(d).encode()),
    values.map(lambda v: yaml.safe_dump(v).encode()),
    st.text(max_size=40).map(str.encode),
    st.binary(max_size=40),
)


@settings(max_examples=250, **FUZZ)
@given(documents, st.sampled_from([".yaml", ".json"]))
def test_random_config_documents_either_resolve_or_exit_2_naming_the_file_or_field(tmp_path_factory, doc, suffix):
    f = tmp_path_factory.mktemp("cfg") / f"c{suffix}"
    f.write_bytes(doc)
    rc, lines = run_cli("run", "--print-config", "--config", str(f))
    check_outcome(rc, lines)
    if rc == 2 and "--config=" in lines[0]:
        assert str(f) in lines[0]


# ---------------------------------------------------------------------------------------------
# Sweep flags (--dry-run: every trial's config is validated, Ray never starts)
# ---------------------------------------------------------------------------------------------
def _sensitivity():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_sensitivity_fuzz", REPO / "sweeps" / "sensitivity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SENSITIVITY = _sensitivity()
sweep_flags = st.fixed_dictionaries({
    "--seeds": st.lists(st.one_of(st.integers(min_value=0, max_value=3), st.integers(min_value=-5, max_value=2**33)),
                        min_size=1, max_size=3),
    "--max-concurrent": st.one_of(st.none(), st.integers(min_value=-2, max_value=4)),
    "--server-cpus": st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 1.0])),
    "--max-failures": st.one_of(st.none(), st.integers(min_value=-6, max_value=3)),
    "--workers-per-trial": st.one_of(st.none(), st.integers(min_value=-2, max_value=3)),
    "--out": st.sampled_from(["ok", "file", "file/sub", "", "file:///tmp/fedsap-fuzz-sweep"]),
    "--set": st.one_of(st.none(), st.tuples(names, values).map(lambda t: f"{t[0]}={yaml_text(t[1])}")),
})


def sweep_out_of_range(flags: dict) -> bool:
    s = flags["--seeds"]
    cpus = flags["--server-cpus"]
    return (len(set(s)) < len(s) or any(not 0 <= x < 2**32 for x in s)
            or (flags["--max-concurrent"] is not None and flags["--max-concurrent"] < 1)
            or (cpus is not None and not (math.isfinite(cpus) and cpus > 0))
            or (flags["--max-failures"] is not None and flags["--max-failures"] < 0)
            or (flags["--workers-per-trial"] is not None and flags["--workers-per-trial"] < 0)
            or flags["--out"] in ("file", "file/sub", ""))


@settings(max_examples=100, **FUZZ)
@given(sweep_flags)
def test_random_sweep_flags_either_plan_the_trials_or_exit_2_before_ray_starts(tmp_path_factory, flags):
    ray = pytest.importorskip("ray")
    tmp = tmp_path_factory.mktemp("sweep")
    (tmp / "file").write_text("x")
    args = ["--dry-run", "--variants", "ref", "g_target=0.5"]
    for flag, v in flags.items():
        if v is None:
            continue
        if flag == "--out":
            v = v if v in ("", ) or "://" in v else str(tmp / v)
        args += [flag, *map(str, v)] if isinstance(v, list) else [flag, str(v)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = SENSITIVITY.main(args)
        except SystemExit as e:
            rc = int(e.code or 0)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    check_outcome(rc, lines, must_refuse=sweep_out_of_range(flags))
    assert not ray.is_initialized() and not (tmp / "ok").exists()  # a dry run starts nothing and writes nothing


# ---------------------------------------------------------------------------------------------
# Accepted inputs really run: a few generated ones train a smoke round
# ---------------------------------------------------------------------------------------------
runnable = st.fixed_dictionaries({
    "algorithm.name": st.sampled_from(algorithms.names()),
    "seed": st.integers(min_value=0, max_value=2**32 - 1),
    "training.lr": st.floats(min_value=1e-4, max_value=0.5),
    "training.participation": st.floats(min_value=0.25, max_value=1.0),
    "training.momentum": st.floats(min_value=0.0, max_value=0.99),
})


@settings(max_examples=4, **FUZZ)
@given(runnable)
def test_generated_valid_inputs_run_a_smoke_round(tmp_path_factory, values):
    out = tmp_path_factory.mktemp("run")
    overrides = [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items() if k != "seed"]
    rc, lines = run_cli("run", "--preset", "smoke", "--quiet", "--out", str(out), "--seed", str(values["seed"]),
                        *sets([*TINY, "training.rounds=1", *overrides]))
    assert rc == 0, lines
    assert (out / "rounds").is_dir()
