"""The federation a run trains on: datasets (registered by name), partitions, capacities, each client's simulated device.

May import: common, config, persist.

Importing this package registers every dataset module listed below.
"""
# one import line per dataset module; the order is the order `data.name`'s allowed values are listed in
from fedsap_ray.data import embedded  # noqa: F401  (registers embedded_digits)
from fedsap_ray.data import digits, office  # noqa: F401  (digits, digits_offline; office_caltech)
from fedsap_ray.data import cifar, emnist, mnist, shakespeare  # noqa: F401  (the one-domain datasets)
from fedsap_ray.data import generated  # noqa: F401  (generated_blobs: the scale benchmark's load)
from fedsap_ray.data.base import ClientSpec, DomainData, Federation, as_input, input_transform
from fedsap_ray.data.explicit import ExplicitClient, ExplicitPartition, read_partition
from fedsap_ray.data.federation import build_federation, load_splits
from fedsap_ray.data.own import register_arrays, register_loader

__all__ = ["ClientSpec", "DomainData", "ExplicitClient", "ExplicitPartition", "Federation", "as_input", "build_federation",
           "input_transform", "load_splits", "read_partition", "register_arrays", "register_loader"]
