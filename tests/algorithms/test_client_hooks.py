"""The one client extension point (fedsap_ray.algorithms.hooks): the client loop names no algorithm, and a
hook registered here, outside the package, runs through the real loop at the documented points."""
from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import fedsap_ray.engine.client as client_mod
from conftest import tiny_mlp
from fedsap_ray import algorithms
from fedsap_ray.algorithms.aggregation import scatter
from fedsap_ray.algorithms.hooks import _HOOKS, ClientHook, NoPayload, register_hook, unregister_hook
from fedsap_ray.engine.client import ClientError, train_client
from fedsap_ray.data.base import DomainData
from fedsap_ray.models.masks import ParamLayout
from fedsap_ray.common.messages import ClientPlan, HookCall
from fedsap_ray.models.space import MaskableModel

CLIP = 0.05


def _algorithm_words() -> set[str]:
    """Every registered strategy and client hook name, and the words of the per-method pieces."""
    words = set(algorithms.names()) | set(_HOOKS)
    return words | {"prox", "mu", "gamma", "rep", "control", "probe", "dga", "objective", "scaffold", "channelstats"}


def test_client_plan_fields_name_no_algorithm():
    words = _algorithm_words() | {"stats"}  # a plan's stats were FedSAP's; ClientResult.stats is every hook's
    for f in dataclasses.fields(ClientPlan):
        assert not set(f.name.split("_")) & words, f"ClientPlan.{f.name} names a method"


def test_client_code_names_no_algorithm():
    """No identifier, attribute or string in client.py's code (docstrings aside) is a method's or hook's name."""
    tree = ast.parse(inspect.getsource(client_mod))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    used: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            used.add(n.id)
        elif isinstance(n, ast.Attribute):
            used.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            used.update(n.value.replace("'", " ").replace('"', " ").split())
        elif isinstance(n, ast.ImportFrom) and n.module:
            used.update(n.module.split(".")[1:])  # the package's own name is no method's
    words = _algorithm_words()
    hits = {u for u in used if u.lower() in words or set(u.lower().split("_")) & words}
    assert not hits, f"client.py names {sorted(hits)}"


class Recorder(ClientHook):
    """Records every hook point and checks what the client promises there; freezes training in after_clip."""

    log: list[str] = []

    def __init__(self, plan: ClientPlan, model: MaskableModel, layout: ParamLayout, device: torch.device) -> None:
        super().__init__(plan, model, layout, device)
        self.log.append("init")

    def before_training(self, model: MaskableModel, data: DomainData) -> None:
        self.log.append("before_training")
        with torch.no_grad():  # the plan's values are loaded after this: the scribble must not matter
            for p in model.parameters():
                p.fill_(123.0)

    def start(self, model: MaskableModel) -> None:
        self.log.append("start")
        np.testing.assert_array_equal(self.layout.flatten(model),
                                      scatter(self.plan.values, self.plan.mask, self.layout.size))

    def epoch_start(self, model: MaskableModel, epoch: int) -> None:
        self.log.append(f"epoch_start {epoch}")

    def add_terms(self, model: MaskableModel, loss: torch.Tensor) -> torch.Tensor:
        self.log.append("add_terms")
        return loss + 1000.0  # a constant: the loss is reported with it, the gradients are unchanged

    def after_backward(self, model: MaskableModel) -> None:
        self.log.append("after_backward")
        self.norm_before = float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])))

    def after_clip(self, model: MaskableModel) -> None:
        self.log.append("after_clip")
        norm = float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])))
        assert self.norm_before > CLIP and norm == pytest.approx(CLIP, rel=1e-5)  # clipped in between
        for p in model.parameters():
            p.grad.zero_()  # runs before the step: nothing moves (momentum and weight decay are 0)

    def after_step(self, model: MaskableModel) -> None:
        self.log.append("after_step")

    def result(self, model: MaskableModel) -> dict[str, np.ndarray]:
        self.log.append("result")
        return {"test_seen": np.array([len(self.log)], dtype=np.int64)}

    def upload_mask(self) -> np.ndarray | None:
        self.log.append("upload_mask")
        return np.arange(self.layout.size) % 2 == 0

    def close(self) -> None:
        self.log.append("close")


class OwnLoss(ClientHook):
    def loss(self, model: MaskableModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x), y) * 0.0 + 7.0


class Boom(ClientHook):
    def after_step(self, model: MaskableModel) -> None:
        raise RuntimeError("boom in after_step")


@pytest.fixture
def test_hooks() -> Iterator[None]:
    names = {"test_recorder": Recorder, "test_own_loss": OwnLoss, "test_own_loss_2": OwnLoss, "test_boom": Boom}
    for n, cls in names.items():
        register_hook(n)(cls)
    Recorder.log = []
    yield
    for n in names:
        unregister_hook(n)


