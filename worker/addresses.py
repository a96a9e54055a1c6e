"""Network addresses of this host: the address toward the controller, and the interface that holds it."""

from __future__ import annotations

import fcntl
import socket
import struct
from urllib.parse import urlsplit

__all__ = ["address_toward", "interface_of"]


def address_toward(controller: str) -> str:
    """This host's IP address on the route to ``controller`` (``tcp://HOST:PORT``); sends no packet."""
    url = urlsplit(controller)
    host = url.hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, url.port or 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 ``address`` (Linux), or None."""
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _idx, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(res[20:24]) == address:
                return name
    return None
