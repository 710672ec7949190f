"""FedRolex (fedsap_ray/algorithms/fedrolex.py) against an independent plain-PyTorch reference, and its rolling
window in motion.

The reference (:func:`reference_rounds`) imports nothing of fedsap_ray: it takes the initial weights, each
client's data and capacity as plain tensors and floats, extracts each client's sub-model by the rule of the
authors' code (AIoT-MLSys-Lab/FedRolex, ``resnet_server.py`` ``ResnetServer.split_model``: per layer of C
output channels, ``torch.roll(torch.arange(C), r)[:ceil(rate * C)]`` with r the server's step count modulo C;
``direction=forward`` is the paper's section 3 window {r, ..., r + k - 1} mod C), trains it with
torch.optim.SGD, scatters it back and averages every coordinate over the clients holding it, weighted by
their sample counts (our aggregation rule; the authors' ``combine`` weights by count, which equals it for
equal sizes and is not what this test is about). Ours is driven on the same inputs: the same initial
weights, the same data (one full batch per local step, so the batch order cannot differ), the same
capacities. Over three rounds the windows of both hidden layers wrap.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import federation_fixture, tiny_overrides
from faultkit import stepped_run
from fedsap_ray import results
from fedsap_ray.cli import main as cli_main
from fedsap_ray.algorithms.fedrolex import FedRolex
from fedsap_ray.engine.client import train_client
from fedsap_ray.config import build_config
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.data import build_federation
from fedsap_ray.data.base import DomainData
from fedsap_ray.models.masks import ParamLayout, covering_channel_masks
from fedsap_ray.models import build_model
from fedsap_ray.run.session import build_context

HIDDEN = {"fc1": 5, "fc2": 4}  # small C: the windows wrap within three rounds
INPUTS, CLASSES, ROUNDS = 6, 3, 3
SIZES = (9, 14, 11, 20)  # unequal: the sample weights matter
# smoke's cyclic capacities for 4 clients: 1.0, 0.8, 0.6, 0.4 (a full client and three rolling windows)
BASE = ["algorithm.name=fedrolex", "data.num_clients=4", "training.local_epochs=2", "training.batch_size=64",
        "training.lr=0.1", "training.momentum=0.9", "training.weight_decay=0.0005"]
fed = federation_fixture(["data.num_clients=4", "data.max_test_per_domain=40", "model.width_mult=0.0625"])


# --- the reference: plain PyTorch, nothing of fedsap_ray --------------------------------------------------
def reference_window(channels: int, rate: float, step: int, direction: str) -> torch.Tensor:
    """The authors' window of a layer at server step ``step`` (0 in the first round), in their index order."""
    k = int(np.ceil(channels * rate))
    if direction == "backward":  # resnet_server.py: torch.roll(arange(C), rounds % C)[:k]
        return torch.roll(torch.arange(channels), step % channels, -1)[:k]
    return (torch.arange(k) + step) % channels  # the paper's section 3: {i, ..., i + k - 1} mod C


def reference_rounds(weights: dict[str, torch.Tensor], data: list[tuple[torch.Tensor, torch.Tensor]],
                     rates: list[float], rounds: int, direction: str, *, lr: float, momentum: float,
                     weight_decay: float, epochs: int) -> list[dict[str, torch.Tensor]]:
    """The global MLP weights after each round (fc1 -> fc2 -> fc3, ReLU), every client in every round."""
    history = []
    glob = {k: v.clone() for k, v in weights.items()}
    for step in range(rounds):
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in glob.items()}
        count = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in glob.items()}
        for (x, y), rate in zip(data, rates):
            i1 = reference_window(glob["fc1.weight"].shape[0], rate, step, direction)
            i2 = reference_window(glob["fc2.weight"].shape[0], rate, step, direction)
            i0, i3 = torch.arange(glob["fc1.weight"].shape[1]), torch.arange(glob["fc3.weight"].shape[0])
            rows = {"fc1": (i1, i0), "fc2": (i2, i1), "fc3": (i3, i2)}
            local = {}
            for layer, (out, inp) in rows.items():
                local[f"{layer}.weight"] = glob[f"{layer}.weight"][out][:, inp].clone().requires_grad_()
                local[f"{layer}.bias"] = glob[f"{layer}.bias"][out].clone().requires_grad_()
            opt = torch.optim.SGD(list(local.values()), lr=lr, momentum=momentum, weight_decay=weight_decay)
            for _ in range(epochs):
                opt.zero_grad()
                h = F.relu(F.linear(x, local["fc1.weight"], local["fc1.bias"]))
                h = F.relu(F.linear(h, local["fc2.weight"], local["fc2.bias"]))
                F.cross_entropy(F.linear(h, local["fc3.weight"], local["fc3.bias"]), y).backward()
                opt.step()
            n = float(len(y))
            for layer, (out, inp) in rows.items():
                w, b = f"{layer}.weight", f"{layer}.bias"
                grid = torch.meshgrid(out, inp, indexing="ij")
                total[w][grid] += n * local[w].detach().double()
                count[w][grid] += n
                total[b][out] += n * local[b].detach().double()
                count[b][out] += n
        for k in glob:
            held = count[k] > 0
            glob[k][held] = (total[k][held] / count[k][held]).to(glob[k].dtype)
        history.append({k: v.clone() for k, v in glob.items()})
    return history


