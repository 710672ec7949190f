"""Local backend in worker processes (``resources.local_parallelism=processes``): the same client code as
:class:`~fedsap_ray.runtime.local.LocalBackend`, each concurrent client in a process of its own.

Why: with many small clients (200 x 16 samples, ``cnn_small``) threads share one interpreter lock
between the kernels of a step, and a step of a 16-sample batch is short enough for that to show
(docs/guides/performance.md, "Threads or processes"). One process per concurrent client, each with
``resources.torch_threads`` intra-op threads, is what pfl-research's two-process configuration does.

How (the Ray worker's design without Ray):
- ``num_workers`` fresh interpreters (``python -c``, not ``multiprocessing``: no fork of a parent that
  may hold OpenMP or CUDA state, and no re-import of the caller's ``__main__``, which hangs a script
  without a ``__main__`` guard), each on one end of a socket pair. Each gets, once per run, its own copy
  of the template model, the layout, the map from client to its rows and the training pools as
  memory-mapped ``.npy`` files in a temporary folder (every worker reads the same pages); it prepares
  each client's data once (:class:`~fedsap_ray.client.PreparedData`) and pays torch's optimizer
  start-up when it starts (:func:`~fedsap_ray.client.warm_torch`). Messages are pickled by value.
- A round sends each plan to a worker with a free slot (``PIPELINE`` plans in flight per worker, so the
  next plan waits in the pipe while a result travels back) and collects the results in client order.
  A client's numbers depend only on its plan, its data and the thread count: they equal those of the
  threaded backend and of Ray (tests/runtime/test_processes.py).
- A worker that dies (killed, out of memory) is replaced once per round and the clients it held re-run
  from their plans, as on Ray; a client that raises stops the run with its
  :class:`~fedsap_ray.errors.ClientError` (round and client named).

Start-up costs a process per worker (torch's import, about 2 s on 2 cores), so threads stay the default:
processes pay off on many small clients, not on the smoke runs of a test suite.
"""
from __future__ import annotations

import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections import deque
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsap_ray.client import PreparedData, default_workers, pick_device, to_device, train_client, warm_torch
from fedsap_ray.context import RunContext
from fedsap_ray.data.base import DomainData
from fedsap_ray.errors import ClientError
from fedsap_ray.messages import ClientPlan, ClientResult

PIPELINE = 2  # plans in flight per worker (as on Ray: the next plan is queued while a result travels back)


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))  # tensors by value, never by handle


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def serve(fd: int) -> None:
    """A worker process (``python -c 'serve(fd)'``): read its start message, then train every plan it
    receives on ``fd`` until the parent sends ``None`` or goes away."""
    conn = Connection(fd)
    model, layout, pools, client_index, device, torch_threads = _recv(conn)
    torch.set_num_threads(torch_threads)
    warm_torch()
    dev = pick_device(device)
    to_device(model, dev)
    # the pools are memory-mapped .npy files: every worker reads the same pages, none holds a copy
    mapped = {d: (np.load(x, mmap_mode="r"), np.load(y, mmap_mode="r")) for d, (x, y) in pools.items()}

    def build(client_id: int) -> DomainData:
        domain, idx = client_index[client_id]
        x, y = mapped[domain]
        return DomainData(torch.from_numpy(np.ascontiguousarray(x[idx])), torch.from_numpy(np.ascontiguousarray(y[idx])))

    data = PreparedData(build, dev)
    _send(conn, ("ready", os.getpid()))
    # A reader thread takes plans off the socket as they come, so the parent's next plan never waits on
    # this process sending a result (with both socket buffers full, each side would wait on the other).
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                plan = _recv(conn)
            except (EOFError, OSError):  # the parent is gone
                plan = None
            inbox.put(plan)
            if plan is None:
                return

    threading.Thread(target=read, name="fedsap-plans", daemon=True).start()
    while (plan := inbox.get()) is not None:
        try:
            _send(conn, ("ok", train_client(plan, model, layout, data.get(plan.client_id), dev)))
        except ClientError as e:
            _send(conn, ("error", str(e)))


