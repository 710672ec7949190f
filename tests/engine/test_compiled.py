"""resources.compile (fedsap_ray.engine.compiled, issue 56): off is the eager loop itself; the per-process cache
counts shapes as they repeat and bounds them; a hook that cannot be compiled falls back by name; a bad value
exits 2 naming the field. The mechanics run under torch.compile's ``eager`` backend (Dynamo only, no code
generation: milliseconds); Inductor's own numbers are tests/runtime/test_compiled_ray.py's."""
from __future__ import annotations

import dataclasses
import os
import stat
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from faultkit import cli_process
from fedsap_ray.algorithms.fedprox import ProximalTerm
from fedsap_ray.algorithms.fedsap.hooks import ChannelStatsHook
from fedsap_ray.algorithms.fjord import BatchWidths
from fedsap_ray.algorithms.hooks import call
from fedsap_ray.algorithms.representation import RepresentationNorm
from fedsap_ray.common.errors import ConfigError
from fedsap_ray.common.messages import ClientPlan, HookCall
from fedsap_ray.config import build_config
from fedsap_ray.data.base import DomainData
from fedsap_ray.engine import compiled
from fedsap_ray.engine.client import train_client
from fedsap_ray.engine.compiled import CompiledForwards, shape_key, training_forward
from fedsap_ray.engine.evaluate import evaluate
from fedsap_ray.models import build_model
from fedsap_ray.models.masks import ParamLayout


def tiny(width: float = 0.0625) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("cnn_small", num_classes=4, input_shape=(1, 8, 8), width_mult=width)


def plan(layout: ParamLayout, params: np.ndarray, hooks: tuple = ()) -> ClientPlan:
    return ClientPlan(client_id=3, round=1, params=params, mask=None, local_epochs=1, lr=0.05, momentum=0.9,
                      weight_decay=5e-4, batch_size=8, seed=7, hooks=hooks)


def data(n: int = 24) -> DomainData:
    g = torch.Generator().manual_seed(2)
    return DomainData(torch.randn((n, 1, 8, 8), generator=g), torch.randint(0, 4, (n,), generator=g))


@pytest.fixture()
def eager_backend(monkeypatch):
    """The process's cache replaced by one compiling with Dynamo's ``eager`` backend (no Inductor)."""
    forwards = CompiledForwards(backend="eager")
    monkeypatch.setattr(compiled, "_FORWARDS", forwards)
    return forwards


def test_off_is_the_module_itself():
    m = tiny()
    p = plan(ParamLayout.from_model(m), np.zeros(1, np.float32))
    assert training_forward(p, m, "off") == (m, "off")


def test_eager_trains_bit_for_bit_as_before(single_thread):
    m = tiny()
    layout = ParamLayout.from_model(m)
    p = plan(layout, layout.flatten(m))
    a = train_client(p, m, layout, data())
    b = train_client(p, m, layout, data(), compile="off")
    assert np.array_equal(a.values, b.values) and a.train_loss == b.train_loss


def test_cache_counts_hits_and_misses_as_shapes_repeat(eager_backend, single_thread):
    small, wide, small_again = tiny(0.0625), tiny(0.125), tiny(0.0625)
    outcomes = []
    for m in (small, wide, small_again, wide):
        layout = ParamLayout.from_model(m)
        outcomes.append(train_client(plan(layout, layout.flatten(m)), m, layout, data(), compile="train").compile)
    # two shapes: each a miss once, then hits (a new module of a seen shape is a hit too), told per client
    assert outcomes == ["miss", "miss", "hit", "hit"]
    assert (eager_backend.hits, eager_backend.misses, eager_backend.refused) == (
        {"train": 2, "eval": 0}, {"train": 2, "eval": 0}, {"train": 0, "eval": 0})
    assert shape_key(small) == shape_key(small_again) != shape_key(wide)


def test_shapes_beyond_the_capacity_train_eager_with_one_warning():
    forwards = CompiledForwards(capacity=1, backend="eager")
    first, other, third = tiny(0.0625), tiny(0.125), tiny(0.25)
    assert forwards.lookup(first)[0] is not first
    with pytest.warns(UserWarning, match="more than 1 model shapes"):
        assert forwards.lookup(other) == (other, "refused")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert forwards.lookup(third) == (third, "refused")  # warned once per process
    first.eval()  # evaluation's forwards are a role of their own, with their own capacity
    assert forwards.lookup(first)[1] == "miss"
    assert forwards.counts()["train_compile_refused"] == 2 and forwards.counts()["eval_compile_misses"] == 1


