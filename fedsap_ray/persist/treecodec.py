"""A serialisation of state trees that cannot run code when read: a JSON skeleton plus numpy arrays.

Checkpoints are read back from results folders that other people may have written (a shared sweep
folder, a bucket), so reading one must never execute anything: pickle would. This codec accepts
exactly the types a run's state is made of and writes them to one ``.npz`` file, read with
``allow_pickle=False``:

- ``None``, ``bool``, ``int`` (any size), ``float`` (NaN, infinities and -0.0 included), ``str``;
- ``list``, ``tuple`` and ``dict`` (keys: ``None``/``bool``/``int``/``float``/``str`` or tuples of them),
  each kept as its own type, so ``(1, 2)`` stays a tuple and the key ``1`` stays an int;
- ``numpy.ndarray`` (any dtype but ``object``) and numpy scalars (``np.float32(1)`` stays one);
- ``torch.Tensor`` (CPU; dtype and shape kept, ``requires_grad`` and the device are not).

Exact types only: a subclass (an ``OrderedDict``, a ``defaultdict``, an ``IntEnum``, a masked array)
would come back as something else, so it is refused at save time with an error naming its key path,
as is any other type. The same array object reached twice is stored once and comes back as one
object (as pickle would), so aliasing in a strategy's state survives a resume.

Every file of format version 2 carries a content digest (:mod:`fedsap_ray.persist.digest`: sha256 over the JSON
header and skeleton and over every array's name, dtype, shape and bytes), written with the file and compared
when it is read: flipped bytes inside an array (an uncompressed npz member has no checksum of its own the
reader checks), a member or the skeleton rewritten by hand, a value nudged, an entry dropped, each without
the digest recomputed, are a :class:`DigestMismatch`. A deliberate edit that recomputes the digest is taken
on trust, like any file a user points a run at (docs/guides/running.md). Version 1 files (written before
the digest) are read as they always were, without one: a checkpoint left by an interrupted run of an
older fedsap_ray still resumes, and its content is still checked against the run
(:mod:`fedsap_ray.persist.statecheck`).
"""
from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from fedsap_ray.persist import digest

FORMAT = "fedsap_ray.tree"
VERSION = 2  # 2: the content digest (module docstring)
READS = (1, 2)  # version 1: the same layout without a digest, read as before
META = "__tree__"  # the JSON skeleton, stored as a uint8 array beside the data arrays
DIGEST = "digest"  # the header key of the content digest

_KEY_TYPES = (type(None), bool, int, float, str)


class TreeTypeError(TypeError):
    """A value the codec does not store; the message names its key path and type."""


class TreeFormatError(ValueError):
    """A file that is not a tree this version of the codec wrote (damaged, another format or version)."""


class DigestMismatch(TreeFormatError):
    """A well-formed file whose content is not what was written: its digest does not match (damaged or edited)."""


def _path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path) or "(the top level)"


