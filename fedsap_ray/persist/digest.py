"""Content digests of arrays and JSON: the one rule every cached or checkpointed file is checked by.

Why: a file that keeps its shape and dtype can still hold other numbers (labels replaced by other
valid labels, flipped bytes inside an uncompressed ``.npy``, a ``meta.json`` edited after samples were
dropped). Shape checks and zip CRCs do not see all of that; a sha256 of the content, written when the
file is built and compared before its first use, does.

What a digest proves, and what it does not: it refuses accidental damage and edits made without
recomputing it. Whoever can write the file can also write a new digest, so a deliberate, consistent
edit (the numbers changed *and* the digest recomputed) is taken on trust, like any data file a user
points a run at; docs/guides/running.md says so.

The digest of a set of named arrays covers, for each name in sorted order, the name, the dtype (with
its byte order), the shape and the bytes in C order; the digest of a JSON document covers its
canonical text (sorted keys, no spaces); the digest of a file, its bytes. All are ``sha256:<64 hex>``
strings, so the algorithm is named wherever a digest is stored.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, BinaryIO

import numpy as np

ALGORITHM = "sha256"
PREFIX = ALGORITHM + ":"


def _update_array(h: Any, name: str, a: np.ndarray) -> None:
    a = np.asarray(a)
    if a.dtype.hasobject:
        raise TypeError(f"{name}: arrays of Python objects have no content digest")
    h.update(json.dumps([name, a.dtype.str, list(a.shape)], separators=(",", ":")).encode() + b"\0")
    if a.size:
        c = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        h.update(c.reshape(-1).view(np.uint8).data)  # the buffer itself: no copy


def arrays_digest(arrays: Mapping[str, np.ndarray], *, meta: Any = None) -> str:
    """The digest of named arrays (and of a JSON-able ``meta`` beside them, when given).

    Memory-mapped arrays are read through their maps, once: the pages they pull into the page cache
    are those the first use would pull anyway.
    """
    h = hashlib.new(ALGORITHM)
    if meta is not None:
        h.update(b"meta\0" + canonical_json(meta) + b"\0")
    for name in sorted(arrays):
        _update_array(h, name, arrays[name])
    return PREFIX + h.hexdigest()


def array_digest(a: np.ndarray) -> str:
    """The digest of one array (its dtype, shape and bytes; no name)."""
    return arrays_digest({"": a})


def file_digest(f: BinaryIO) -> str:
    """The digest of the bytes of an open binary file, read from its current position to the end (a cache's
    generated code, compared byte for byte: no structure to name)."""
    h = hashlib.new(ALGORITHM)
    for block in iter(lambda: f.read(1 << 20), b""):  # hashlib.file_digest is Python 3.11's; we support 3.10
        h.update(block)
    return PREFIX + h.hexdigest()


def canonical_json(doc: Any) -> bytes:
    """``doc`` as the one JSON text its digest is taken over (sorted keys, no spaces, no NaN)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def json_digest(doc: Any) -> str:
    """The digest of a JSON-able document's canonical text."""
    return PREFIX + hashlib.new(ALGORITHM, canonical_json(doc)).hexdigest()


def is_digest(value: Any) -> bool:
    """Whether ``value`` looks like a digest this module writes (``sha256:`` and 64 lowercase hex digits)."""
    if not isinstance(value, str) or not value.startswith(PREFIX):
        return False
    hexpart = value[len(PREFIX):]
    return len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)
