"""Limits below the application: request-head and body timeouts and a cap on open connections.

uvicorn closes idle kept-alive connections, but it has no timeout for a request head or body and
no cap that keeps the process below its limit of open files: a client that sends its head one byte
at a time holds a connection, a file descriptor, for as long as it likes, and a few hundred of them
exhaust the descriptors, after which every accept fails (and ``/healthz`` with it).
``guarded_protocol(limits)`` is uvicorn's h11 protocol with:

- a head timeout: a connection has ``header_timeout_s`` to send a whole request head, counted from
  when it opened or from the end of the previous answer; then it is answered 408 and closed;
- a body timeout: a pause longer than ``body_timeout_s`` while a request body is being received
  (and the application is not the one holding the reading back) closes the connection;
- a minimum body rate: a body that has been arriving for ``header_timeout_s`` must have averaged
  ``min_body_rate`` bytes/s since its head (a client sending a byte now and then, each pause within
  the body timeout, holds a connection no longer than that);
- a cap of ``max_connections`` open connections: one more closes a connection that waits for a
  request head to make room — first the one waiting longest among those that sent part of a head
  (a real client's head arrives whole: a part is a slow client) or are idle after an answer, else
  the one that connected first among those that have sent nothing yet (a wave of slow clients
  reconnecting together must not leave a health probe without room). With none such, every
  connection being busy with a request, the new one is answered 503 ``overloaded`` and closed.

Requests in progress (a long-poll, an upload that keeps arriving) are never closed by these limits.

With TLS (``guarded_protocol(limits, tls=context)``) the same limits hold from the TCP accept: the
handshake is part of the head. A connection is counted (and may be closed to make room) while it
negotiates TLS, has ``header_timeout_s`` for its handshake and its head together, and a TLS close
waits at most as long for the peer; one refused by the cap is closed without an answer (nothing can
be answered before the handshake). asyncio's own TLS server would give a handshake 60 s, uncounted.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import ssl
from asyncio import sslproto
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diloco_core.protocol import ErrorBody
from diloco_core.wire import WireTally, socket_bytes
from uvicorn.protocols.http.h11_impl import H11Protocol

from .certificate import ServerCertificate

log = logging.getLogger(__name__)
FD_RESERVE = 64  # descriptors kept for storage, logs, threads and the listening socket
MIN_CONNECTIONS = 8


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    min_body_rate: float = 0.0  # bytes/s (0: none)


def body_too_slow(received: int, elapsed: float, limits: ConnectionLimits) -> bool:
    """True when a body that has been arriving for ``elapsed`` seconds with ``received`` bytes so far
    is below the minimum rate (judged once it has had ``header_timeout_s``)."""
    return (
        limits.min_body_rate > 0
        and elapsed >= limits.header_timeout_s
        and received < limits.min_body_rate * elapsed
    )


def effective_max_connections(configured: int, fd_limit: int) -> int:
    """The cap on open connections: ``configured``, lowered to leave ``FD_RESERVE`` of the process's
    ``fd_limit`` open files for everything else (``resource.RLIM_INFINITY``: no lowering)."""
    if fd_limit == resource.RLIM_INFINITY or fd_limit < 0:
        return configured
    return max(MIN_CONNECTIONS, min(configured, fd_limit - FD_RESERVE))


def open_files_limit() -> int:
    """This process's (soft) limit of open files."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _raw_response(status: int, phrase: str, code: str, reason: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 answer with the protocol's error body, written before the connection closes."""
    body = ErrorBody(code=code, reason=reason, retryable=retry_after is not None).model_dump_json().encode()
    head = [f"HTTP/1.1 {status} {phrase}", "content-type: application/json", f"content-length: {len(body)}"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    head.append("connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@dataclass
class _Connections:
    """The open connections of one server, and those waiting for a request head, oldest first:
    ``fresh`` ones have sent nothing yet; ``slow`` ones sent part of a head or are idle after an
    answer (each maps to when it started waiting)."""

    limits: ConnectionLimits
    wire: WireTally = field(default_factory=WireTally)  # bytes at the socket of every connection
    open: set[GuardedH11Protocol] = field(default_factory=set)
    fresh: OrderedDict[GuardedH11Protocol, float] = field(default_factory=OrderedDict)
    slow: OrderedDict[GuardedH11Protocol, float] = field(default_factory=OrderedDict)

    def admit(self, conn: GuardedH11Protocol, now: float) -> bool:
        """Count ``conn`` in, closing a waiting one to make room; False when none may be closed."""
        if len(self.open) >= self.limits.max_connections:
            victim = next(iter(self.slow), None) or next(iter(self.fresh), None)
            if victim is None:
                return False
            self.forget(victim)
            victim.close_for_room()
        self.open.add(conn)
        return True

    def wait_for_head(self, conn: GuardedH11Protocol, now: float, *, fresh: bool) -> None:
        self.done_waiting(conn)
        (self.fresh if fresh else self.slow)[conn] = now

    def sent_part_of_a_head(self, conn: GuardedH11Protocol, now: float) -> None:
        if self.fresh.pop(conn, None) is not None:
            self.slow[conn] = now

    def done_waiting(self, conn: GuardedH11Protocol) -> None:
        self.fresh.pop(conn, None)
        self.slow.pop(conn, None)

    def forget(self, conn: GuardedH11Protocol) -> None:
        self.open.discard(conn)
        self.done_waiting(conn)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above; ``guarded_protocol`` binds it to its limits."""

    connections_state: _Connections  # set on the subclass ``guarded_protocol`` makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._admitted = False
        self._made = False  # the HTTP connection exists (under TLS: once the handshake is done)
        self._tcp: asyncio.BaseTransport | None = None  # the accepted socket's transport
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._seen_cycle: object = None
        self._body_since: float | None = None  # when the current request's head was whole
        self._body_bytes = 0  # bytes received since then
        self._counted = False  # its bytes at the socket are in the server's tally

    @property
    def _limits(self) -> ConnectionLimits:
        return self.connections_state.limits

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._tcp is None and not self.admit(transport):  # plain HTTP: counted in here
            transport.write(_OVERLOADED)
            transport.close()
            return
        self._made = True
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.count_out()
        if self._made:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:  # answered 503 and closing: nothing it sends is read
            return
        if self._body_since is not None:
            self._body_bytes += len(data)
        super().data_received(data)
        self._after_events()

    def on_response_complete(self) -> None:
        self._cancel(body=True)
        if not self.transport.is_closing():
            self._await_head(fresh=False)
        super().on_response_complete()  # may parse a pipelined request at once
        self._after_events()

    # -- the limits ------------------------------------------------------------------------------

    def admit(self, tcp: asyncio.BaseTransport) -> bool:
        """Count this connection in from its accept (closing a waiting one to make room) and start its
        head timeout; False when the cap refuses it."""
        self._tcp = tcp
        self.connections_state.wire.opened(id(self), self._socket_bytes)
        if not self.connections_state.admit(self, self.loop.time()):
            log.warning(
                "connection limit (%d) reached and every connection is busy with a request or just "
                "connected: refusing new ones",
                self._limits.max_connections,
            )
            return False
        self._admitted = True
        self._await_head(fresh=True)
        return True

    def count_out(self) -> None:
        """The connection is gone (also one whose TLS handshake never finished): its bytes at the
        socket (read before asyncio closes the socket) go into the server's tally."""
        if not self._counted:
            self._counted = True
            self.connections_state.wire.closed(id(self), self._socket_bytes())
        self.connections_state.forget(self)
        self._cancel(head=True, body=True)

    def _socket_bytes(self) -> tuple[int, int]:
        """(answered, received) bytes at this connection's socket so far (TLS records included)."""
        sock = self._tcp.get_extra_info("socket") if self._tcp is not None else None
        return socket_bytes(sock, initiated=False) or (0, 0)

    def _close(self) -> None:
        """Close the socket (under TLS without waiting for the peer's close_notify; what was written
        is flushed first)."""
        if self._tcp is not None and not self._tcp.is_closing():
            self._tcp.close()

    def _await_head(self, *, fresh: bool) -> None:
        """Start the head timeout (from now) and count this connection as waiting for a head."""
        self._cancel(head=True)
        self.connections_state.wait_for_head(self, self.loop.time(), fresh=fresh)
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def _after_events(self) -> None:
        cycle = self.cycle
        now = self.loop.time()
        if cycle is not None and cycle is not self._seen_cycle:  # a whole request head arrived
            self._seen_cycle = cycle
            self._cancel(head=True)
            self.connections_state.done_waiting(self)
            self._body_since, self._body_bytes = now, 0
        elif self._head_timer is not None:  # bytes came, the head is not whole yet
            self.connections_state.sent_part_of_a_head(self, now)
        if cycle is not None and cycle.more_body and not cycle.response_complete:
            self._cancel(body=True)
            if self._body_too_slow(now):
                return
            self._body_timer = self.loop.call_later(self._limits.body_timeout_s, self._body_timed_out)
        else:
            self._cancel(body=True)
            self._body_since = None

    def _body_too_slow(self, now: float) -> bool:
        """Close the connection when its request body arrives below the minimum rate (not when the
        application holds the reading back)."""
        since = self._body_since
        if since is None or self.flow.read_paused or self.transport.is_closing():
            return False
        if not body_too_slow(self._body_bytes, now - since, self._limits):
            return False
        log.warning(
            "closed a connection whose request body arrived at %.0f bytes/s (at least %.0f)",
            self._body_bytes / max(now - since, 1e-9),
            self._limits.min_body_rate,
        )
        self.connections_state.forget(self)
        self._close()
        return True

    def _cancel(self, *, head: bool = False, body: bool = False) -> None:
        if head and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if body and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self.connections_state.forget(self)
        if not self._made:  # still in its TLS handshake: nothing can be answered
            log.warning(
                "closed a connection that did not finish its TLS handshake within %.1fs",
                self._limits.header_timeout_s,
            )
            self._close()
            return
        if self.transport.is_closing():
            return
        log.warning(
            "closed a connection that did not send a whole request head within %.1fs",
            self._limits.header_timeout_s,
        )
        self.transport.write(_HEAD_TIMEOUT)
        self._close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the application holds the reading back, not the client
            self._body_timer = self.loop.call_later(self._limits.body_timeout_s, self._body_timed_out)
            return
        log.warning(
            "closed a connection whose request body paused for more than %.1fs", self._limits.body_timeout_s
        )
        self.connections_state.forget(self)
        self._close()

    def close_for_room(self) -> None:
        """Closed by the cap to admit a newer connection (this one was waiting for a request head)."""
        self._cancel(head=True)
        log.warning(
            "connection limit (%d) reached: closed the connection waiting longest for a request head",
            self._limits.max_connections,
        )
        self._close()


