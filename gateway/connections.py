"""Connection admission: a bound on open connections and a deadline for each request's TLS handshake and headers.

Every accepted TCP connection first meets a `Gate`: beyond `max_connections` (or once shutdown began) it is
closed at once, before any TLS work; otherwise the gate runs the TLS handshake itself (`loop.start_tls`) and
hands the connection to the HTTP protocol. One timer per connection, on the raw socket, bounds the time from
accept (or from the first byte of a keep-alive connection's next request) to complete request headers, so a
client that sends nothing, stalls its handshake, or trickles its headers a byte at a time is cut at that time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.coalesced import Coalesced
from gateway.tls_protocol import http_protocol_class

log = logging.getLogger("tianmen.gateway")

SHUTDOWN_KEY = "tianmen.server_shutdown"  # set in the ASGI scope of a request the shutdown cut
REFUSAL_LOG_INTERVAL_S = 60.0


@dataclass(slots=True)
class ConnectionLimits:
    """The server section's connection bounds (see gateway.settings.ServerSettings)."""

    max_connections: int = 1000
    header_timeout_s: float = 10.0
    shutdown_grace_s: float = 30.0


@dataclass
class ConnectionGuard:
    """Shared by every gate of one server: the open connections, and whether new ones are still welcome."""

    limits: ConnectionLimits
    open: set[Gate] = field(default_factory=set)
    shutting_down: bool = False
    refused: int = 0
    _refusals_logged_at: float = 0.0

    def refuse(self) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= REFUSAL_LOG_INTERVAL_S:
            self._refusals_logged_at = now
            log.warning(
                "closing new connections: %d open is the limit (server.max_connections); %d refused so far",
                self.limits.max_connections,
                self.refused,
            )


class _Held(asyncio.Protocol):
    """Stands in for the HTTP protocol between the end of the handshake and the hand-off, keeping what arrives."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.eof = False
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return True  # the HTTP protocol decides once it has the connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


def feed(protocol: Any, data: bytes) -> None:
    """Hand `data` to a protocol as its transport would: the TLS protocols (asyncio's since 3.11, uvloop's) are
    buffered protocols, which take bytes through get_buffer / buffer_updated rather than data_received."""
    if not hasattr(protocol, "get_buffer"):
        protocol.data_received(data)
        return
    view = memoryview(data)
    while view:
        buf = protocol.get_buffer(len(view))
        n = min(len(buf), len(view))
        if not n:
            raise RuntimeError("get_buffer() returned an empty buffer")
        buf[:n] = view[:n]
        protocol.buffer_updated(n)
        view = view[n:]


class Gate(asyncio.Protocol):
    """The first protocol of every accepted TCP connection: admit or close it, then time it (see the module doc)."""

    def __init__(self, guard: ConnectionGuard, make_http: Callable[[], Any], sslcontext: ssl.SSLContext | None) -> None:
        self.guard, self.make_http, self.sslcontext = guard, make_http, sslcontext
        self.loop = asyncio.get_running_loop()
        self.raw: asyncio.Transport | None = None
        self.http: Any = None
        self.scopes: list[Scope] = []  # the requests this connection's app is running
        self._timer: asyncio.TimerHandle | None = None
        self._upgrade: asyncio.Task[None] | None = None
        self._early: list[bytes] = []  # bytes that reached the gate before the TLS protocol (uvloop)

    # ---- the raw connection, until the hand-off --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # no isinstance check: uvloop's transports are not asyncio.Transport subclasses (an assert here used to
        # fail every connection under uvloop, leaving it unread and its client's handshake stalled)
        raw: asyncio.Transport = transport  # type: ignore[assignment]
        self.raw = raw
        if self.guard.shutting_down or len(self.guard.open) >= self.guard.limits.max_connections:
            if not self.guard.shutting_down:
                self.guard.refuse()
            raw.abort()
            return
        self.guard.open.add(self)
        self.arm()
        self.http = self.make_http()
        self.http.gate = self
        if self.sslcontext is None:
            raw.set_protocol(self.http)
            self.http.connection_made(raw)
            return
        # asyncio starts reading only after this returns and honours the pause; uvloop starts reading right after
        # connection_made whatever it asked, so the first bytes may still reach data_received below
        raw.pause_reading()
        self._upgrade = self.loop.create_task(self._start_tls(raw, self.sslcontext))
        # The task's first step runs start_tls up to the handshake: it swaps in the TLS protocol and schedules that
        # protocol's connection_made and the transport's resume_reading. Two hops put the replay of early bytes
        # right after both, in the same loop iteration, so before the transport reads anything newer.
        self.loop.call_soon(self.loop.call_soon, self._replay_early)

    def data_received(self, data: bytes) -> None:
        # uvloop only (see connection_made): the client's first bytes, its ClientHello, arrived before start_tls
        # took the connection over. Dropping them stalled the handshake until the deadline; keep them for the TLS
        # protocol, and pause, so that at most one read waits here.
        self._early.append(data)
        if self.raw is not None:
            self.raw.pause_reading()

    def _replay_early(self) -> None:
        if not self._early or self.raw is None or self.raw.is_closing():
            return
        tls_protocol = self.raw.get_protocol()
        if tls_protocol is self:  # start_tls has not swapped protocols yet: try again next iteration
            self.loop.call_soon(self._replay_early)
            return
        early, self._early = self._early, []
        for chunk in early:
            feed(tls_protocol, chunk)

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()

    async def _start_tls(self, raw: asyncio.Transport, ctx: ssl.SSLContext) -> None:
        held = _Held()
        timeout = self.guard.limits.header_timeout_s
        try:
            tls = await self.loop.start_tls(
                raw, held, ctx, server_side=True, ssl_handshake_timeout=timeout, ssl_shutdown_timeout=timeout
            )
        except (Exception, asyncio.CancelledError) as e:  # a failed or stalled handshake, or the deadline
            log.debug("TLS handshake not completed: %s", type(e).__name__)
            raw.abort()
            self.release()
            return
        if held.lost or tls is None or tls.is_closing():
            self.release()
            return
        tls.set_protocol(self.http)
        self.http.connection_made(tls)
        for chunk in held.data:
            self.http.data_received(chunk)
        if held.eof:
            self.http.eof_received()

    # ---- timing and closing ------------------------------------------------------------------------------
    def arm(self, delay: float | None = None) -> None:
        self.disarm()
        self._timer = self.loop.call_later(self.guard.limits.header_timeout_s if delay is None else delay, self.expire)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def expire(self) -> None:
        self._timer = None
        log.debug("closing a connection that sent no complete request headers in time")
        self.abort()

    def abort(self) -> None:
        """Close now, without a TLS goodbye: nothing waits on a peer that may never answer."""
        if self._upgrade is not None and not self._upgrade.done():
            self._upgrade.cancel()
        if self.raw is not None:
            self.raw.abort()

    def release(self) -> None:
        self.disarm()
        self.guard.open.discard(self)

    @property
    def busy(self) -> bool:
        """Serving a request: its app runs, or its headers are in and its response is not yet complete."""
        cycle = getattr(self.http, "cycle", None)
        return bool(self.scopes) or (cycle is not None and not cycle.response_complete)


class _Tracked:
    """The app as one connection calls it: complete headers stop the deadline, and the gate knows the scope.

    An error raised after the app's response is complete (Starlette re-raises every unhandled one after its 500
    is sent, already logged by gateway.errors) stops here: uvicorn would close the connection for it, and the
    client's next request on that keep-alive connection would fail with no answer at all."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        protocol = self.gate.http
        protocol.awaiting_headers = False
        self.gate.disarm()
        self.gate.scopes.append(scope)
        complete = False

        async def sent(message: Any) -> None:
            nonlocal complete
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True

        try:
            await self.app(scope, receive, sent)
        except Exception as e:
            if not complete:
                raise
            log.error("an error after the response to %s was complete: %s", scope.get("request_id"), type(e).__name__)
        finally:
            self.gate.scopes.remove(scope)


