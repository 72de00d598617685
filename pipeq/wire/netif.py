"""Network interfaces (Linux): the IPv4 address of an interface.

Used where pipeq binds on a multi-host run (``--bind eth0``).
"""

from __future__ import annotations

import fcntl
import socket
import struct

__all__ = ["interface_address"]


def interface_address(name: str) -> str | None:
    """IPv4 address of network interface ``name`` (Linux SIOCGIFADDR), None if no such interface."""
    if name not in {n for _, n in socket.if_nameindex()}:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            raise ValueError(f"network interface {name!r} has no IPv4 address") from None
    return socket.inet_ntoa(res[20:24])

