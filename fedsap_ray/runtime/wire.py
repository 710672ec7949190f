"""What a round's plans and results weigh on the wire, and how a batch of plans travels compactly (issue 42).

A round's plans mostly name the same few full-size vectors (the server model; a group's Private vector,
which a plan's ``overlay`` mixes in by a mask of its own), and
many share a mask object (every client of one width). Sent one plan at a time, each plan carried its
own copy of both: 24.5 MB a client-round at ResNet10's width 1.0. A :class:`Batch` is one worker's
share of a round: each distinct vector and each distinct mask once (a mask packed to one bit per
coordinate, :func:`numpy.packbits`), and per plan only what is its own (the plan without its arrays,
and the positions of its vector and mask in the batch). :meth:`Batch.plans` rebuilds the plans
exactly (same vectors, same masks, so the same numbers). Nothing here imports Ray: the Ray pool
(:mod:`fedsap_ray.runtime.ray`) puts each shared array in the object store once per round and passes
it to every worker call that needs it.

Byte counts are those of the pickled payload, with numpy buffers counted out of band
(:func:`payload_bytes`, pickle protocol 5, which is how Ray serialises them): what the backend moves,
distinct from the simulated protocol's ``bytes_down``/``bytes_up``.
"""
from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsap_ray.common.messages import ClientPlan, ClientResult, StartOverlay

_NO_PARAMS = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class PlanStub:
    """A plan without its arrays: ``plan`` carries an empty ``params`` and no mask; ``vector`` and ``mask``
    are positions in the batch's shared arrays (``mask`` None: the full model)."""

    plan: ClientPlan
    vector: int
    mask: int | None
    overlay: tuple[int, int] | None = None  # (its vector, its packed mask) when the plan has a StartOverlay


@dataclass(frozen=True)
class Batch:
    """One worker's share of a round (:func:`pack`): the stubs in dispatch order, the shared arrays'
    keys (positions in the round's list of distinct arrays) and each mask's length."""

    stubs: tuple[PlanStub, ...]
    keys: tuple[int, ...]  # the round's shared arrays this batch uses, in the order the worker receives them
    mask_sizes: dict[int, int]  # key of a packed mask -> its length in coordinates

    def plans(self, arrays: Sequence[np.ndarray]) -> list[ClientPlan]:
        """The plans again, from the shared arrays as received (``arrays[i]`` is the one of ``keys[i]``)."""
        got = dict(zip(self.keys, arrays))
        masks = {k: np.unpackbits(got[k], count=n).view(np.bool_) for k, n in self.mask_sizes.items()}
        return [dataclasses.replace(s.plan, params=got[s.vector], mask=None if s.mask is None else masks[s.mask],
                                    overlay=None if s.overlay is None else StartOverlay(got[s.overlay[0]], masks[s.overlay[1]]))
                for s in self.stubs]


