"""The DP-per-tier study (sweeps/privacy.py): its grid as designed (docs/studies/privacy.md), every trial's config
valid, and (integration tier, through the session's smoke sweeps) its ``--smoke-test`` writes every variant and
prints the study's tables from the kept models."""
from __future__ import annotations

import pytest

from fedsap_ray.config import build_config
from fedsap_ray.config.privacy_config import resolve
from conftest import check_complete, load_study


def _load():
    return load_study("privacy")


def test_the_grid_is_the_design_and_every_config_is_valid():
    mod = _load()
    assert len(mod.VARIANTS) == 16
    hashes, sigmas = set(), {}
    for name, overrides in mod.VARIANTS.items():
        cfg = build_config(preset="laptop", overrides=overrides, seed=0)  # validated, the budget checked
        hashes.add(cfg.config_hash())
        assert (cfg.data.num_clients, cfg.training.participation, cfg.training.rounds) == (300, 0.1, 10)
        assert cfg.capacity == build_config(preset="laptop").capacity  # the laptop tiers
        if name.endswith("-inf"):
            assert cfg.privacy.mode == "off"
            continue
        assert cfg.algorithm.name != "fedsap" and cfg.privacy.clip_norm == mod.CLIP_NORM and cfg.privacy.delta is None
        if name in ("fedavg-eps8-cohort", "fjord-eps8-coverage", "fedavg-eps2-cohort"):  # the accountant: ~1 s each
            sigmas[name] = resolve(cfg).sigma
    assert len(hashes) == 16
    assert {n.split("-")[0] for n in mod.VARIANTS if n.endswith("-inf")} == {"fedavg", "heterofl", "fjord", "fedsap"}
    # one epsilon calibrates one sigma whatever the method and denominator; less budget, more noise
    assert sigmas["fedavg-eps8-cohort"] == pytest.approx(sigmas["fjord-eps8-coverage"], rel=1e-9)
    assert sigmas["fedavg-eps2-cohort"] > sigmas["fedavg-eps8-cohort"] > 0


def test_smoke_test_writes_every_variant_and_prints_the_tier_tables(smoke_study):
    mod = _load()
    out = smoke_study("privacy")
    check_complete(out, {f"{v}-s0" for v in mod.VARIANTS}, 3)
    text = smoke_study.proc("privacy").stdout
    assert "Deployed model per capacity tier" in text and "| fjord | 2 | coverage |" in text
