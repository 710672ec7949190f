"""Issue 52's data leftovers: an empty ``data.root`` is refused before anything is written (it meant the
working directory, where the 30 MB embedded file was then built), and ``fedsap-ray datasets --root FILE`` is
refused like ``data.root=FILE`` (it listed every dataset as missing, exit 0). In-process, through the CLI."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedsap_ray.cli import main
from fedsap_ray.config import build_config
from fedsap_ray.common.errors import ConfigError


def cli(capsys, *args: str) -> tuple[int, list[str], str]:
    """``fedsap-ray ARGS`` in this process: (exit code, non-empty stderr lines, stdout)."""
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, [line for line in out.err.splitlines() if line.strip()], out.out


@pytest.mark.parametrize("root", ["", " ", "\t \n"])
def test_an_empty_data_root_is_refused_and_nothing_is_written(tmp_path, capsys, monkeypatch, root):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(tmp_path / "cache"))
    rc, err, _ = cli(capsys, "run", "--out", "runs", "--preset", "smoke", "--set", f"data.root={root}")
    assert rc == 2 and len(err) == 1, err
    assert "invalid data.root=" in err[0] and "must name a folder" in err[0] and "null" in err[0]
    assert os.listdir(tmp_path) == []  # no embedded file in the working directory, no results folder, no cache


def test_an_empty_data_root_is_refused_from_a_config_file_too(tmp_path):
    with pytest.raises(ConfigError, match=r"invalid data.root='': must name a folder"):
        build_config(preset="smoke", file_data={"data": {"root": ""}})
    assert build_config(preset="smoke", file_data={"data": {"root": None}}).data.root is None


def test_datasets_root_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "not_a_folder.npz"
    f.write_bytes(b"x")
    rc, err, out = cli(capsys, "datasets", "--root", str(f))
    assert rc == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("fedsap-ray: error: invalid --root=") and str(f) in err[0] and "it is a file" in err[0]
    rc, err, out = cli(capsys, "datasets", "--root", "  ")
    assert rc == 2 and out == "" and len(err) == 1 and "must name a folder" in err[0], err


def test_datasets_root_that_is_a_folder_or_absent_is_listed(tmp_path, capsys):
    for root in (tmp_path, tmp_path / "nowhere"):  # a folder not made yet: every dataset missing, as before
        rc, err, out = cli(capsys, "datasets", "--root", str(root))
        assert rc == 0 and err == [] and f"missing  {root}" in out
    assert not (tmp_path / "nowhere").exists() and os.listdir(tmp_path) == []


def test_datasets_root_link_to_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_bytes(b"x")
    Path(tmp_path / "link").symlink_to(tmp_path / "f")
    rc, err, _ = cli(capsys, "datasets", "--root", str(tmp_path / "link"))
    assert rc == 2 and len(err) == 1 and "it is a file" in err[0]
