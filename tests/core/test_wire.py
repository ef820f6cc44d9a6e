"""Bytes at the socket from the kernel's counters, and the tally of a set of connections."""

from __future__ import annotations

import socket
import sys
import time

import pytest
from diloco_core.wire import WireTally, socket_bytes


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO's byte counters are Linux's")
def test_the_kernel_counts_what_a_connection_carried_each_way() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        with client, peer:
            client.sendall(b"x" * 1000)
            assert len(peer.recv(4096)) == 1000
            peer.sendall(b"y" * 300)
            assert len(client.recv(4096)) == 300
            time.sleep(0.05)  # the acknowledgement of the 1000 bytes
            assert socket_bytes(client) == (1000, 300)
            assert socket_bytes(peer, initiated=False) == (300, 1000)
            client.shutdown(socket.SHUT_WR)  # its FIN: not a byte the connection carried
            assert peer.recv(10) == b""
            time.sleep(0.05)
            assert socket_bytes(peer, initiated=False) == (300, 1000)
            assert socket_bytes(client) == (1000, 300)
    assert socket_bytes(None) is None


def test_a_tally_adds_the_closed_connections_and_the_open_ones_as_they_stand() -> None:
    tally = WireTally()
    live = [10, 20]
    tally.opened(1, lambda: (live[0], live[1]))
    tally.opened(2, lambda: (5, 5))
    assert tally.totals() == (15, 25)
    live[:] = [100, 200]
    tally.closed(1)
    tally.closed(2, (7, 8))  # its last counts, handed in at close
    assert tally.totals() == (107, 208)
    tally.opened(3, lambda: (1, 1))
    tally.forget(3)
    assert tally.totals() == (107, 208)