class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self._memo: dict[int, str] = {}  # id(array or tensor) -> its array name
        self._keep: list[Any] = []  # keeps memoised objects alive, so their ids stay theirs

    def _store(self, obj: Any, arr: np.ndarray, where: tuple[Any, ...]) -> str:
        if arr.dtype.hasobject:
            raise TreeTypeError(f"state{_path(where)}: arrays of dtype {arr.dtype} (Python objects) are not stored; "
                                "use a numeric dtype")
        name = self._memo.get(id(obj))
        if name is None:
            name = f"a{len(self.arrays)}"
            self.arrays[name] = arr
            self._memo[id(obj)] = name
            self._keep.append(obj)
        return name

    def node(self, x: Any, where: tuple[Any, ...]) -> Any:
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return x if abs(x) < 2**53 else {"i": str(x)}  # JSON readers other than Python's lose big ints
        if t is float:
            return x if math.isfinite(x) else {"f": repr(x)}  # strict JSON has no NaN/Infinity
        if t is list:
            return {"l": [self.node(v, (*where, i)) for i, v in enumerate(x)]}
        if t is tuple:
            return {"t": [self.node(v, (*where, i)) for i, v in enumerate(x)]}
        if t is dict:
            items = []
            for k, v in x.items():
                items.append([self.key(k, where), self.node(v, (*where, k))])
            return {"d": items}
        if t is np.ndarray:
            return {"a": self._store(x, x, where)}
        if isinstance(x, np.generic) and t.__module__ == "numpy":
            return {"s": self._store(x, np.asarray(x), where)}
        if t.__module__ == "torch" and t.__name__ == "Tensor":
            return self._tensor(x, where)
        raise TreeTypeError(f"state{_path(where)}: values of type {t.__module__}.{t.__qualname__} are not stored in "
                            "checkpoints (allowed: None, bool, int, float, str, list, tuple, dict, numpy arrays and "
                            "scalars, torch tensors)")

    def key(self, k: Any, where: tuple[Any, ...]) -> Any:
        if type(k) in _KEY_TYPES or (type(k) is tuple and all(type(e) in _KEY_TYPES for e in k)):
            return self.node(k, where)
        raise TreeTypeError(f"state{_path(where)}: dict key {k!r} of type {type(k).__qualname__} is not stored in "
                            "checkpoints (allowed keys: None, bool, int, float, str, or tuples of them)")

    def _tensor(self, x: Any, where: tuple[Any, ...]) -> dict[str, Any]:
        import torch

        t = x.detach().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: keep its bits
            arr = t.contiguous().view(torch.int16).numpy()
        else:
            try:
                arr = t.numpy()
            except TypeError as e:
                raise TreeTypeError(f"state{_path(where)}: a torch tensor of dtype {t.dtype} is not stored ({e})") from e
        return {"T": self._store(x, arr.copy(), where), "dtype": dtype}