class RoundArrays:
    """The distinct arrays of a round's plans, each once: vectors as they are, masks packed to bits.

    ``arrays[k]`` is the k-th distinct array; identity decides (the same object is the same array), so
    finding them costs nothing per coordinate, and equal arrays built separately are simply sent twice."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self._key: dict[int, int] = {}
        self._keep: list[np.ndarray] = []  # the originals, so their ids stay theirs while the round runs

    def key(self, arr: np.ndarray, pack: bool = False) -> int:
        k = self._key.get(id(arr))
        if k is None:
            k = self._key[id(arr)] = len(self.arrays)
            self.arrays.append(np.packbits(arr) if pack else arr)
            self._keep.append(arr)
        return k


def pack(plans: Sequence[ClientPlan], shared: RoundArrays) -> Batch:
    """One worker's plans as a :class:`Batch` whose arrays are registered in ``shared`` (the round's)."""
    stubs: list[PlanStub] = []
    keys: dict[int, None] = {}  # insertion-ordered set of the shared arrays used
    sizes: dict[int, int] = {}
    for p in plans:
        v = shared.key(p.params)
        keys[v] = None
        m = None
        if p.mask is not None:
            m = shared.key(p.mask, pack=True)
            keys[m] = None
            sizes[m] = p.mask.size
        o = None
        if p.overlay is not None:
            o = (shared.key(p.overlay.values), shared.key(p.overlay.where, pack=True))
            keys.update(dict.fromkeys(o))
            sizes[o[1]] = p.overlay.where.size
        stubs.append(PlanStub(dataclasses.replace(p, params=_NO_PARAMS, mask=None, overlay=None), v, m, o))
    return Batch(tuple(stubs), tuple(keys), sizes)


_PLANS_MASK = np.zeros(0, dtype=np.bool_)  # on the wire: "the coordinates of my plan's mask" (restore)


def strip_result(result: ClientResult, plan: ClientPlan) -> ClientResult:
    """``result`` as it travels back: its ``mask`` (messages.py: the coordinates its values hold) replaced by a
    marker when it is the plan's own (the pool has that one), else packed to bits (a hook's own choice)."""
    if result.mask is not None:
        result.mask = _PLANS_MASK if result.mask is plan.mask else np.packbits(result.mask)
    return result


def restore_result(result: ClientResult, plan: ClientPlan) -> ClientResult:
    """The inverse of :func:`strip_result` on the pool's side, with the plan the result answers."""
    m = result.mask
    if m is not None:
        result.mask = plan.mask if m.dtype == np.bool_ and m.size == 0 else np.unpackbits(
            m, count=plan.params.size).view(np.bool_)
    return result


def payload_bytes(obj: Any) -> int:
    """Bytes ``obj`` takes pickled with its numpy buffers out of band (protocol 5, as Ray sends them):
    the pickle stream plus every buffer, without copying the buffers."""
    sizes: list[int] = []

    def count(buf: pickle.PickleBuffer) -> bool:
        sizes.append(buf.raw().nbytes)
        return False  # out of band: not copied into the stream

    return len(pickle.dumps(obj, protocol=5, buffer_callback=count)) + sum(sizes)


def batch_bytes(batch: Batch, shared: RoundArrays, held: set[int] | None = None) -> int:
    """What a worker receives for ``batch``: its stubs and one copy of each shared array it uses that it does not
    hold yet (``held``: the keys it received earlier this round, updated here; None: it holds none)."""
    new = [k for k in batch.keys if held is None or k not in held]
    if held is not None:
        held.update(new)
    return payload_bytes(batch) + sum(shared.arrays[k].nbytes for k in new)


def pieces(share: Sequence[ClientPlan], most: int, piece_bytes: int) -> list[list[ClientPlan]]:
    """A worker's ``share`` cut into consecutive pieces, one per ``piece_bytes`` of float32 values its results will
    send back (``4 x covered`` a plan), at most ``most`` and at least one; equal sizes but the last."""
    back = sum(4 * p.covered for p in share)
    n = min(most, max(1, math.ceil(back / piece_bytes)), max(1, len(share)))
    size = max(1, math.ceil(len(share) / n))
    return [list(share[i:i + size]) for i in range(0, len(share), size)]


def expected_work(plan: ClientPlan, n_samples: int) -> float:
    """A plan's expected training work, to share a round evenly: samples x epochs x the fraction of the
    model it trains (what its compute grows with)."""
    return float(n_samples * plan.local_epochs * (plan.covered / max(1, plan.params.size)))


def longest_first(plans: Sequence[ClientPlan], work: Sequence[float], workers: int) -> list[list[ClientPlan]]:
    """The plans shared among ``workers`` by expected ``work`` (one number per plan): longest first, each
    to the least-loaded worker so far (ties: the lower worker index, then the lower client id), so no
    worker idles at the end while another still has a long client queued. Deterministic."""
    order = sorted(range(len(plans)), key=lambda i: (-work[i], plans[i].client_id))
    load = [0.0] * workers
    out: list[list[ClientPlan]] = [[] for _ in range(workers)]
    for i in order:
        w = min(range(workers), key=lambda j: (load[j], j))
        out[w].append(plans[i])
        load[w] += work[i]
    return out
