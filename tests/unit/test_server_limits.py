"""The server's connection settings, the connection gate's admission, and how a cut request is recorded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.connections import SHUTDOWN_KEY, ConnectionGuard, ConnectionLimits, Gate, feed
from gateway.lifecycle import note_shutdown
from gateway.server import connection_limits
from gateway.settings import SettingsError, load_settings
from gateway.state import RequestState


def test_defaults_and_environment_overrides() -> None:
    s = load_settings(environ={}).server
    assert (s.header_timeout_s, s.keepalive_timeout_s, s.max_connections, s.shutdown_grace_s) == (10.0, 5.0, 1000, 30.0)
    assert (s.http, s.loop) == ("auto", "auto")
    env = {
        "TIANMEN_SERVER_HEADER_TIMEOUT_S": "2.5",
        "TIANMEN_SERVER_MAX_CONNECTIONS": "7",
        "TIANMEN_SERVER_SHUTDOWN_GRACE_S": "0",
        "TIANMEN_SERVER_HTTP": "h11",
        "TIANMEN_SERVER_LOOP": "asyncio",
    }
    settings = load_settings(environ=env)
    limits = connection_limits(settings)
    assert limits == ConnectionLimits(max_connections=7, header_timeout_s=2.5, shutdown_grace_s=0.0)
    assert (settings.server.http, settings.server.loop) == ("h11", "asyncio")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("HEADER_TIMEOUT_S", "0", "server.header_timeout_s must be > 0"),
        ("KEEPALIVE_TIMEOUT_S", "-1", "server.keepalive_timeout_s must be > 0"),
        ("MAX_CONNECTIONS", "0", "server.max_connections must be >= 1"),
        ("SHUTDOWN_GRACE_S", "-0.5", "server.shutdown_grace_s must be >= 0"),
        ("MAX_CONNECTIONS", "lots", "expected int"),
        ("HTTP", "h2", "server.http must be one of auto, h11, httptools, got 'h2'"),
        ("LOOP", "trio", "server.loop must be one of auto, asyncio, uvloop, got 'trio'"),
    ],
)
def test_bad_values_are_refused_naming_the_setting(key: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(environ={f"TIANMEN_SERVER_{key}": value})


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.aborted = False
        self.protocol: Any = None

    def abort(self) -> None:
        self.aborted = True

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def is_closing(self) -> bool:
        return self.aborted


class FakeHTTP(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport


async def test_gate_admits_up_to_the_limit_then_closes_new_connections_at_once() -> None:
    guard = ConnectionGuard(ConnectionLimits(max_connections=2, header_timeout_s=60))
    gates = [Gate(guard, FakeHTTP, None) for _ in range(3)]
    transports = [FakeTransport() for _ in gates]
    for gate, t in zip(gates, transports, strict=True):
        gate.connection_made(t)
    assert [t.aborted for t in transports] == [False, False, True]
    assert isinstance(transports[0].protocol, FakeHTTP) and transports[0].protocol.transport is transports[0]
    assert transports[2].protocol is None and guard.refused == 1 and len(guard.open) == 2
    gates[0].release()  # a connection ends: room for the next one
    late = FakeTransport()
    Gate(guard, FakeHTTP, None).connection_made(late)
    assert not late.aborted
    guard.shutting_down = True
    after = FakeTransport()
    Gate(guard, FakeHTTP, None).connection_made(after)
    assert after.aborted and guard.refused == 1  # shutdown refusals are not capacity refusals
    for gate in list(guard.open):
        gate.release()


async def test_gate_deadline_aborts_a_connection_that_sends_no_headers() -> None:
    guard = ConnectionGuard(ConnectionLimits(header_timeout_s=0.05))
    gate, t = Gate(guard, FakeHTTP, None), FakeTransport()
    gate.connection_made(t)
    assert gate.armed
    for _ in range(200):
        if t.aborted:
            break
        await asyncio.sleep(0.01)
    assert t.aborted and not gate.armed


class SmallBuffers(asyncio.BufferedProtocol):
    """A buffered protocol (as the TLS ones are) that offers 3 bytes at a time."""

    def __init__(self) -> None:
        self.got = bytearray()
        self.buf = bytearray(3)

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.got += self.buf[:nbytes]


class Chunks(asyncio.Protocol):
    def __init__(self) -> None:
        self.got: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.got.append(data)


def test_feed_hands_bytes_to_buffered_and_plain_protocols_whole_and_in_order() -> None:
    buffered, plain = SmallBuffers(), Chunks()
    for proto in (buffered, plain):
        feed(proto, b"client")
        feed(proto, b"hello!")
    assert bytes(buffered.got) == b"clienthello!" and plain.got == [b"client", b"hello!"]


def test_a_cut_request_is_recorded_as_server_shutdown_a_finished_one_is_not() -> None:
    cut = RequestState("r1", finish_reason="client_disconnected")
    note_shutdown({SHUTDOWN_KEY: True}, cut)
    assert (cut.finish_reason, cut.error) == ("server_shutdown", "server_shutdown")
    finished = RequestState("r2", finish_reason="length")
    note_shutdown({SHUTDOWN_KEY: True}, finished)
    assert (finished.finish_reason, finished.error) == ("length", None)
    gone = RequestState("r3", finish_reason="client_disconnected")
    note_shutdown({}, gone)
    assert (gone.finish_reason, gone.error) == ("client_disconnected", None)
