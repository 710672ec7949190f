"""The pure checks of a resume (fedsap_ray.run.resume) on their own: the runs row the run started with against
this resume's config and partition. The session's use of them (nothing rewritten before they pass) is
tests/run/test_run_guard.py's and tests/persist/test_checkpoint_safety.py's."""
from __future__ import annotations

import pytest

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config import build_config
from fedsap_ray.run.resume import check_same_config, check_same_partition


def test_a_resume_needs_the_config_the_run_was_made_with() -> None:
    cfg = build_config(preset="smoke")
    check_same_config("r", None, cfg)  # no runs row yet: nothing to compare
    check_same_config("r", {"config_hash": cfg.config_hash()}, cfg)
    with pytest.raises(ConfigError, match=rf"invalid --resume='r': the run was made with another config \(hash abc, "
                                          rf"now {cfg.config_hash()}\)"):
        check_same_config("r", {"config_hash": "abc"}, cfg)


def test_a_resume_needs_the_partition_the_run_trained() -> None:
    row = {"partition_hash": "new", "partition_source": "file p.json"}
    check_same_partition("r", None, row)
    check_same_partition("r", {"partition_hash": None}, row)  # a row from before the column
    check_same_partition("r", {"partition_hash": "new"}, row)
    with pytest.raises(ConfigError, match=r"invalid --resume='r': the run trained dataset d split by file p.json "
                                          r"\(partition hash old\); file p.json now gives hash new"):
        check_same_partition("r", {"partition_hash": "old", "partition_source": "file p.json", "dataset": "d"}, row)
