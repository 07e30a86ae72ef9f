"""A connection's writes of one event-loop pass sent as one: one TLS record and one send(2) where there were two."""

from __future__ import annotations

import asyncio
from typing import Any


class Coalesced:
    """A connection's transport whose writes within one pass of the event loop go out as one write.

    WHY: uvicorn writes a response's status line and headers, then its body, each at once; over TLS each write
    is its own record and its own send(2). Held until the end of the pass, the two (and any stream chunks ready
    with them) become one record and one system call, and nothing waits longer than the pass."""

    __slots__ = ("_loop", "_pending", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport, self._loop = transport, loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending = []
        if not self.transport.is_closing():  # the peer left meanwhile: nobody to send it to
            self.transport.write(data)

    def close(self) -> None:
        self.flush()  # what was written before close goes out first, as with the transport itself
        self.transport.close()

    def abort(self) -> None:
        self._pending = []
        self.transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, set_protocol, ...: the transport's
        return getattr(self.transport, name)
