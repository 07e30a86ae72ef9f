"""uvicorn's Server with our connection gate, and a shutdown that cannot hang.

SIGTERM or SIGINT: stop accepting at once; close every connection that serves no request (handshaking,
reading headers, idle keep-alive); give the requests in flight `shutdown_grace_s`; then cut the rest (their
scopes carry SHUTDOWN_KEY, so their audit events say `server_shutdown`), run the lifespan's shutdown hooks
(the audit spool and shipper flush there) and return, so the process exits 0. A second SIGINT skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import threading
from collections.abc import Callable, Generator
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from gateway.connections import SHUTDOWN_KEY, ConnectionGuard, ConnectionLimits, Gate
from gateway.state import RequestState

YOUNG_GC_THRESHOLD = 5000  # net container allocations between young collections (CPython: 700)

log = logging.getLogger("tianmen.gateway")

CUT_WAIT_S = 5.0  # after the cut: how long the cut requests get to record themselves before they are cancelled
POLL_S = 0.05


class Server(uvicorn.Server):
    """uvicorn's server, calling `on_ready` once the socket listens; connections go through a `Gate`."""

    def __init__(
        self, config: uvicorn.Config, on_ready: Callable[[], None] | None, limits: ConnectionLimits | None = None
    ) -> None:
        super().__init__(config)
        self.on_ready = on_ready
        self.guard = ConnectionGuard(limits or ConnectionLimits())

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        config, loop = self.config, asyncio.get_running_loop()

        def make_http() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop
            )

        def make_gate() -> Gate:
            return Gate(self.guard, make_http, config.ssl)

        try:
            if sockets:
                servers = [await loop.create_server(make_gate, sock=s, backlog=config.backlog) for s in sockets]
            else:
                servers = [await loop.create_server(make_gate, config.host, config.port, backlog=config.backlog)]
        except OSError as e:
            log.error("cannot listen on %s:%s: %s", config.host, config.port, e)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        self.servers = servers
        self._log_started_message([s for server in servers for s in server.sockets])
        # which of uvicorn's parts "auto" chose (server.http, server.loop): they differ several times in CPU
        base = next(c for c in config.http_protocol_class.__mro__ if c.__module__.startswith("uvicorn."))
        log.info("HTTP protocol %s, event loop %s", base.__name__, type(loop).__module__.split(".")[0])
        self.started = True
        # WHY: start-up leaves millions of long-lived objects (torch, the tokenizer, the model's modules) that
        # every full collection would walk again while serving; frozen, they are never scanned. And at the default
        # young threshold (700 net allocations) the objects of 64 requests in flight trigger a collection every
        # dozen requests that finds no garbage (~4% of the event loop's CPU on short requests); requests free
        # what they made by reference counting, so the young generation is collected far less often
        gc.collect()
        gc.freeze()
        gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
        if self.on_ready is not None:
            self.on_ready()

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        guard, tasks = self.guard, self.server_state.tasks
        guard.shutting_down = True
        for server in self.servers:
            server.close()
        idle = [g for g in guard.open if not g.busy]
        for gate in idle:
            gate.abort()
        busy = [g for g in guard.open if g.busy]
        for gate in busy:
            gate.http.shutdown()  # h11: no keep-alive after this response
        grace = guard.limits.shutdown_grace_s
        log.info("shutting down: %d connections closed, %d requests in flight get %.0f s", len(idle), len(tasks), grace)
        await self._wait(lambda: not tasks, grace)
        if tasks:
            cut = 0
            for gate in list(guard.open):
                for scope in gate.scopes:
                    scope[SHUTDOWN_KEY] = True
                    cut += 1
                gate.abort()
            log.warning("shutdown grace of %.0f s is over: cutting %d requests", grace, cut)
            await self._wait(lambda: not tasks, CUT_WAIT_S)
            for task in list(tasks):
                task.cancel(msg="server shutdown")
            await self._wait(lambda: not tasks, CUT_WAIT_S)
        for gate in list(guard.open):  # responses sent during the grace: no TLS goodbye to wait for
            gate.abort()
        if not self.force_exit:
            await self.lifespan.shutdown()
        log.info("shut down")

    async def _wait(self, done: Callable[[], bool], timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done() and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(POLL_S)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the signal once it has shut down, which ends the process with -SIGTERM;
        # a clean, complete shutdown is a success, so it exits 0 here.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def note_shutdown(scope: dict[str, Any], state: RequestState) -> None:
    """For the audit hook: a request the shutdown cut is recorded as such, not as a client disconnect."""
    if scope.get(SHUTDOWN_KEY) and state.finish_reason in (None, "client_disconnected"):
        state.finish_reason = "server_shutdown"
        state.error = "server_shutdown"
