"""The network interface gloo binds to in a Ray worker of a multi-node job (unset, often loopback): with
``VERL_CPPACK_GLOO_INTERFACE=ray-node`` the one holding the node's Ray address."""

from __future__ import annotations

import os
import socket

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
INTERFACE_REQUEST_ENV = "VERL_CPPACK_GLOO_INTERFACE"
RAY_NODE_INTERFACE = "ray-node"


def interface_holding(address: str) -> str:
    """The name of this host's network interface that holds the IPv4/IPv6 ``address``; ``RuntimeError`` if none."""
    import psutil  # a Ray dependency

    interfaces = psutil.net_if_addrs()
    for name, addresses in sorted(interfaces.items()):
        if any(
            entry.family in (socket.AF_INET, socket.AF_INET6) and entry.address.split("%")[0] == address
            for entry in addresses
        ):
            return name
    raise RuntimeError(
        f"no network interface of this host holds its Ray node address {address} (interfaces: {sorted(interfaces)}); "
        f"set {GLOO_INTERFACE_ENV} to the interface the other nodes reach"
    )


def bind_gloo_to_ray_node_interface() -> str | None:
    """With ``VERL_CPPACK_GLOO_INTERFACE=ray-node`` and no ``GLOO_SOCKET_IFNAME``: set it to the interface holding
    this node's Ray address. Returns the interface gloo will use (``None``: gloo's own choice)."""
    if os.environ.get(INTERFACE_REQUEST_ENV, "").strip() == RAY_NODE_INTERFACE and not os.environ.get(
        GLOO_INTERFACE_ENV
    ):
        import ray.util

        os.environ[GLOO_INTERFACE_ENV] = interface_holding(ray.util.get_node_ip_address().strip("[]"))
    return os.environ.get(GLOO_INTERFACE_ENV) or None
