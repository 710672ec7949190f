"""A strategy's own state (``ServerState.strategy_state``) as the tree a checkpoint stores and back: a declared
``State`` dataclass goes in by its fields, so the code-free format (:mod:`fedsap_ray.persist.treecodec`) never stores a
class."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsap_ray.algorithms.contract import Strategy


def state_tree(strategy: Strategy, strategy_state: Any) -> dict[str, Any]:
    """``strategy_state`` as a dict of storable values: its fields when it is the dataclass the strategy declares as
    ``State``, else the dict itself."""
    if strategy.State is not None:
        return {f.name: getattr(strategy_state, f.name) for f in dataclasses.fields(strategy.State)}
    return strategy_state


def state_from_tree(strategy: Strategy, tree: dict[str, Any]) -> Any:
    """Inverse of :func:`state_tree` (a checkpoint's strategy state back as the strategy's ``State``)."""
    return strategy.State(**tree) if strategy.State is not None else tree
