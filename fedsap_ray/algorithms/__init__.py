"""Strategies: the contract, the helpers they share, one module per method, registered by name.

May import: common, config, models, data.

What a run's server side holds and the view a strategy gets of it (``context``), the masked aggregation
rule and the grouping measures live here too: only strategies and the engine above them use them
(docs/architecture.md#strategies).
"""
from fedsap_ray.algorithms import fedavg, fedprox, fedsap  # noqa: F401  (registration)
from fedsap_ray.algorithms import fjord, hasfl, heterofl, random_budget, uniform  # noqa: F401  (papers/003)
from fedsap_ray.algorithms import scaffold  # noqa: F401
from fedsap_ray.algorithms import dapperfl  # noqa: F401
from fedsap_ray.algorithms import moon  # noqa: F401
from fedsap_ray.algorithms import fedsr  # noqa: F401
from fedsap_ray.algorithms import fpl  # noqa: F401
from fedsap_ray.algorithms import fedspu  # noqa: F401
from fedsap_ray.algorithms import feddrop  # noqa: F401
from fedsap_ray.algorithms import fedmp  # noqa: F401
from fedsap_ray.algorithms import nefl  # noqa: F401
from fedsap_ray.algorithms import fedrolex  # noqa: F401
from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.algorithms.context import RunContext
from fedsap_ray.algorithms.registry import get, names, parse_options, register

__all__ = ["RunContext", "Strategy", "get", "names", "parse_options", "register"]
