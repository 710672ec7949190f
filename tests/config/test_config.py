"""Config: presets, overrides, files, and a clear error for every kind of bad input."""
from __future__ import annotations

import json

import pytest

from fedsap_ray.config import PRESETS, ConfigError, build_config, load_file


def test_presets_resolve_and_differ():
    cfgs = {p: build_config(preset=p) for p in PRESETS}
    assert cfgs["smoke"].training.rounds < cfgs["laptop"].training.rounds < cfgs["paper"].training.rounds
    assert cfgs["paper"].training.local_epochs == 10 and cfgs["paper"].training.batch_size == 64
    assert cfgs["paper"].training.lr == 0.01 and cfgs["paper"].training.weight_decay == 5e-4
    assert build_config().preset == "laptop"  # the default preset


def test_papers003_presets_follow_section_4_1():
    for name, model, epochs in (("paper_cifar10", "cnn_cifar", 5), ("paper_emnist", "cnn_emnist", 1)):
        c = build_config(preset=name)
        assert (c.data.partition, c.data.alpha, c.data.num_clients, c.model.name) == ("dirichlet", 0.3, 20, model)
        assert c.capacity.scheme == "tiers" and c.capacity.tier_shares == (7, 7, 3, 3)
        t = c.training
        assert (t.rounds, t.local_epochs, t.lr, t.lr_decay, t.momentum, t.weight_decay, t.grad_clip, t.participation) == \
            (200, epochs, 0.01, 0.995, 0.9, 1e-4, 10.0, 0.5)
    s = build_config(preset="paper_shakespeare")
    assert (s.data.partition, s.model.name, s.training.lr, s.training.grad_clip, s.training.local_epochs) == \
        ("natural", "char_lstm", 0.1, 5.0, 1)


def test_scientific_notation_is_a_number_in_overrides_and_files(tmp_path):
    cfg = build_config(preset="smoke", overrides=["training.weight_decay=1e-4", "algorithm.name=fedprox", "algorithm.mu=5e-3"])
    assert cfg.training.weight_decay == 1e-4 and cfg.algorithm.options["mu"] == 5e-3
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  weight_decay: 1e-4\n  lr: 2E-2\n")
    cfg = build_config(preset="smoke", file_data=load_file(f))
    assert cfg.training.weight_decay == 1e-4 and cfg.training.lr == 0.02


def test_overrides_types_and_algorithm_options():
    cfg = build_config(preset="smoke", overrides=["training.rounds=7", "training.lr=0.1", "algorithm.name=fedprox",
                                                  "algorithm.mu=0.5", "capacity.keep_ratios=[1,1,1,1,1,1,1,1,1,0.5]",
                                                  "capacity.scheme=explicit"])
    assert cfg.training.rounds == 7 and isinstance(cfg.training.lr, float)
    assert cfg.algorithm.name == "fedprox" and cfg.algorithm.options["mu"] == 0.5
    assert cfg.capacity.keep_ratios[-1] == 0.5


def test_file_roundtrip_and_hash(tmp_path):
    cfg = build_config(preset="smoke", seed=3)
    f = tmp_path / "c.json"
    f.write_text(json.dumps(cfg.to_dict()))
    again = build_config(file_data=load_file(f))
    assert again == cfg and again.config_hash() == cfg.config_hash()
    assert build_config(preset="smoke", seed=4).config_hash() != cfg.config_hash()
    y = tmp_path / "c.yaml"
    y.write_text("preset: smoke\ntraining:\n  rounds: 2\n")
    assert build_config(file_data=load_file(y)).training.rounds == 2


@pytest.mark.parametrize("override, field, allowed", [
    ("training.rounds=-1", "training.rounds", "integer >= 1"),
    ("training.lr=0", "training.lr", "positive"),
    ("training.participation=1.5", "training.participation", "(0, 1]"),
    ("algorithm.name=nope", "algorithm.name", "fedavg"),
    ("algorithm.mu=0.1", "algorithm.mu", "unknown option"),
    ("data.name=imagenet", "data.name", "embedded_digits"),
    ("data.root=/definitely/not/here", "data.root", "does not exist"),
    ("capacity.keep_ratios=[1,0.5]", "capacity.keep_ratios", "used only by capacity.scheme=explicit"),
    ("capacity={scheme: explicit, keep_ratios: [1, 0.5]}", "capacity.keep_ratios", "data.num_clients=10"),
    ("capacity.tiers=[0,1]", "capacity.tiers", "(0, 1]"),
    ("model.name=vgg", "model.name", "resnet10"),
    ("training.bogus=1", "training.bogus", "unknown key"),
    ("training.rounds=abc", "training.rounds", "integer"),
    ("resources.backend=spark", "resources.backend", "local"),
])
def test_bad_input_names_field_value_and_allowed(override, field, allowed):
    with pytest.raises(ConfigError) as e:
        build_config(preset="smoke", overrides=[override])
    msg = str(e.value)
    assert field in msg and allowed in msg and "\n" not in msg


def test_bad_preset_and_file(tmp_path):
    with pytest.raises(ConfigError, match="preset"):
        build_config(preset="huge")
    with pytest.raises(ConfigError, match="does not exist"):
        load_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_file(bad)

