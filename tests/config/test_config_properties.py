"""Property-based validation (Hypothesis): any value of any config field or algorithm option either
gives a one-line ConfigError naming a field (exit 2), or a config whose every number is finite; a
small sample of accepted configs runs to the end. Never a traceback, never a NaN accepted."""
from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedsap_ray import algorithms, config  # noqa: E402
from fedsap_ray.config import ConfigError, ExperimentConfig, build_config  # noqa: E402

SECTIONS = ("data", "capacity", "model", "training", "resources")
FIELDS: list[tuple[str, typing.Any]] = [("seed", int), ("study", str)] + [
    (f"{sec}.{name}", hint)
    for sec in SECTIONS
    for name, hint in typing.get_type_hints(typing.get_type_hints(ExperimentConfig)[sec]).items()
]
OPTIONS: list[tuple[str, str, typing.Any]] = [
    (algo, name, hint)
    for algo in algorithms.names()
    for name, hint in typing.get_type_hints(algorithms.get(algo).Options).items()
]
ERROR = re.compile(r"^invalid [A-Za-z_][\w.\-]*[=:]")  # "invalid <field>=<value>: <what is allowed>"

NON_FINITE = [math.nan, math.inf, -math.inf]
SPECIAL_FLOATS = [math.nan, -math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 0.0, -0.0, 1.0, 0.5, 2.0]
SPECIAL_INTS = [0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -(2**63) - 1, 10**23]

scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(SPECIAL_FLOATS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(SPECIAL_INTS),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
)
# any value a YAML/JSON config can hold: scalars, lists of them, small mappings
values = st.one_of(scalars, st.lists(scalars, max_size=5),
                   st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def typed(hint: typing.Any) -> st.SearchStrategy:
    """Values of the field's own type across its range (plus the awkward ones: NaN, inf, huge, negative)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        return st.one_of(st.none(), *(typed(a) for a in args if a is not type(None)))
    if origin is tuple:
        return st.lists(typed(args[0]), max_size=6)
    if hint is float:
        return st.one_of(st.sampled_from(NON_FINITE), st.floats(allow_nan=True, allow_infinity=True),
                         st.sampled_from(SPECIAL_FLOATS), st.floats(min_value=0, max_value=1))
    if hint is int:
        return st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from(SPECIAL_INTS),
                         st.integers(min_value=0, max_value=20))
    if hint is bool:
        return st.booleans()
    return st.text(max_size=8)


def field_value(entry) -> st.SearchStrategy:
    return st.one_of(typed(entry[-1]), values)


def nest(dotted: str, value) -> dict:
    d = value
    for part in reversed(dotted.split(".")):
        d = {part: d}
    return d


def floats_in(x) -> list[float]:
    if isinstance(x, float):
        return [x]
    if isinstance(x, dict):
        return [f for v in x.values() for f in floats_in(v)]
    if isinstance(x, (list, tuple)):
        return [f for v in x for f in floats_in(v)]
    return []


def check(preset: str, file_data: dict | None, overrides: list[str]) -> ExperimentConfig | None:
    """The property: a one-line ConfigError naming a field, or a config with finite numbers only."""
    try:
        cfg = build_config(preset=preset, file_data=file_data, overrides=overrides)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and ERROR.match(msg), msg
        assert "np.float64" not in msg
        return None
    d = cfg.to_dict()
    assert all(math.isfinite(f) for f in floats_in(d)), d
    assert all(math.isfinite(f) for f in floats_in(dict(cfg.algorithm.options))), cfg.algorithm.options
    # what the run will build: the typed options built once, by the validation, equal a fresh parse
    assert cfg.algorithm.opts == algorithms.parse_options(cfg.algorithm.name, cfg.algorithm.options)
    return cfg


def as_override(dotted: str, value) -> str:
    """``--set`` text whose YAML reads back as ``value`` (NaN as .nan, inf as .inf, lists as flow lists)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return f"{dotted}={text.removesuffix('...').strip()}"


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), via_cli=st.booleans(), preset=st.sampled_from(["smoke", "laptop", "paper_cifar10"]))
def test_any_field_value_is_refused_on_one_line_or_accepted_finite(data, via_cli, preset):
    picks = data.draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique_by=lambda f: f[0]))
    chosen = [(name, data.draw(field_value((name, hint)))) for name, hint in picks]
    if via_cli:
        check(preset, None, [as_override(n, v) for n, v in chosen])
    else:
        file_data: dict = {}
        for n, v in chosen:
            file_data = config.deep_merge(file_data, nest(n, v))
        check(preset, file_data, [])


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), via_cli=st.booleans())
def test_any_algorithm_option_is_refused_on_one_line_or_accepted_finite(data, via_cli):
    algo = data.draw(st.sampled_from([a for a, _, _ in OPTIONS] + ["fedspu", "nosuch"]))
    own = [(n, h) for a, n, h in OPTIONS if a == algo]
    names = data.draw(st.lists(st.sampled_from(own), max_size=3, unique_by=lambda f: f[0])) if own else []
    chosen = [(n, data.draw(field_value((n, h)))) for n, h in names]
    if data.draw(st.booleans()):  # sometimes an option the algorithm does not have
        chosen.append((data.draw(st.sampled_from(["mu", "temperature", "bogus", "p"])), data.draw(values)))
    if via_cli:
        check("smoke", None, [f"algorithm.name={algo}", *(as_override(f"algorithm.{n}", v) for n, v in chosen)])
    else:
        check("smoke", {"algorithm": {"name": algo, "options": dict(chosen)}}, [])


