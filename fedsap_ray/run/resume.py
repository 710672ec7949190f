"""Whether a run can resume from its checkpoint: the checks a resume makes before anything of the run changes.

Pure checks, apart from the session that applies them (:meth:`fedsap_ray.run.session.RunSession._resume`), so
the rule "every check first, nothing deleted or rewritten before they all pass" reads in one place: the
checkpoint's format and content against the run (:mod:`fedsap_ray.persist.statecheck`), the strategy's state it
holds, and the runs row the run started with (the same config, the same partition). Each refusal is one line
naming the run and what differs (exit code 2).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.algorithms.statetree import state_from_tree, state_tree
from fedsap_ray.common.errors import CheckpointUnreadable, ConfigError
from fedsap_ray.config.schema import ExperimentConfig
from fedsap_ray.persist import checkpoint, statecheck
from fedsap_ray.results import DATA_TABLES


def load_checked(out: Path, run_id: str, ctx: RunContext, strategy: Any, recorder_template: dict[str, Any],
                 rounds: int) -> tuple[dict[str, Any], str]:
    """(the run's checkpoint, checked against this run's model, federation, strategy and recorder; the ``where``
    its refusals start with)."""
    ck = checkpoint.load(out, run_id)
    where = f"invalid --resume={run_id!r}: checkpoint {checkpoint.path_for(out, run_id)}"
    statecheck.check_state(ck, n_params=ctx.layout.size, n_clients=len(ctx.federation.clients),
                           strategy=strategy, recorder_template=recorder_template,
                           strategy_template=state_tree(strategy, strategy.init_state().strategy_state),
                           rounds=rounds, known_tables=DATA_TABLES, where=where)
    return ck, where


def strategy_state(strategy: Any, tree: Any, run_id: str, out: Path, name: str) -> Any:
    """The strategy's own state from its checkpoint tree; a State whose fields changed since the checkpoint was
    written is :class:`CheckpointUnreadable` (start the run again)."""
    try:
        return state_from_tree(strategy, tree)
    except TypeError as e:
        raise CheckpointUnreadable(f"checkpoint of run {run_id} in {out} holds {name} state "
                                   f"this version cannot read ({e}): start the run again with --run-id "
                                   f"{run_id} --overwrite") from e


def check_same_config(run_id: str, old: dict | None, cfg: ExperimentConfig) -> None:
    """A resume runs the config the run was made with (its runs row's ``config_hash``), else one ConfigError."""
    if old is not None and old["config_hash"] != cfg.config_hash():
        raise ConfigError(f"invalid --resume={run_id!r}: the run was made with another config "
                          f"(hash {old['config_hash']}, now {cfg.config_hash()})")


def check_same_partition(run_id: str, old: dict | None, row: dict) -> None:
    """A resume trains exactly the federation the run started with: the ``partition_hash`` its runs row recorded
    (rows written before the column have none: nothing to compare). Otherwise one :class:`ConfigError` naming
    where each came from and both hashes, before anything of the run changes."""
    before = None if old is None else old.get("partition_hash")
    if before is None or before == row["partition_hash"]:
        return
    assert old is not None
    was, now = old.get("partition_source"), row["partition_source"]
    what = f"{now} now gives hash {row['partition_hash']}" if was == now else \
        f"this resume's {now} gives hash {row['partition_hash']}"
    raise ConfigError(f"invalid --resume={run_id!r}: the run trained dataset {old.get('dataset')} split by {was} "
                      f"(partition hash {before}); {what}: the partition file, the dataset's data or the given "
                      "federation changed since; restore it, or start a new run")
