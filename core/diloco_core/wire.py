"""Bytes at the socket: what a TCP connection carried each way, from the kernel's own counters.

On Linux ``TCP_INFO`` gives, per socket, the bytes the peer acknowledged (sent) and the bytes
received: everything the connection carried above TCP — request and response heads, bodies,
chunked framing, TLS records and handshakes — so a count made from it is what crosses the wire,
not what the application meant to send. Where ``TCP_INFO`` is not available (another system),
``socket_bytes`` answers None and the caller counts what it wrote and read itself.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

_TCP_INFO_LEN = 256
_BYTES_AT = 120  # struct tcp_info: tcpi_bytes_acked (u64), then tcpi_bytes_received (u64)


_PEER_FIN_IN = frozenset({6, 8, 9, 11})  # TIME_WAIT, CLOSE_WAIT, LAST_ACK, CLOSING: the peer's FIN is in
_OWN_FIN_ACKED = frozenset({5, 6, 7})  # FIN_WAIT2, TIME_WAIT, CLOSE: ours was acknowledged


def socket_bytes(sock: socket.socket | None, *, initiated: bool = True) -> tuple[int, int] | None:
    """(sent, received) bytes of a TCP socket since it connected, or None where the kernel does not
    say (not Linux, not TCP, closed). The kernel counts a SYN and a FIN as one byte each where they
    move the sequence numbers (the SYN of the side that ``initiated`` the connection, the FINs);
    they are taken out, so the counts are the bytes the connection carried."""
    option = getattr(socket, "TCP_INFO", None)
    if sock is None or option is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_LEN)
    except (OSError, ValueError):
        return None
    if len(info) < _BYTES_AT + 16:
        return None
    state = info[0]
    acked, received = struct.unpack_from("<QQ", info, _BYTES_AT)
    acked -= int(initiated) + int(state in _OWN_FIN_ACKED)
    received -= int(state in _PEER_FIN_IN)
    return max(0, acked), max(0, received)


class WireTally:
    """The bytes of a set of connections, each way: those closed, plus the open ones as they stand.

    A connection registers a ``counts`` function (its socket's counters, or what it wrote and read)
    while open and hands in its last counts when it closes. Safe to share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, Callable[[], tuple[int, int]]] = {}
        self._done = (0, 0)

    def opened(self, key: int, counts: Callable[[], tuple[int, int]]) -> None:
        with self._lock:
            self._open[key] = counts

    def closed(self, key: int, last: tuple[int, int] | None = None) -> None:
        """The connection ``key`` is done: add its ``last`` counts (or its counts now)."""
        with self._lock:
            counts = self._open.pop(key, None)
            final = last if last is not None else (counts() if counts is not None else (0, 0))
            self._done = (self._done[0] + final[0], self._done[1] + final[1])

    def forget(self, key: int) -> None:
        """Stop counting ``key`` without adding it (a connection whose counting moved elsewhere)."""
        with self._lock:
            self._open.pop(key, None)

    def totals(self) -> tuple[int, int]:
        """(sent, received) over every connection so far."""
        with self._lock:
            sent, received = self._done
            for counts in self._open.values():
                s, r = counts()
                sent, received = sent + s, received + r
        return sent, received
