"""The C allocator's settings for a process that trains: keep freed memory instead of returning it to the OS.

Why. glibc's malloc adapts by default: after a large block is freed it raises its mmap threshold to that
block's size and its trim threshold to twice that, so a round's parameter vectors, activations and
gradients (megabytes each) come from the heap and, as soon as the free space at the heap's top exceeds
the trim threshold, are handed back to the OS, to be faulted in again, page by page, on the next
allocation: a Ray client worker spent a large share of its CPU time in the kernel faulting pages in, the
local backend less; with the thresholds fixed as below, interleaved repeats of ``benchmarks/peers.py`` read
faster rounds on both backends with the same training loss (the figures:
docs/guides/performance.md#the-c-allocator).

What. :func:`tune_malloc` sets, with ``mallopt`` (which also turns the adaptation off): blocks up to
:data:`MMAP_THRESHOLD` come from the heap, free heap space is returned to the OS only past
:data:`TRIM_THRESHOLD`, and the heap grows :data:`TOP_PAD` at a time. The cost is memory held: a process
keeps up to ``TRIM_THRESHOLD`` free at its heap's top instead of returning it. Nothing computed changes
(where a block lives is not what it holds; the golden-number check found every table identical).

When not. Off glibc (macOS, musl), when the user has chosen the allocator's settings (glibc's
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or ``MALLOC_MMAP_MAX_``, or a
``glibc.malloc`` tunable in ``GLIBC_TUNABLES``), or with ``FEDSAP_RAY_MALLOC=default``, nothing is changed.
"""
from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 32 << 20
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h> parameter numbers
ENV = "FEDSAP_RAY_MALLOC"
_GLIBC_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_applied: dict[str, int] | None = None


def tune_malloc() -> dict[str, int] | None:
    """Fix glibc malloc's thresholds in this process (module docstring); the settings applied, or None where
    nothing was changed. Once applied, later calls change nothing and return the same settings."""
    global _applied
    if _applied is not None:
        return _applied
    chosen = any(v in os.environ for v in _GLIBC_VARS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
    if os.environ.get(ENV, "") == "default" or chosen:
        return None
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has mallopt but not these semantics
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD, "top_pad": TOP_PAD}
    for param, value in zip((_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD, _M_TOP_PAD), settings.values()):
        if mallopt(param, value) != 1:  # mallopt returns 1 on success
            return None
    _applied = settings
    return _applied
