"""fedsap_ray: Ray-distributed simulation of heterogeneous federated learning."""
__version__ = "0.1.0"