class _Worker:
    """One worker process and this end of its socket."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what this process imports
        code = f"from fedsap_ray.runtime.processes import serve; serve({theirs.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.inflight: deque[int] = deque()  # clients whose plans this worker holds, in the order sent

    def ready(self, start: bytes) -> int:
        """Send the run's start message and wait for the worker's pid (its torch import and warm-up)."""
        try:
            self.conn.send_bytes(start)
            kind, pid = _recv(self.conn)
        except (EOFError, OSError):
            raise RuntimeError(f"a client worker process exited during start-up (exit code {self.process.wait()})") from None
        assert kind == "ready"
        return pid

    def stop(self) -> None:
        try:
            _send(self.conn, None)
        except OSError:  # already gone
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()


class ProcessBackend:
    """``num_workers`` worker processes, each training one client at a time (module docstring)."""

    name = "local"

    def __init__(self, device: str = "auto", num_workers: int | None = None, torch_threads: int = 1) -> None:
        self.device, self.torch_threads = device, torch_threads
        self.num_workers = num_workers or default_workers(torch_threads)
        self.restarts = 0
        self.pids: list[int] = []
        self._workers: list[_Worker] = []
        self._dir: Path | None = None

    def start(self, ctx: RunContext) -> None:
        fed = ctx.federation
        self._dir = Path(tempfile.mkdtemp(prefix="fedsap-workers-"))
        pools = {}
        for i, (domain, pool) in enumerate(fed.train.items()):
            x, y = self._dir / f"{i}-x.npy", self._dir / f"{i}-y.npy"
            np.save(x, pool.x.numpy())
            np.save(y, pool.y.numpy())
            pools[domain] = (str(x), str(y))
        index = {c.client_id: (c.domain, np.asarray(c.indices)) for c in fed.clients}
        self._start = pickle.dumps((ctx.model, ctx.layout, pools, index, self.device, self.torch_threads),
                                   protocol=pickle.HIGHEST_PROTOCOL)
        n = min(self.num_workers, max(1, len(fed.clients)))
        self._workers = [_Worker() for _ in range(n)]  # all start importing at once
        self.pids = [w.ready(self._start) for w in self._workers]  # fail fast if a worker cannot start

    def train(self, plans: dict[int, ClientPlan]) -> list[ClientResult]:
        if not self._workers:
            raise RuntimeError("ProcessBackend.train called before start()")
        todo = deque(sorted(plans))
        results: dict[int, ClientResult] = {}
        replaced: set[int] = set()

        def died(i: int) -> None:  # replace worker i (once a round) and queue its clients again, first
            w = self._workers[i]
            if i in replaced:
                raise ClientError(f"a client worker process died twice in round {plans[w.inflight[0]].round} "
                                  f"(clients {sorted(w.inflight)})")
            replaced.add(i)
            todo.extendleft(reversed(w.inflight))
            w.inflight.clear()
            w.stop()
            self._workers[i] = _Worker()
            self.pids[i] = self._workers[i].ready(self._start)
            self.restarts += 1

        while todo or any(w.inflight for w in self._workers):
            for i in range(len(self._workers)):
                w = self._workers[i]
                while todo and len(w.inflight) < PIPELINE:
                    w.inflight.append(todo.popleft())
                    try:
                        _send(w.conn, plans[w.inflight[-1]])
                    except OSError:
                        died(i)
                        break
            by_conn = {w.conn: i for i, w in enumerate(self._workers) if w.inflight}
            for conn in wait(list(by_conn)):
                i = by_conn[conn]  # type: ignore[index]
                w = self._workers[i]
                try:
                    kind, payload = _recv(w.conn)
                except (EOFError, OSError):  # the worker died: its clients re-run from their plans
                    died(i)
                    continue
                cid = w.inflight.popleft()
                if kind == "error":
                    self._drain()
                    raise ClientError(payload)
                results[cid] = payload
        return [results[cid] for cid in sorted(results)]

    def _drain(self) -> None:
        """Collect what is still in flight (after a client error) so each pipe is empty for close()."""
        for w in self._workers:
            while w.inflight:
                try:
                    _recv(w.conn)
                except (EOFError, OSError):
                    break
                w.inflight.popleft()

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
