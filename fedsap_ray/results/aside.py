"""``--overwrite`` without losing the old run: its files are moved aside, not deleted, until the new run
has proved itself by writing its first checkpoint.

The old run's per-run files, parts, checkpoint and kept models (its ``models/<run_id>`` folder, whole) move to
``OUT/.aside/<run_id>/`` (one rename each, same filesystem; readers never look there: names starting with ``.``
are not results). Then:

- the new run writes its first checkpoint: :func:`commit` deletes what was set aside and the old run's
  rows in compacted files (until then a compacted file may still hold them: a reader sees the new run's
  tables where it has written them, the old rows elsewhere);
- the new run fails, is interrupted or is refused before that: :func:`restore` deletes the new run's
  files and moves the old ones back, byte for byte;
- the process is killed in between: the next command that claims the run id (:func:`recover`, called by
  :func:`fedsap_ray.run.guard.claimed`) finishes the one that applies: commit when the new run's checkpoint
  exists, else restore.

Everything goes through :class:`fedsap_ray.persist.outdir.OutDir`.
"""
from __future__ import annotations

from pathlib import Path

from fedsap_ray.persist.outdir import OutDir
from fedsap_ray.results import kept
from fedsap_ray.results.writer import drop_compacted, run_files

ASIDE = ".aside"
CHECKPOINTS = "checkpoints"


def folder(out: Path, run_id: str) -> Path:
    """Where an overwritten run's files wait: ``OUT/.aside/<run_id>``."""
    return Path(out) / ASIDE / run_id


def _checkpoint_files(d: OutDir, run_id: str) -> list[Path]:
    return [p for p in (d.abs / CHECKPOINTS / f"{run_id}.npz", d.abs / CHECKPOINTS / f"{run_id}.pkl") if d.is_file(p)]


def _models(d: OutDir, run_id: str) -> list[Path]:
    """The run's kept models folder, when it has one (moved whole: :mod:`fedsap_ray.results.kept`)."""
    where = kept.folder(d.abs, run_id)
    return [where] if d.is_dir(where) else []


def set_aside(out: Path, run_id: str) -> int:
    """Move run ``run_id``'s per-run files, parts, checkpoint and kept models to :func:`folder`; return how many
    entries moved (the models folder counts as one)."""
    d = OutDir(out)
    dest = folder(out, run_id)
    moved = 0
    for f in [*run_files(out, run_id), *_checkpoint_files(d, run_id), *_models(d, run_id)]:
        d.replace(f, dest / d.rel(f))
        moved += 1
    d.mkdir(dest)  # present even when only compacted rows were there: commit must still drop them
    return moved


def pending(out: Path, run_id: str) -> bool:
    d = OutDir(out)
    return d.is_dir(folder(out, run_id))


def commit(out: Path, run_id: str) -> None:
    """The new run wrote its first checkpoint: the old run's set-aside files and compacted rows go."""
    drop_compacted(out, run_id)
    d = OutDir(out)
    d.rmtree(folder(out, run_id))
    if not d.listdir(d.abs / ASIDE):
        d.rmtree(d.abs / ASIDE)


def restore(out: Path, run_id: str) -> int:
    """The new run did not get as far as a checkpoint: its files go, the old run's come back; return how
    many came back."""
    d = OutDir(out)
    for f in [*run_files(out, run_id), *_checkpoint_files(d, run_id)]:
        d.unlink(f)
    for m in _models(d, run_id):
        d.rmtree(m)
    src = d.abs / ASIDE / run_id
    back = 0
    for sub in d.listdir(src):
        for name in d.listdir(src / sub):
            d.replace(src / sub / name, d.abs / sub / name)
            back += 1
    d.rmtree(src)
    if not d.listdir(d.abs / ASIDE):
        d.rmtree(d.abs / ASIDE)
    return back


def recover(out: Path, run_id: str) -> str | None:
    """Finish an overwrite a killed process left half done (call under the run's claim): ``"committed"``
    when the new run had checkpointed, ``"restored"`` when not, None when nothing was pending."""
    if not pending(out, run_id):
        return None
    d = OutDir(out)
    if d.is_file(d.abs / CHECKPOINTS / f"{run_id}.npz"):
        commit(out, run_id)
        return "committed"
    restore(out, run_id)
    return "restored"
