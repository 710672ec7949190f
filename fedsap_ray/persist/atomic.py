"""Local files that appear whole or not at all: the one write-temp-then-rename rule of the package
(results tables, checkpoints, dataset caches, files pulled from a results destination).

A run or a cache build killed at any moment (or a full disk) must never leave a truncated file
under the final name, and must not leave its temporary file either: it may be as large as a model.
"""
from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO
from collections.abc import Iterator


def temp_name(path: Path) -> Path:
    """``.<name>.<8 hex>.tmp`` beside ``path``: hidden, and recognisable by the cleanups that glob for it
    (``remove_temp_files`` in :mod:`fedsap_ray.results` and :mod:`fedsap_ray.persist.checkpoint`)."""
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"


@contextmanager
def atomic_write(path: str | Path, *, mode: int | None = None) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s bytes into; they appear at ``path`` (``os.replace``) only when the
    block ends without an error, and the temporary file is removed on any error (KeyboardInterrupt too).

    ``mode``: permission bits given to the file before it appears (e.g. ``0o644`` for a shared cache,
    whatever the umask); None keeps what ``open`` gives. An ``OSError`` that names no file (a write
    on a full disk says only "No space left on device") gets ``path`` as its file name, so the
    message says which file could not be written.
    """
    path = Path(path)
    tmp = temp_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            yield f
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is None and e.errno is not None:
            e.filename = str(path)
        raise
    finally:
        tmp.unlink(missing_ok=True)  # gone already after a successful replace
