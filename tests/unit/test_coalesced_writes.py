"""gateway.coalesced.Coalesced: the writes of one event-loop pass leave as one write, in order, and none is lost."""

from __future__ import annotations

import asyncio

from gateway.coalesced import Coalesced


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "a write after close"
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


async def test_one_pass_of_writes_is_one_write() -> None:
    raw = FakeTransport()
    t = Coalesced(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t.write(b"")
    t.write(b'{"ok":true}')
    assert raw.writes == []  # nothing before the pass ends
    await asyncio.sleep(0)
    assert raw.writes == [b'HTTP/1.1 200 OK\r\n\r\n{"ok":true}']
    t.write(b"data: 1\n\n")  # a later pass: its own write
    await asyncio.sleep(0)
    assert raw.writes[1:] == [b"data: 1\n\n"]
    assert t.get_extra_info("peername") == "info:peername"  # everything else is the transport's


async def test_close_sends_what_was_written_first_and_abort_drops_it() -> None:
    raw = FakeTransport()
    t = Coalesced(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"last words")
    t.close()
    assert raw.writes == [b"last words"] and raw.closed
    await asyncio.sleep(0)  # the scheduled flush finds nothing left: no write after close
    assert raw.writes == [b"last words"]

    raw = FakeTransport()
    t = Coalesced(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"never sent")
    t.abort()
    await asyncio.sleep(0)
    assert raw.writes == [] and raw.aborted


async def test_a_peer_gone_before_the_flush_gets_nothing_written() -> None:
    raw = FakeTransport()
    t = Coalesced(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"too late")
    raw.closed = True  # connection_lost in the same pass
    await asyncio.sleep(0)
    assert raw.writes == []
    assert t.is_closing()
