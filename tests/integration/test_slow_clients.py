"""Idle, silent and slow clients against the real gateway over real sockets: others are still served, the
idle and slow are closed after their time, and connections beyond `server.max_connections` are closed at once.
Each test runs with uvicorn's fast parts (httptools, uvloop: what `auto` picks) and with its pure-Python ones
(h11, asyncio's loop)."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from security.tls import client_ssl_context
from tests.gateway_server import RunningGateway, run_gateway
from tests.tiny_model import build_tiny_chat_model
from tests.tls_bio import client_hello

TIMEOUT_S = 1.0
SILENT_TCP, STALLED_TLS, IDLE_TLS = 200, 20, 60
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
PARTS = {"httptools-uvloop": ("httptools", "uvloop"), "h11-asyncio": ("h11", "asyncio")}  # (server.http, .loop)


@pytest.fixture(scope="module", params=list(PARTS))
def parts(request: pytest.FixtureRequest) -> dict[str, str]:
    http, loop = PARTS[request.param]
    return {"TIANMEN_SERVER_HTTP": http, "TIANMEN_SERVER_LOOP": loop}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, model: Path, parts: dict[str, str]) -> Iterator[RunningGateway]:
    env = {"TIANMEN_SERVER_HEADER_TIMEOUT_S": str(TIMEOUT_S), "TIANMEN_SERVER_KEEPALIVE_TIMEOUT_S": str(TIMEOUT_S)}
    env.update(parts)
    with run_gateway(tmp_path_factory.mktemp("home"), model, env) as g:
        yield g


def ctx_of(gw: RunningGateway) -> ssl.SSLContext:
    return client_ssl_context(gw.pki.ca_cert)


async def tcp(gw: RunningGateway) -> Stream:
    return await asyncio.open_connection("127.0.0.1", gw.port)


async def stalled_handshake(gw: RunningGateway) -> Stream:
    """A TLS handshake begun and left: half a ClientHello, then silence."""
    hello = client_hello(ctx_of(gw))
    conn = await tcp(gw)
    conn[1].write(hello[: len(hello) // 2])
    await conn[1].drain()
    return conn


async def tls(gw: RunningGateway) -> Stream:
    return await asyncio.open_connection("127.0.0.1", gw.port, ssl=ctx_of(gw), server_hostname="localhost")


async def closed_by_server(conn: Stream, within_s: float = 30.0) -> bool:
    """True once the server has closed the connection (EOF or reset); False if it is still open after `within_s`."""
    try:
        return await asyncio.wait_for(conn[0].read(), within_s) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def still_open(conn: Stream) -> bool:
    return not conn[0].at_eof() and not conn[1].is_closing()


async def slowloris(gw: RunningGateway, every_s: float) -> tuple[int, int, float]:
    """Send request headers one byte at a time over TLS; (bytes sent, header length, seconds until cut)."""
    head = f"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {gw.token()}\r\n\r\n".encode()
    started, sent = time.monotonic(), 0  # before the connect: the server's deadline runs from its accept
    reader, writer = await tls(gw)
    try:
        for i in range(len(head)):
            if reader.at_eof() or writer.is_closing():
                break
            writer.write(head[i : i + 1])
            await writer.drain()
            sent += 1
            try:
                if await asyncio.wait_for(reader.read(1), every_s) == b"":
                    break
            except TimeoutError:
                pass
    except (ConnectionError, ssl.SSLError):
        pass
    cut_after = time.monotonic() - started
    writer.close()
    return sent, len(head), cut_after


async def test_silent_idle_and_slow_clients_do_not_stop_others_and_are_closed_in_time(gw: RunningGateway) -> None:
    loris = asyncio.create_task(slowloris(gw, every_s=0.2))
    silent = [await tcp(gw) for _ in range(SILENT_TCP)]
    stalled = [await stalled_handshake(gw) for _ in range(STALLED_TLS)]
    idle = [await tls(gw) for _ in range(IDLE_TLS)]
    try:
        open_now = sum(still_open(c) for c in silent + stalled + idle)
        async with httpx.AsyncClient(base_url=gw.url, verify=ctx_of(gw), timeout=60) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={"model": gw.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                headers={"Authorization": f"Bearer {gw.token()}"},
            )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        assert open_now > 0  # the request was served while idle connections were open
        closed = await asyncio.gather(*(closed_by_server(c) for c in silent + stalled + idle))
        assert all(closed), f"{closed.count(False)} idle connections still open"
        sent, length, cut_after = await loris
        assert sent < length, "the byte-a-time headers were cut before they were complete"
        assert cut_after >= TIMEOUT_S * 0.9  # cut at the header deadline, measured from the connect
    finally:  # a failed assertion must not leave its sockets to a later test's garbage collection
        for _, w in silent + stalled + idle:
            w.close()


async def test_keepalive_connection_idles_out_but_serves_while_in_use(gw: RunningGateway) -> None:
    reader, writer = await tls(gw)
    request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {gw.token()}\r\n\r\n".encode()
    for i in range(3):  # requests spaced well inside the keep-alive and header timeouts reuse the connection
        if i:
            await asyncio.sleep(TIMEOUT_S / 4)
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
        await reader.readexactly(length)
    idle_from = time.monotonic()
    assert await closed_by_server((reader, writer))
    assert time.monotonic() - idle_from >= TIMEOUT_S * 0.9
    writer.close()


async def test_beyond_max_connections_new_ones_are_closed_at_once_existing_keep_working(
    tmp_path: Path, model: Path, parts: dict[str, str]
) -> None:
    limit = 20
    env = {
        "TIANMEN_SERVER_MAX_CONNECTIONS": str(limit),
        "TIANMEN_SERVER_HEADER_TIMEOUT_S": "120",  # the silent connections stay for the whole test
        "TIANMEN_SERVER_KEEPALIVE_TIMEOUT_S": "120",
        **parts,
    }
    with run_gateway(tmp_path / "home", model, env) as g:
        auth = {"Authorization": f"Bearer {g.token()}"}
        async with httpx.AsyncClient(base_url=g.url, verify=ctx_of(g), headers=auth, timeout=60) as kept:
            assert (await kept.get("/v1/models")).status_code == 200  # one connection, kept alive
            silent = [await tcp(g) for _ in range(limit - 1)]
            extra = await tcp(g)  # accepted by the kernel, closed by the gateway before any TLS
            assert await closed_by_server(extra, within_s=30)
            async with httpx.AsyncClient(base_url=g.url, verify=ctx_of(g), headers=auth, timeout=60) as fresh:
                with pytest.raises(httpx.TransportError):
                    await fresh.get("/v1/models")
            assert (await kept.get("/v1/models")).status_code == 200  # the existing connection is untouched
            assert not any([c[0].at_eof() for c in silent])
            for _, w in silent[:5]:  # room again: new connections are served
                w.close()
            status = None
            for _ in range(100):
                try:
                    async with httpx.AsyncClient(base_url=g.url, verify=ctx_of(g), headers=auth, timeout=60) as c:
                        status = (await c.get("/v1/models")).status_code
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)  # the server has not yet seen the closes
            assert status == 200
            extra[1].close()
            for _, w in silent[5:]:
                w.close()