class _GuardedTLS(sslproto.SSLProtocol):
    """asyncio's TLS layer below a guarded HTTP connection, which it counts in from the accept."""

    def __init__(self, http: GuardedH11Protocol, context: ssl.SSLContext, timeout_s: float) -> None:
        # no waiter (nothing awaits the handshake: the HTTP layer is told when it is done); the
        # timeouts are floats at runtime, whatever the stubs say
        super().__init__(
            http.loop,
            http,
            context,
            None,  # type: ignore[arg-type]
            server_side=True,
            ssl_handshake_timeout=timeout_s,  # type: ignore[arg-type]
            ssl_shutdown_timeout=timeout_s,
        )
        self._http = http

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._http.admit(transport):
            transport.close()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._http.count_out()  # asyncio tells the HTTP layer only if the handshake had finished
        super().connection_lost(exc)


_OVERLOADED = _raw_response(
    503, "Service Unavailable", "overloaded", "too many open connections: retry later", retry_after=1
)
_HEAD_TIMEOUT = _raw_response(408, "Request Timeout", "timeout", "the request head did not arrive in time")


def guarded_protocol(
    limits: ConnectionLimits, tls: ServerCertificate | None = None, wire: WireTally | None = None
) -> Callable[..., asyncio.BaseProtocol]:
    """The protocol factory to give uvicorn (``uvicorn.Config(http=...)``, without uvicorn's own TLS
    settings): one per server, as the connections it counts are that server's. With ``tls``, every
    connection is served over TLS with its current certificate. ``wire``: where the bytes at the
    socket of every connection are counted."""
    state = _Connections(limits, wire if wire is not None else WireTally())
    http = type("ServerH11Protocol", (GuardedH11Protocol,), {"connections_state": state})
    if tls is None:
        return http

    def serve_tls(**kwargs: Any) -> asyncio.BaseProtocol:
        return _GuardedTLS(http(**kwargs), tls.context(), limits.header_timeout_s)

    return serve_tls