def encode(tree: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """``tree`` as (a JSON-able skeleton, the arrays it names); :class:`TreeTypeError` on anything else."""
    enc = _Encoder()
    return enc.node(tree, ()), enc.arrays


def decode(skeleton: Any, arrays: dict[str, np.ndarray]) -> Any:
    """The tree :func:`encode` was given, from its skeleton and arrays (:class:`TreeFormatError` if malformed)."""
    memo: dict[str, Any] = {}

    def array(name: Any) -> np.ndarray:
        if not isinstance(name, str) or name not in arrays:
            raise TreeFormatError(f"the skeleton names an array {name!r} the file does not hold")
        return arrays[name]

    def node(n: Any) -> Any:
        if n is None or type(n) in (bool, int, float, str):
            return n
        if type(n) is not dict or len(n) not in (1, 2):
            raise TreeFormatError(f"unexpected node {str(n)[:80]}")
        tag = next(iter(n))
        v = n[tag]
        if tag == "i":
            return int(v)
        if tag == "f":
            if v not in ("nan", "inf", "-inf"):
                raise TreeFormatError(f"unexpected float {v!r}")
            return float(v)
        if tag == "l":
            return [node(e) for e in v]
        if tag == "t":
            return tuple(node(e) for e in v)
        if tag == "d":
            return {node(k): node(e) for k, e in v}
        if tag in ("a", "s", "T") and v in memo:
            return memo[v]
        if tag == "a":
            out: Any = array(v)
        elif tag == "s":
            out = array(v)[()]
        elif tag == "T":
            out = _tensor(array(v), n.get("dtype"))
        else:
            raise TreeFormatError(f"unexpected node tag {tag!r}")
        memo[v] = out
        return out

    try:
        return node(skeleton)
    except (TypeError, ValueError, KeyError, RecursionError) as e:
        if isinstance(e, TreeFormatError):
            raise
        raise TreeFormatError(f"malformed skeleton ({e.__class__.__name__}: {e})") from e


def _tensor(arr: np.ndarray, dtype: Any) -> Any:
    import torch

    want = getattr(torch, str(dtype), None)
    if not isinstance(want, torch.dtype):
        raise TreeFormatError(f"unknown torch dtype {dtype!r}")
    t = torch.from_numpy(arr.copy())
    return t.view(torch.bfloat16) if want == torch.bfloat16 else t.to(want)


def write(f: BinaryIO, tree: Any, header: dict[str, Any] | None = None) -> None:
    """Write ``tree`` (and a small JSON ``header``) to the binary file ``f`` as an uncompressed npz.

    Everything is checked before the first byte is written, so a refused value leaves ``f`` empty. The
    header's ``format``, ``version``, ``tree`` and ``digest`` are the codec's own: those of a header that
    :func:`read` returned are replaced, never written back.
    """
    skeleton, arrays = encode(tree)
    own = {"format", "version", "tree", DIGEST}
    meta = {**{k: v for k, v in (header or {}).items() if k not in own}, "format": FORMAT, "version": VERSION,
            "tree": skeleton}
    meta[DIGEST] = content_digest(meta, arrays)
    text = json.dumps(meta, allow_nan=False, separators=(",", ":")).encode()
    np.savez(f, allow_pickle=False, **{META: np.frombuffer(text, dtype=np.uint8), **arrays})


def read(path: Any) -> tuple[dict[str, Any], Any]:
    """(header, tree) of a file :func:`write` wrote. Arrays are read with ``allow_pickle=False``, the
    skeleton with :func:`json.loads`: nothing in the file can make this run code.
    :class:`TreeFormatError` for anything else (not a zip, another format or version, a damaged member)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise TreeFormatError("not an npz archive")
            names = list(z.files)
            if META not in names:
                raise TreeFormatError("no tree skeleton in the archive")
            meta = json.loads(z[META].tobytes().decode())
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise TreeFormatError("not a fedsap_ray tree file")
            if type(meta.get("version")) is not int or meta["version"] not in READS:
                raise TreeFormatError(f"format version {meta.get('version')!r}; this fedsap_ray reads version "
                                      f"{' or '.join(map(str, READS))}")
            arrays = {n: z[n] for n in _names(meta.get("tree"))}
        check_digest(meta, arrays)
    except TreeFormatError:
        raise
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError, MemoryError,
            RecursionError) as e:
        raise TreeFormatError(f"{e.__class__.__name__}: {e}") from e
    header = {k: v for k, v in meta.items() if k not in ("tree", DIGEST)}
    return header, decode(meta.get("tree"), arrays)


def content_digest(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
    """The digest of a file's content: its JSON ``meta`` (header and skeleton, less the digest itself) and
    the arrays the skeleton names (:func:`fedsap_ray.persist.digest.arrays_digest`)."""
    return digest.arrays_digest(arrays, meta={k: v for k, v in meta.items() if k != DIGEST})


def check_digest(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """A version 2 file's content against the digest it carries (:class:`DigestMismatch`); version 1 has none."""
    if meta.get("version") == 1:
        return
    stored = meta.get(DIGEST)
    if not digest.is_digest(stored):
        raise DigestMismatch(f"it carries no content digest ({DIGEST} is {str(stored)[:40]!r})")
    if content_digest(meta, arrays) != stored:
        raise DigestMismatch("its content does not match its digest")


def _names(n: Any) -> Iterator[str]:
    """The array names a skeleton refers to (each read once; unknown ones are reported by :func:`decode`)."""
    stack = [n]
    seen: set[str] = set()
    while stack:
        x = stack.pop()
        if type(x) is dict:
            for tag, v in x.items():
                if tag in ("a", "s", "T") and isinstance(v, str) and v not in seen and v != META:
                    seen.add(v)
                    yield v
                elif isinstance(v, list):
                    stack.extend(v)
        elif isinstance(x, list):
            stack.extend(x)
