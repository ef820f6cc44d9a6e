"""The learner's HTTP transport, counting the bytes at the socket (``diloco_core.wire``) of every
connection it opens: request and response heads, bodies, long-polls, TLS included. Where the kernel
does not give a socket's counters, what was written and read through the connection is counted."""

from __future__ import annotations

import ssl
import typing

import httpcore
import httpx
from diloco_core.wire import WireTally, socket_bytes


class _CountedStream(httpcore.NetworkStream):
    def __init__(
        self, inner: httpcore.NetworkStream, tally: WireTally, carried: tuple[int, int] = (0, 0)
    ) -> None:
        self.inner, self.tally = inner, tally
        self.written, self.read_bytes = carried
        self._closed = False
        tally.opened(id(self), self.counts)

    def counts(self) -> tuple[int, int]:
        at_socket = socket_bytes(self.inner.get_extra_info("socket"))
        return at_socket if at_socket is not None else (self.written, self.read_bytes)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = self.inner.read(max_bytes, timeout)
        self.read_bytes += len(data)
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, timeout)
        self.written += len(buffer)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.tally.closed(id(self), self.counts())
        self.inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        upgraded = self.inner.start_tls(ssl_context, server_hostname, timeout)
        self.tally.forget(id(self))  # the TLS stream's socket counts the connection from its start
        self._closed = True
        return _CountedStream(upgraded, self.tally, (self.written, self.read_bytes))

    def get_extra_info(self, info: str) -> typing.Any:
        return self.inner.get_extra_info(info)


class _CountingBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend, tally: WireTally) -> None:
        self.inner, self.tally = inner, tally

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self.inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _CountedStream(stream, self.tally)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        return _CountedStream(self.inner.connect_unix_socket(path, timeout, socket_options), self.tally)

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


def counting_transport(tally: WireTally, verify: ssl.SSLContext | bool = True) -> httpx.HTTPTransport:
    """httpx's own transport, its connections counted into ``tally``."""
    transport = httpx.HTTPTransport(verify=verify)
    pool = transport._pool  # httpcore.ConnectionPool: its backend is where connections are made
    pool._network_backend = _CountingBackend(pool._network_backend, tally)
    return transport