def _plan(layout: ParamLayout, model: torch.nn.Module, *hooks: str) -> ClientPlan:
    return ClientPlan(client_id=1, round=4, params=layout.flatten(model), mask=None, local_epochs=2, batch_size=6,
                      lr=0.1, momentum=0.0, weight_decay=0.0, grad_clip=CLIP, seed=7,
                      hooks=tuple(HookCall(n, NoPayload()) for n in hooks))


def test_a_registered_hook_runs_through_the_real_loop_in_order(test_hooks):
    model, layout, data = tiny_mlp()
    plain = train_client(_plan(layout, model), copy.deepcopy(model), layout, data)
    got = train_client(_plan(layout, model, "test_recorder"), copy.deepcopy(model), layout, data)
    step = ["add_terms", "after_backward", "after_clip", "after_step"]
    assert Recorder.log == ["init", "before_training", "start", "epoch_start 0", *step, *step,
                            "epoch_start 1", *step, *step, "close", "upload_mask", "result"]
    assert set(got.stats) == {"test_seen"} and got.stats["test_seen"].tolist() == [len(Recorder.log)]
    keep = np.arange(layout.size) % 2 == 0
    np.testing.assert_array_equal(got.values, layout.flatten(model)[keep])  # frozen, and only the hook's mask
    assert got.train_loss == pytest.approx(plain.train_loss + 1000.0, abs=1e-2)  # the added term is in the reported loss
    assert not np.array_equal(plain.values[keep], got.values)


def test_a_base_loss_hook_replaces_cross_entropy_and_two_are_refused(test_hooks):
    model, layout, data = tiny_mlp()
    got = train_client(_plan(layout, model, "test_own_loss"), copy.deepcopy(model), layout, data)
    assert got.train_loss == 7.0
    with pytest.raises(ClientError, match="at most one"):
        train_client(_plan(layout, model, "test_own_loss", "test_own_loss_2"), copy.deepcopy(model), layout, data)


def test_unknown_hooks_and_failures_are_client_errors_and_close_always_runs(test_hooks):
    model, layout, data = tiny_mlp()
    with pytest.raises(ClientError, match=r"client 1 failed in round 4.*no_such_hook"):
        train_client(_plan(layout, model, "no_such_hook"), copy.deepcopy(model), layout, data)
    with pytest.raises(ClientError, match="boom in after_step"):
        train_client(_plan(layout, model, "test_recorder", "test_boom"), copy.deepcopy(model), layout, data)
    assert Recorder.log[-1] == "close"
    bad = dataclasses.replace(_plan(layout, model), hooks="test_recorder")  # a string, not a tuple of HookCall
    with pytest.raises(ClientError, match="tuple of HookCall"):
        train_client(bad, copy.deepcopy(model), layout, data)


@dataclasses.dataclass(frozen=True)
class ScalePayload:
    factor: float


class ScaledLoss(ClientHook):
    """Reads its own typed payload: the loss times ``factor``."""

    Payload = ScalePayload

    def add_terms(self, model: MaskableModel, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.payload.factor


def test_a_hook_receives_its_own_typed_payload_built_one_way():
    import pickle

    from fedsap_ray.algorithms.hooks import call
    from fedsap_ray.algorithms.fedprox import ProximalPayload, ProximalTerm

    register_hook("test_scaled")(ScaledLoss)
    try:
        model, layout, data = tiny_mlp()
        base = _plan(layout, model)
        plan = dataclasses.replace(base, hooks=(call(ScaledLoss, factor=0.0),))
        assert plan.hooks == (HookCall("test_scaled", ScalePayload(0.0)),) and plan.payload(ScaledLoss).factor == 0.0
        assert train_client(plan, copy.deepcopy(model), layout, data).train_loss == 0.0
        wrong = dataclasses.replace(base, hooks=(HookCall("test_scaled", NoPayload()),))
        with pytest.raises(ClientError, match="payload of client hook 'test_scaled' must be a ScalePayload"):
            train_client(wrong, copy.deepcopy(model), layout, data)
        with pytest.raises(TypeError):
            call(ScaledLoss, factr=1.0)  # a payload's fields are checked when the plan is built
    finally:
        unregister_hook("test_scaled")
    # the payloads of the package's hooks are module-level: plans pickle to Ray workers
    prox = dataclasses.replace(base, hooks=(call(ProximalTerm, mu=0.1),))
    assert pickle.loads(pickle.dumps(prox)).payload("fedprox") == ProximalPayload(mu=0.1)