def test_compiled_training_agrees_with_eager(eager_backend, single_thread):
    m = tiny()
    layout = ParamLayout.from_model(m)
    p = plan(layout, layout.flatten(m))
    eager = train_client(p, m, layout, data())
    comp = train_client(p, m, layout, data(), compile="train")
    assert eager_backend.misses["train"] == 1 and comp.compile == "miss"
    np.testing.assert_allclose(comp.values, eager.values, rtol=0, atol=1e-5)


def test_a_hook_without_supports_compile_falls_back_by_name(eager_backend, monkeypatch):
    monkeypatch.setattr(compiled, "_WARNED", set())
    m = tiny()
    layout = ParamLayout.from_model(m)
    widths = plan(layout, layout.flatten(m), hooks=(HookCall(BatchWidths.name, None),))  # the payload is not read
    with pytest.warns(UserWarning, match="fjord_batch_widths do not support resources.compile"):
        assert training_forward(widths, m, "train") == (m, "fallback")  # it changes the width batch by batch
    prox = plan(layout, layout.flatten(m), hooks=(call(ProximalTerm, mu=0.01),))
    assert training_forward(prox, m, "train")[1] == "miss"  # FedProx's term reads parameters only: compiled
    assert eager_backend.misses["train"] == 1


def test_fedsap_hooks_train_compiled_as_eager(eager_backend, single_thread):
    """FedSAP's client: the Eq. 7 loss through the compiled view, channel statistics over the LAST of two epochs
    through forward hooks registered after the first epoch's graph was compiled; the statistics, values and
    loss equal eager's, for a first client (miss) and a second of another data size (hit: new hooks, no recompile).
    Under Dynamo's default (hooks unguarded) the last epoch's hooks would never run."""
    features = []
    spy = eager_backend.features
    eager_backend.features = lambda model: features.append(model) or spy(model)  # type: ignore[method-assign]
    results = []
    for n in (21, 27):
        m = tiny()
        layout = ParamLayout.from_model(m)
        hooks = (call(RepresentationNorm, gamma=0.05),
                 call(ChannelStatsHook, keys=("channel_activation", "channel_gradient")))
        p = dataclasses.replace(plan(layout, layout.flatten(m), hooks=hooks), local_epochs=2)
        eager = train_client(p, m, layout, data(n))
        comp = train_client(p, m, layout, data(n), compile="train")
        results.append(comp.compile)
        assert np.array_equal(comp.values, eager.values) and comp.train_loss == eager.train_loss
        for k in ("channel_activation", "channel_gradient"):
            assert np.array_equal(comp.stats[k], eager.stats[k]), k
    assert results == ["miss", "hit"] and len(features) == 2  # each client's Eq. 7 loss ran the compiled features


def test_a_bad_value_is_refused_naming_the_field(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"resources\.compile='fast'.*allowed values are off, train, train\+eval"):
        build_config(preset="smoke", overrides=["resources.compile=fast"])
    for bad in ("fast", "true", "eager"):  # true: YAML's boolean, not a mode
        r = cli_process(capsys, "run", "--preset", "smoke", "--out", str(tmp_path), "--set", f"resources.compile={bad}")
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "resources.compile" in lines[0], r.stderr
    # a bare off (YAML's false, from --set or a config file) is the off mode
    assert build_config(preset="smoke", overrides=["resources.compile=off"]).resources.compile == "off"


def test_compile_stays_out_of_the_hash_and_in_the_config_json():
    off = build_config(preset="smoke", overrides=[])
    on = build_config(preset="smoke", overrides=["resources.compile=train"])
    assert off.config_hash() == on.config_hash()  # the same experiment, computed another way (schema comment)
    assert '"compile":"train"' in on.to_json()


