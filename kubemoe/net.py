"""Loopback helpers shared by the local modes (kubemoe serve) and the local control plane."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_given: set[int] = set()  # ports this process handed out, never handed out twice


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port free on every interface right now, for a server the caller starts soon after.

    Drawn below the kernel's ephemeral range: a port from bind(0) can become the source port of any outgoing
    connection between this choice and the caller's bind (CI saw a rendered pod's --data-port taken so)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(1024, low)
        if port in _given:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise OSError(f"no free TCP port below the ephemeral range (< {low}) after 200 tries")
