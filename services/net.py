"""Small networking helpers shared by the services and their tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (for servers that take a fixed port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