# --- ours on the same inputs -------------------------------------------------------------------------------
def client_data() -> list[DomainData]:
    g = torch.Generator().manual_seed(55)
    return [DomainData(torch.randn(n, INPUTS, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
            for n in SIZES]


def ours(fed, direction: str) -> tuple[FedRolex, ParamLayout, list]:
    """(strategy, layout, states by round) of FedRolex on the MLP and :func:`client_data`."""
    cfg = build_config(preset="smoke", overrides=[*BASE, f"algorithm.direction={direction}"])
    strat, layout, scratch = _mlp_strategy(cfg, fed)
    data = client_data()
    states = [strat.init_state()]
    for t in range(1, ROUNDS + 1):
        plans = strat.configure_round(states[-1], t)
        out = [train_client(plans[c], scratch, layout, data[c]) for c in sorted(plans)]
        states.append(strat.aggregate(states[-1], plans, out, t).state)
    return strat, layout, states


def _mlp_strategy(cfg, federation) -> tuple[FedRolex, ParamLayout, torch.nn.Module]:
    """(strategy, layout, scratch model) of FedRolex on the seeded MLP of :data:`HIDDEN` over ``federation``."""
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=CLASSES, input_shape=(INPUTS,), channels=HIDDEN)
    layout = ParamLayout.from_model(model)
    strat = FedRolex(RunContext(cfg=cfg, federation=federation, model=model, layout=layout,
                                space=model.channel_space()), cfg.algorithm.opts)
    # the records' MAC counts read the input shape: the MLP's, not the smoke images'
    strat.ctx.federation = dataclasses.replace(strat.ctx.federation, input_shape=(INPUTS,))
    return strat, layout, copy.deepcopy(model)


@pytest.mark.parametrize("direction", ["backward", "forward"])
def test_fedrolex_equals_the_reference_coordinate_by_coordinate_over_rounds_where_the_windows_wrap(fed, direction):
    """Measured max |ours - reference| over the three rounds: 1.5e-8 in both directions (float32 rounding of
    the sample-weighted mean and of the batch's reduction order); the tolerance is 1e-6. Planted changes of the
    rule fail it: the window not rolled, rolled by t instead of t - 1, rolled the other way, one channel short,
    and the mean weighted by count instead of samples (off by 5.8e-4)."""
    assert [c.capacity for c in fed.clients] == [1.0, 0.8, 0.6, 0.4]
    strat, layout, states = ours(fed, direction)
    tr = strat.cfg.training
    init = {name: torch.from_numpy(layout.slice(name, states[0].params).copy()) for name in layout.names}
    data = [(d.x, d.y) for d in client_data()]
    ref = reference_rounds(init, data, [c.capacity for c in fed.clients], ROUNDS, direction, lr=tr.lr,
                           momentum=tr.momentum, weight_decay=tr.weight_decay, epochs=tr.local_epochs)
    for t in range(1, ROUNDS + 1):
        for name in layout.names:
            np.testing.assert_allclose(layout.slice(name, states[t].params), ref[t - 1][name].numpy(), rtol=0, atol=1e-6,
                                       err_msg=f"round {t}, {name} ({direction})")
    assert not np.array_equal(states[1].params, states[ROUNDS].params)


def _windows(strat, client: int, rounds: range) -> list[dict[str, tuple[int, ...]]]:
    space, layout = strat.ctx.space, strat.ctx.layout
    out = []
    for t in rounds:
        mask = strat.client_mask(strat.init_state(), client, t)
        out.append({k: tuple(np.flatnonzero(v)) for k, v in covering_channel_masks(space, layout, mask).items()})
    return out


def test_the_window_moves_every_round_wraps_after_c_rounds_and_every_channel_gets_trained(fed):
    strat, _, _ = ours(fed, "backward")
    period = math.lcm(*HIDDEN.values())  # every layer back at its start
    wins = _windows(strat, 3, range(1, period + 2))  # capacity 0.4: 2 of 5, 2 of 4 channels
    assert wins[0] == {"fc1": (0, 1), "fc2": (0, 1)}  # round 1: the leading channels, HeteroFL's
    assert wins[1] == {"fc1": (0, 4), "fc2": (0, 3)}  # round 2: one channel back, wrapped (torch.roll's sign)
    assert all(a != b for a, b in zip(wins, wins[1:]))  # it moves every round
    assert wins[period] == wins[0]  # and comes back after lcm(C_l) rounds
    for layer, c in HIDDEN.items():
        assert wins[c][layer] == wins[0][layer]  # each layer wraps at its own C_l
        assert set().union(*(w[layer] for w in wins[:c])) == set(range(c))  # every channel in some window


def test_narrow_clients_alone_train_every_coordinate_where_nested_widths_leave_some_at_init():
    """Every client at capacity 0.6: HeteroFL's nested windows would leave the outer channels at their initial
    values for good (papers/003 Proposition 3); the rolling windows reach every coordinate, each weight between
    two hidden layers too, within lcm(C_l) rounds (the windows of both layers move in step)."""
    ratios = "capacity.keep_ratios=[0.6, 0.6, 0.6, 0.6]"
    narrow = build_federation(build_config(preset="smoke", overrides=[
        "data.num_clients=4", "data.max_test_per_domain=40", "capacity.scheme=explicit", ratios]))
    cfg = build_config(preset="smoke", overrides=[*BASE, "capacity.scheme=explicit", ratios])
    strat, layout, scratch = _mlp_strategy(cfg, narrow)
    data = client_data()
    state = first = strat.init_state()
    for t in range(1, math.lcm(*HIDDEN.values()) + 1):
        plans = strat.configure_round(state, t)
        state = strat.aggregate(state, plans, [train_client(plans[c], scratch, layout, data[c]) for c in sorted(plans)],
                                t).state
        if t == 1:
            assert (state.params == first.params).sum() > 10  # the outer channels: untouched in round 1
    assert not (state.params == first.params).any()


# --- asynchronous mode: a client started on version v trains the window of round v + 1 ----------------------
ASYNC = tiny_overrides("fedrolex", "data.num_clients=6", "training.eval_deployed=false")
fed_async = federation_fixture(ASYNC, name="fed_async")


def test_in_the_asynchronous_mode_a_client_trains_the_window_of_the_version_it_downloaded_plus_one(tmp_path, fed_async):
    cfg = build_config(preset="smoke", overrides=[*ASYNC, "devices.mode=async", "asynchronous.concurrency=4",
                                                  "asynchronous.buffer_size=2", "training.rounds=4",
                                                  "training.eval_every=4"])
    states, backend = stepped_run(tmp_path, cfg, fed_async)
    ctx = build_context(cfg, fed_async)
    space, layout = ctx.space, ctx.layout
    rounds = set()
    for plan in backend.plans:
        cap = float(fed_async.clients[plan.client_id].capacity)
        if plan.mask is None:
            assert cap >= 1.0
            continue
        x = states[plan.round - 1].params  # the version it downloaded is its round - 1
        np.testing.assert_array_equal(plan.values, x[plan.mask])
        got = covering_channel_masks(space, layout, plan.mask)
        for layer in space.layers:
            want = reference_window(layer.channels, cap, plan.round - 1, "backward")
            assert set(np.flatnonzero(got[layer.name])) == set(want.tolist()), (plan.client_id, plan.round, layer.name)
        rounds.add(plan.round)
    assert len(rounds) > 2  # clients started on several versions, each on its own window
    assert (results.load(tmp_path).clients["staleness"] > 0).any()  # and some of them arrived stale


# --- the option -----------------------------------------------------------------------------------------------
def test_a_bad_direction_is_refused_by_name_with_exit_2_and_the_default_is_the_authors_roll(tmp_path, capsys):
    rc = cli_main(["run", "--preset", "smoke", "--out", str(tmp_path / "out"), "--set", "algorithm.name=fedrolex",
                   "--set", "algorithm.direction=sideways"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "algorithm.direction" in err[0] and "backward" in err[0], err
    assert not (tmp_path / "out").exists()
    plain = build_config(preset="smoke", overrides=["algorithm.name=fedrolex"])
    forward = build_config(preset="smoke", overrides=["algorithm.name=fedrolex", "algorithm.direction=forward"])
    assert plain.algorithm.opts.direction == "backward" and plain.config_hash() != forward.config_hash()
