"""Datasets (registered by name), partitions, capacities and the Federation a run trains on.

Importing this package registers every dataset module listed below.
"""
from fedsap_ray.data import embedded  # noqa: F401  (registers embedded_digits)
from fedsap_ray.data import cifar, digits, emnist, mnist, office, shakespeare  # noqa: F401  (register the real datasets)
from fedsap_ray.data.base import ClientSpec, DomainData, Federation, as_input
from fedsap_ray.data.federation import build_federation, load_splits

__all__ = ["ClientSpec", "DomainData", "Federation", "as_input", "build_federation", "load_splits"]
