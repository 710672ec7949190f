"""Where dataset files are looked for, and the table behind ``fedsap-ray datasets``.

The location helpers live here (not in each loader) so every real source resolves
its default root, its cache and its "missing file" message the same way, and the
status table reports exactly the paths a load would read.
"""
from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable

import numpy as np

from fedsap_ray.data import cachefile
from fedsap_ray.data.registry import DatasetUnavailable, FileStatus

REPO_ROOT = Path(__file__).resolve().parents[2]


def data_home(name: str) -> Path:
    """Default root of dataset ``name``: ``$FEDSAP_RAY_DATA/<name>`` or ``~/.cache/fedsap_ray/data/<name>``."""
    base = os.environ.get("FEDSAP_RAY_DATA")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "fedsap_ray" / "data") / name


def cache_home() -> Path:
    """Cache for derived arrays (decoded JPEGs, rendered digits): ``$FEDSAP_RAY_CACHE`` or ``~/.cache/fedsap_ray``."""
    base = os.environ.get("FEDSAP_RAY_CACHE")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "fedsap_ray"


def shared_data_root() -> Path:
    """The shared real-file folder: ``$FEDSAP_SHARED_DATA``, else ``../shared/data`` from CWD or the repo.

    Returns the repo-relative candidate when none exists so error messages name a real,
    predictable path.
    """
    env = os.environ.get("FEDSAP_SHARED_DATA")
    if env:
        return Path(env).expanduser()
    candidates = [Path.cwd() / ".." / "shared" / "data", REPO_ROOT / ".." / "shared" / "data"]
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    return candidates[-1].resolve()


def default_root(name: str, files: Callable[[Path], list[FileStatus]]) -> Path:
    """The ONE default-root rule of every file-backed loader (so ``fedsap-ray datasets`` and a load agree):
    the first of ``data_home(name)`` and :func:`shared_data_root` under which ``files(root)`` reports every
    required file present; when neither holds them, ``data_home(name)`` (where ``download=True`` writes)."""
    candidates = [data_home(name), shared_data_root()]
    for root in candidates:
        try:
            if all(s.present for s in files(root)):
                return root
        except OSError:  # an unreadable candidate is not a default
            continue
    return candidates[0]


def atomic_save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Write an uncompressed ``.npz`` cache whole or not at all, with its arrays' digests, so a crash never
    leaves a half cache and a changed one is noticed (:func:`fedsap_ray.data.cachefile.write_npz`, the file's
    folder as its root); mode 0644: a cache is meant to be shared like any data file."""
    cachefile.write_npz(Path(path).parent, Path(path), arrays)


def unavailable(dataset: str, missing: list[tuple[str, Path, str]]) -> DatasetUnavailable:
    """One-line error: for each missing item, what it is, the exact path looked at, and how to get it."""
    parts = [f"{what} not found at {path} ({how})" for what, path, how in missing]
    return DatasetUnavailable(f"{dataset}: " + "; ".join(parts))


def first_present(what: str, candidates: list[Path]) -> FileStatus:
    """Status of the first existing candidate path, else of the first (preferred) one."""
    for p in candidates:
        if p.exists():
            return FileStatus(what, p, True)
    return FileStatus(what, candidates[0], False)


def dataset_table(root: Path | None = None) -> list[dict]:
    """One row per registered dataset for ``fedsap-ray datasets``.

    ``root`` (e.g. the shared-data folder holding ``mnist/``, ``usps/``, ...) is used for
    every dataset when given; otherwise each dataset's own default root.
    Keys: name, description, root, present (all required files found), missing (list of "what: path"), how_to_obtain.
    The installed dataset plugins not loaded yet follow, named by their entry points (none is imported here).
    """
    import fedsap_ray.data  # noqa: F401  (registers every source)
    from fedsap_ray.data.registry import dataset_names, get_source

    rows: list[dict] = []
    for name in dataset_names():
        src = get_source(name)
        r = Path(root).expanduser() if root is not None else src.default_root()
        statuses = src.files(r)
        missing = [f"{s.what}: {s.path}" for s in statuses if not s.present]
        rows.append(
            {
                "name": name,
                "description": src.description,
                "root": str(r),
                "present": not missing,
                "missing": missing,
                "how_to_obtain": src.how_to_obtain,
            }
        )
    from fedsap_ray.config.registry import DATASETS, describe_entry_point

    held = {r["name"] for r in rows}
    for ep in DATASETS.plugin_entry_points():  # installed plugins not loaded yet: listed, not imported
        if ep.name not in held:
            rows.append({"name": ep.name, "description": f"plugin {describe_entry_point(ep)}: loaded when a run names "
                                                         "it (docs/guides/own-data.md#a-plugin)",
                         "root": "(plugin)", "present": True, "missing": [], "how_to_obtain": "an installed plugin"})
    return rows
