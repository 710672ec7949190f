"""Damaged Inductor cache entries are rebuilt, never trusted (issue 56), with real Inductor in fresh processes: a
compiled tiny training fills the node's cache; the generated forward is replaced by valid code computing
something else and the backward's is truncated; a second process gets exactly the first one's numbers (the guard
removed both, with one warning), while the same edit in a folder the guard does not check (the user's own
``TORCHINDUCTOR_CACHE_DIR``) is loaded by Inductor silently and gives other numbers. A cold compile costs tens of
seconds on 2 loaded cores: integration tier (tests/conftest.py); the mechanics are tests/engine/test_compile_cache.py's."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from fedsap_ray.engine import compiled

REPO = Path(__file__).resolve().parents[2]
# three SGD steps of a tiny network's compiled forward and backward (a small MLP: the fewest generated kernels, so
# the quickest cold compile), through the process's own cache machinery
TRAIN = """
import hashlib, json, sys, torch
torch.set_num_threads(1)
from fedsap_ray.engine import compiled
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 4, (16,))
forward, outcome = compiled.forwards().lookup(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(forward(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
compiled.record_new_files(outcome)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
print(json.dumps({"losses": losses, "params": hashlib.sha256(flat.tobytes()).hexdigest()}))
"""


def start(env_cache: Path, inductor: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != compiled.ENV}
    env.update(FEDSAP_RAY_CACHE=str(env_cache), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    if inductor is not None:
        env[compiled.ENV] = str(inductor)  # the user's folder: Inductor's own rules only
    return subprocess.Popen([sys.executable, "-c", TRAIN], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def generated(root: Path, graph: str) -> Path:
    """The generated wrapper module of the forward (``graph="forward"``) or backward graph."""
    found = [p for p in root.glob("??/*.py") if f"_{graph}'" in p.read_text().splitlines()[0]]
    assert len(found) == 1, (graph, found)
    return found[0]


def test_damaged_entries_are_rebuilt_and_give_the_first_process_numbers(tmp_path):
    first, _ = finish(start(tmp_path / "node"))
    root = tmp_path / "node" / "inductor"
    fwd = generated(root, "forward")
    source, n = re.subn(r"( *)def call\((self, )?args\):\n", lambda m: m.group(0) + m.group(1) + "    args[0].mul_(1.5)\n",
                        fwd.read_text(), count=1)  # valid code, other numbers: the first input scaled
    assert n == 1, "the generated wrapper's call() was not found: Inductor's code generation changed"
    fwd.write_text(source)
    bwd = generated(root, "backward")
    bwd.write_bytes(bwd.read_bytes()[:len(bwd.read_bytes()) // 2])  # truncated: Inductor would stop with an error
    user = tmp_path / "user"
    shutil.copytree(root, user, ignore=shutil.ignore_patterns(".fedsap_digests"))
    generated(user, "backward").unlink()  # the user's copy keeps only the valid edit: Inductor regenerates a missing file
    guarded, unguarded = start(tmp_path / "node"), start(tmp_path / "elsewhere", inductor=user)
    (again, err), (silent, _) = finish(guarded), finish(unguarded)
    assert again == first  # exactly the first process's numbers: the damaged entries were compiled again
    assert re.search(rf"Inductor cache {re.escape(str(root))}: 2 damaged, linked or unrecorded entries removed", err)
    assert silent["losses"] != first["losses"]  # what Inductor alone does with the same edit: wrong numbers, exit 0