def _guarded(base: type[Any]) -> type[asyncio.Protocol]:
    # uvicorn's h11 or httptools protocol, told by its gate when a request's headers are complete and when the
    # connection ends; both name the hooks alike (cycle, on_response_complete, data_received, shutdown).
    # Without a gate (a plain uvicorn.Server, as in tests of the TLS scope) it behaves as `base`.
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self.gate = None
        self.awaiting_headers = True

    def connection_made(self: Any, transport: asyncio.Transport) -> None:
        base.connection_made(self, transport)
        if self.gate is not None:
            self.app = _Tracked(self.app, self.gate)
            self.transport = Coalesced(transport, self.loop)  # what each request's cycle writes to

    def data_received(self: Any, data: bytes) -> None:
        # the next request on a keep-alive connection: its first byte starts its header deadline
        if self.gate is not None and self.awaiting_headers and not self.gate.armed:
            self.gate.arm()
        base.data_received(self, data)

    def on_response_complete(self: Any) -> None:
        self.awaiting_headers = True  # idle now: uvicorn's keep-alive timer runs until the next byte
        base.on_response_complete(self)

    def connection_lost(self: Any, exc: Exception | None) -> None:
        base.connection_lost(self, exc)
        if self.gate is not None:
            self.gate.release()

    name = f"Guarded{base.__name__}"
    attrs = {
        "__init__": __init__,
        "connection_made": connection_made,
        "data_received": data_received,
        "on_response_complete": on_response_complete,
        "connection_lost": connection_lost,
        "__module__": __name__,
        "__qualname__": name,
    }
    return type(name, (base,), attrs)


@functools.cache
def guarded_protocol_class(http: Literal["auto", "h11", "httptools"] = "auto") -> type[asyncio.Protocol]:
    """The HTTP protocol the gate hands connections to (server.http): the TLS-scope protocol, plus the gate's
    hooks."""
    return _guarded(http_protocol_class(http))