def test_inductor_cache_is_the_node_cache_folder_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(tmp_path))
    monkeypatch.delenv(compiled.ENV, raising=False)
    path = compiled.use_node_cache()
    assert path == tmp_path / "inductor" and os.environ[compiled.ENV] == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
    monkeypatch.delenv(compiled.ENV)
    os.chmod(path, 0o777)
    with pytest.warns(UserWarning, match="not used as Inductor's cache"):
        assert compiled.use_node_cache() is None
    assert compiled.ENV not in os.environ
    monkeypatch.setenv(compiled.ENV, default_cache_dir())  # Inductor's own default, written by Inductor: not the user's
    os.chmod(path, 0o700)
    assert compiled.use_node_cache() == path
    monkeypatch.setenv(compiled.ENV, str(tmp_path / "mine"))  # the user's choice wins
    assert compiled.use_node_cache() == tmp_path / "mine"


def test_evaluation_compiles_once_per_shape_and_agrees_with_eager(eager_backend, single_thread):
    """train+eval: the evaluation forward compiled (a miss, then hits for the same shape), figures as eager's."""
    m = tiny()
    layout = ParamLayout.from_model(m)
    vec, test = layout.flatten(m), data()
    before = compiled.eval_compiles()
    eager = evaluate(m, layout, vec, test, torch.device("cpu"))
    assert evaluate(m, layout, vec, test, torch.device("cpu"), compile="train") == eager  # train: eval stays eager
    assert compiled.eval_compiles() == before
    first = evaluate(m, layout, vec, test, torch.device("cpu"), compile="train+eval")
    again = evaluate(m, layout, vec, test, torch.device("cpu"), compile="train+eval")
    assert compiled.round_compiles("train+eval", before) == 1 and compiled.round_compiles("train", before) is None
    assert eager_backend.hits["eval"] == 1 and first == again
    assert first[0] == eager[0] and abs(first[1] - eager[1]) < 1e-6


def test_the_first_lookups_of_concurrent_clients_share_one_cache(monkeypatch):
    """The local backend's threads ask for the process's cache at once: one cache, not one per thread."""
    monkeypatch.setattr(compiled, "_FORWARDS", None)
    monkeypatch.setattr(compiled, "use_node_cache", lambda: time.sleep(0.05))  # widens the race window
    with ThreadPoolExecutor(4) as ex:
        built = list(ex.map(lambda _: compiled.forwards(), range(4)))
    assert all(f is built[0] for f in built)


def test_an_actor_adopts_the_drivers_cache_settings(tmp_path, monkeypatch):
    """What a Ray driver hands its actors (fedsap_ray.runtime.ray.adopt_driver_cache): its FEDSAP_RAY_CACHE and a
    TORCHINDUCTOR_CACHE_DIR of its own, never Inductor's default; the actor then resolves the driver's folder, and
    drops what the raylet's environment set that the driver does not."""
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(tmp_path / "driver"))
    monkeypatch.setenv(compiled.ENV, default_cache_dir())
    env = compiled.cache_env()
    assert env == {"FEDSAP_RAY_CACHE": str(tmp_path / "driver")}
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(tmp_path / "raylet"))  # the actor's inherited environment
    monkeypatch.setenv(compiled.ENV, str(tmp_path / "raylet-inductor"))
    compiled.adopt_cache_env(env)
    assert compiled.ENV not in os.environ and compiled.use_node_cache() == tmp_path / "driver" / "inductor"
    compiled.adopt_cache_env({compiled.ENV: str(tmp_path / "mine")})
    assert "FEDSAP_RAY_CACHE" not in os.environ and compiled.use_node_cache() == tmp_path / "mine"


def test_the_guide_names_every_hook_that_falls_back():
    """docs/guides/performance.md lists the hooks without ``supports_compile`` ("Hooks that fall back"): the
    registry's list, so a hook that learns to compile (or a new one that cannot) updates the guide."""
    import re
    from pathlib import Path

    from fedsap_ray.algorithms.hooks import HOOKS

    text = (Path(__file__).resolve().parents[2] / "docs/guides/performance.md").read_text()
    sentence = " ".join(text.split("Hooks that fall back", 1)[1].split("\n\n", 1)[0].split())
    named = set(re.findall(r"`([a-z_]+)`", sentence.split("(", 1)[0]))
    assert named == {n for n in HOOKS.names() if not getattr(HOOKS.get(n), "supports_compile", False)}
