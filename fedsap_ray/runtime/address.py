"""Is a Ray address worth joining? Checked in seconds, before ``ray.init`` (which waits minutes on an address
where nothing answers) and before a sweep plans its trials.

:func:`check_reachable` takes an address as ``--address``, ``resources.address`` or ``RAY_ADDRESS`` hold it
and refuses, with one line naming whichever the user set, a malformed one (the rule of
:func:`fedsap_ray.config.checks.check_ray_address`), ``auto`` when no Ray cluster runs on this machine, and a
HOST:PORT (or ``ray://HOST:PORT``) where nothing accepts a TCP connection within :data:`CONNECT_TIMEOUT_S`.
Ray itself is imported only to find the cluster ``auto`` means.
"""
from __future__ import annotations

import os
import socket

from fedsap_ray.common.errors import ConfigError
from fedsap_ray.config.checks import check_ray_address

CONNECT_TIMEOUT_S = 3.0  # a cluster's GCS (or Ray client server) answers a TCP connect well within this
ENV = "RAY_ADDRESS"


def given(address: str | None, field: str) -> tuple[str | None, str]:
    """(the address to join, the name to blame): ``address`` under ``field``, else ``RAY_ADDRESS`` from the
    environment under its own name, else (None, field): a local Ray is started."""
    if address:
        return address, field
    env = os.environ.get(ENV)
    return (env, ENV) if env else (None, field)


def split(address: str) -> tuple[str, int]:
    """``HOST:PORT`` / ``ray://HOST:PORT`` / ``[v6]:PORT`` -> (host, port); the syntax was checked already."""
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def check_reachable(address: str | None, field: str, *, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse (``ConfigError``, one line naming ``field``) an address Ray could not join; see the module docstring.
    ``None`` and ``local`` (start a local Ray) pass."""
    check_ray_address(field, address)
    if address is None or address == "local":
        return
    target = address
    if address == "auto":
        target = _auto_address(field)
    host, port = split(target)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        via = f" (auto found the cluster at {target})" if address == "auto" else ""
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or e.__class__.__name__)
        raise ConfigError(f"invalid {field}={address!r}: no Ray cluster answers at {host}:{port}{via} within "
                          f"{timeout:g} s ({why}); start it (ray start --head) or give the address its head node "
                          "printed") from None


def _auto_address(field: str) -> str:
    """The HOST:PORT ``auto`` means (as ``ray.init`` finds it: ``RAY_ADDRESS``, else the cluster last started
    on this machine), or a refusal when there is none."""
    from ray._private import services

    try:
        found = services.canonicalize_bootstrap_address_or_die("auto")
    except (ConnectionError, ValueError, RuntimeError) as e:
        first = (str(e).splitlines() or [""])[0]
        cause = "no Ray cluster is running on this machine" if isinstance(e, ConnectionError) and \
            "multiple" not in first else first.rstrip(".")
        raise ConfigError(f"invalid {field}='auto': {cause}; start one (ray start --head), give its HOST:PORT, "
                          f"or leave {field} out for a local Ray") from None
    return found
