"""Small networking helpers shared by the services and their tests."""

from __future__ import annotations

import random
import socket

# Ports handed out for servers that take a fixed port: above Ray's worker ports (10002-19999 by
# default) and below Linux's ephemeral range (32768-60999), where the kernel picks the local port
# of every outgoing connection: a port chosen there can be taken by some process's connection in
# the moment between this check and the server's bind (seen: Serve's proxy failing to bind while
# another cluster ran on the machine).
PORT_RANGE = (20000, 32767)


def free_port(host: str = "127.0.0.1", tries: int = 100) -> int:
    """A TCP port that was free a moment ago on `host` (for servers that take a fixed port),
    drawn at random from PORT_RANGE; the kernel's choice if none of `tries` draws binds."""
    rng = random.SystemRandom()
    for _ in range(tries):
        port = rng.randint(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # (in use)
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
