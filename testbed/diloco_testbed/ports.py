"""Free loopback ports for servers started by the tests."""

from __future__ import annotations

import contextlib
import random
import socket

LOOPBACK = "127.0.0.1"


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that are free right now (the kernel picks them)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((LOOPBACK, 0))
            ports.append(sock.getsockname()[1])
        return ports


def free_port() -> int:
    return free_ports(1)[0]


def free_port_with_offset(offset: int, *, exclude: set[int] | None = None) -> int:
    """A port `p` with both `p` and `p + offset` free.

    For servers that derive a second port from the first (SeaweedFS dials `http port + 10000`
    for gRPC in places where its flags do not reach).
    """
    taken = exclude or set()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(15000, 65535 - offset)
        if port in taken or port + offset in taken:
            continue
        if _bindable(port) and _bindable(port + offset):
            return port
    raise RuntimeError(f"no free loopback port pair with offset {offset}")


def wait_listening(port: int, host: str = LOOPBACK, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
