"""A results folder whose path the file system cannot hold is refused before any work, naming it (issue 52:
a 300-character component of ``--out`` failed deep in the run with ``OSError: File name too long``, exit 1)."""
from __future__ import annotations

import os

import pytest

from faultkit import cli
from fedsap_ray import results
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.persist.outdir import DEEPEST_BELOW, OutDir


def _limits(path) -> tuple[int, int]:
    return os.pathconf(path, "PC_NAME_MAX"), os.pathconf(path, "PC_PATH_MAX")


@pytest.mark.parametrize("shape", ["long-name", "long-name-deeper", "long-path"])
def test_a_path_past_the_file_systems_limits_is_refused_with_one_line(tmp_path, capsys, shape):
    name_max, path_max = _limits(tmp_path)
    if shape == "long-path":  # every component legal, the whole too long for what a run writes below it
        depth = (path_max - len(str(tmp_path))) // 101 + 1
        out = tmp_path.joinpath(*["d" * 100] * depth)
        needle = f"would pass the system's limit of {path_max} bytes"
    else:
        out = tmp_path / ("n" * (name_max + 1))
        out = out / "x" / "y" if shape == "long-name-deeper" else out
        needle = f"is {name_max + 1} bytes long; the file system allows {name_max}"
    before = sorted(os.listdir(tmp_path))
    for args in (["run", "--preset", "smoke", "--out", str(out), "--set", "training.rounds=1"],
                 ["compact", str(out)]):
        rc, lines = cli(capsys, *args)
        assert rc == 2 and len(lines) == 1 and needle in lines[0], (args, lines)
        assert len(lines[0]) < 400
    with pytest.raises(ConfigError, match="results folder"):
        results.load(str(out))
    assert sorted(os.listdir(tmp_path)) == before  # nothing created


def test_the_longest_legal_folder_still_runs_and_reads(tmp_path):
    """The limit is the file system's, not ours: a name of exactly NAME_MAX bytes is accepted, and the deepest
    file a run writes below a folder fits in the room the path check keeps for it."""
    name_max, _ = _limits(tmp_path)
    OutDir(tmp_path / ("n" * name_max))  # no refusal
    longest = f"/allocations/.{'r' * 128}@r000001.parquet.0123abcd.tmp"
    assert len(longest) < DEEPEST_BELOW