RUNNABLE = {  # cheap algorithms and the ranges their options and a few training fields are drawn from
    "fedavg": {}, "fedprox": {"mu": st.floats(-0.1, 1.0)}, "uniform": {"p": st.floats(0.0, 1.2)},
}


@settings(max_examples=2, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_sample_of_configs_runs_to_the_end_or_is_refused(data, tmp_path_factory):
    from fedsap_ray.cli import main

    algo = data.draw(st.sampled_from(sorted(RUNNABLE)))
    sets = [f"algorithm.name={algo}", "data.num_clients=4", "data.max_test_per_domain=30", "model.width_mult=0.0625",
            "training.rounds=1", "training.local_epochs=1", "training.batch_size=16",
            "training.max_steps_per_epoch=2"]
    sets += [as_override(f"algorithm.{n}", data.draw(s)) for n, s in RUNNABLE[algo].items()]
    sets += [as_override("training.lr", data.draw(st.floats(1e-3, 0.2))),
             as_override("training.momentum", data.draw(st.floats(0.0, 0.95))),
             as_override("training.weight_decay", data.draw(st.sampled_from([0.0, 1e-4, math.nan, math.inf])))]
    out = tmp_path_factory.mktemp("prop")
    args = ["run", "--preset", "smoke", "--quiet", "--out", str(out), *(a for s in sets for a in ("--set", s))]
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(args)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    if rc == 2:
        assert len(lines) == 1 and re.match(r"^fedsap-ray: error: invalid [\w.]+=", lines[0]), lines
        return
    assert rc == 0, lines
    from fedsap_ray import results

    runs = results.load(out).runs
    assert runs["status"].tolist() == ["finished"]
    assert all(math.isfinite(f) for f in floats_in(__import__("json").loads(runs.loc[0, "config_json"])))


def _is_float(hint) -> bool:
    return hint is float or float in typing.get_args(hint) or any(
        float in typing.get_args(a) for a in typing.get_args(hint))


FLOAT_TARGETS = [("smoke", n, None) for n, h in FIELDS if _is_float(h)] + [
    ("smoke", f"algorithm.{n}", a) for a, n, h in OPTIONS if _is_float(h)]


@pytest.mark.parametrize("preset, field, algo", FLOAT_TARGETS, ids=[f"{a or 'cfg'}:{f}" for _, f, a in FLOAT_TARGETS])
def test_every_float_field_and_option_refuses_nan_and_inf(preset, field, algo):
    """Exhaustive over the dataclasses: no float anywhere accepts NaN or +-inf (as a scalar or a list item)."""
    hint = dict(FIELDS).get(field) or next(h for a, n, h in OPTIONS if a == algo and f"algorithm.{n}" == field)
    is_list = typing.get_origin(hint) is tuple or any(typing.get_origin(a) is tuple for a in typing.get_args(hint))
    for bad in NON_FINITE:
        value = [0.5, bad] if is_list else bad
        head = [f"algorithm.name={algo}"] if algo else []
        with pytest.raises(ConfigError) as e:  # from the command line (--set text parsed as YAML)
            build_config(preset=preset, overrides=[*head, as_override(field, value)])
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"invalid {field}="), msg
        data = ({"algorithm": {"name": algo, "options": {field.split(".", 1)[1]: value}}} if algo
                else nest(field, value))
        with pytest.raises(ConfigError, match=f"^invalid {re.escape(field)}="):  # from a config file
            build_config(preset=preset, file_data=data)


def test_the_field_lists_cover_every_section_and_algorithm():
    """The generators above draw from the dataclasses themselves: a new field or algorithm is covered."""
    for sec in SECTIONS:
        cls = typing.get_type_hints(ExperimentConfig)[sec]
        assert {f.name for f in dataclasses.fields(cls)} == {n.split(".", 1)[1] for n, _ in FIELDS if n.startswith(sec + ".")}
    assert {a for a, _, _ in OPTIONS} == {a for a in algorithms.names() if dataclasses.fields(algorithms.get(a).Options)}
