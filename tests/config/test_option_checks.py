"""The shared option checks (``fedsap_ray.config.checks``: ``check_number``, ``check_int``, ``check_bool``,
``check_choice``, ``fail``): the exact lines they answer, and that the strategies' ``Options`` use them
rather than writing their own (issue 43: a dozen hand-written copies had drifted apart in wording and in
what they let through, e.g. FedProx accepted ``mu=true`` and FedSAP a NaN temperature)."""
from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import numpy as np
import pytest

from fedsap_ray import algorithms
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.checks import check_bool, check_choice, check_int, check_number, fail

ALGORITHMS = Path(algorithms.__file__).parent


def _message(check, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        check(*args, **kwargs)
    return str(e.value)


@pytest.mark.parametrize("args, kwargs, expected", [
    (("algorithm.mu", -1, 0), {}, "invalid algorithm.mu=-1: must be a number >= 0"),
    (("algorithm.tau", 0.0, 0), {"low_open": True}, "invalid algorithm.tau=0.0: must be a number > 0"),
    (("algorithm.p", 0, 0, 1), {"low_open": True}, "invalid algorithm.p=0: must be a number in (0, 1]"),
    (("algorithm.beta", 1.0, 0, 1), {"high_open": True}, "invalid algorithm.beta=1.0: must be a number in [0, 1)"),
    (("algorithm.tau_sim", 2, -1, 1), {"note": " (a cosine similarity)"},
     "invalid algorithm.tau_sim=2: must be a number in [-1, 1] (a cosine similarity)"),
    (("algorithm.target", 0, 0, 1), {"low_open": True, "nullable": True},
     "invalid algorithm.target=0: must be null or a number in (0, 1]"),
    (("algorithm.mu", True, 0), {}, "invalid algorithm.mu=True: must be a number >= 0"),
    (("algorithm.mu", "1", 0), {}, "invalid algorithm.mu='1': must be a number >= 0"),
    (("algorithm.mu", math.nan, 0), {}, "invalid algorithm.mu=nan: must be a number >= 0"),
])
def test_check_number_answers_one_line_naming_the_field(args, kwargs, expected) -> None:
    assert _message(check_number, *args, **kwargs) == expected


def test_check_number_accepts_the_range_and_numpy_scalars() -> None:
    check_number("algorithm.mu", 0, 0)
    check_number("algorithm.p", 1.0, 0, 1, low_open=True)
    check_number("algorithm.tau_sim", np.float32(-1.0), -1, 1)
    check_number("algorithm.target", None, 0, 1, nullable=True)


def test_the_other_checks_answer_one_line_naming_the_field() -> None:
    assert _message(check_int, "algorithm.warmup", -1, 0) == "invalid algorithm.warmup=-1: must be an integer >= 0"
    assert _message(check_int, "algorithm.t_norm", 1.5, 1) == "invalid algorithm.t_norm=1.5: must be an integer >= 1"
    assert _message(check_int, "algorithm.t_norm", True, 1) == "invalid algorithm.t_norm=True: must be an integer >= 1"
    assert _message(check_bool, "algorithm.depth", 1) == "invalid algorithm.depth=1: must be true or false"
    assert _message(check_choice, "algorithm.width", "x", ("full", "capacity")) == \
        "invalid algorithm.width='x': allowed values are full, capacity"
    assert _message(check_choice, "algorithm.adaptive_layer_budget", 2, (0, 1)) == \
        "invalid algorithm.adaptive_layer_budget=2: allowed values are 0, 1"
    assert _message(fail, "algorithm.alpha_min", 0.5, "must be <= algorithm.alpha_0=0.1") == \
        "invalid algorithm.alpha_min=0.5: must be <= algorithm.alpha_0=0.1"
    check_int("algorithm.warmup", np.int64(0), 0)
    check_bool("algorithm.depth", False)
    check_choice("algorithm.width", "full", ("full", "capacity"))


# What a hand-written range, type or choice check says; the shared checks are the one place to say it.
HAND_WRITTEN = re.compile(r"must be (a number|an integer|null or a number|true or false|in [\[(]|[<>]=? ?-?\d)"
                          r"|allowed values are")


def _text(node: ast.AST) -> str | None:
    """A string literal's text (an f-string's literal parts, joined); None for any other node."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return None


def hand_written_checks(root: Path) -> list[str]:
    """``file:line: text`` of every error line under ``root`` (``invalid FIELD=VALUE: ...``) that words a
    range, type or choice check itself."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            text = _text(node)
            if text and "invalid " in text and HAND_WRITTEN.search(text):
                hits.append(f"{path.relative_to(root.parent).as_posix()}:{node.lineno}: {text[:80]!r}")
    return hits


def test_strategies_options_use_the_shared_checks() -> None:
    hits = hand_written_checks(ALGORITHMS)
    assert not hits, ("option checks written by hand in fedsap_ray/algorithms (use fedsap_ray.config.checks's "
                      "check_number / check_int / check_bool / check_choice / fail):\n" + "\n".join(hits))


def test_the_guard_finds_a_hand_written_check(tmp_path) -> None:
    pkg = tmp_path / "algorithms"
    pkg.mkdir()
    (pkg / "m.py").write_text('def f(mu):\n    raise ValueError(f"invalid algorithm.mu={mu!r}: must be a number >= 0")\n')
    assert [h.split(":")[0] for h in hand_written_checks(pkg)] == ["algorithms/m.py"]
