"""The connection gate with each of uvicorn's HTTP protocols (h11, httptools) on each event loop (asyncio,
uvloop), over real sockets: a small app, no model, so every combination is cheap.

uvloop starts reading a connection right after the gate's connection_made, whatever the gate asked, so a
ClientHello that is already waiting reaches the gate before start_tls takes over; these clients send theirs
before the server even accepts, which makes that case happen every time."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.connections import ConnectionLimits, guarded_protocol_class
from gateway.lifecycle import Server
from security.devpki import DevPKI, ensure_dev_pki
from security.tls import TLSConfig, client_ssl_context, uvicorn_ssl_kwargs
from tests.tls_bio import BioClient

COMBINATIONS = [("h11", "asyncio"), ("h11", "uvloop"), ("httptools", "asyncio"), ("httptools", "uvloop")]
CLIENTS = 8
REQUEST = b"GET /where HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


async def where(request: Request) -> JSONResponse:
    """What served this request: the event loop's module, and the connection's TLS scope."""
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return JSONResponse({"loop": loop, "tls": request.scope.get("extensions", {}).get("tls")})


app = Starlette(routes=[Route("/where", where)])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPKI:
    return ensure_dev_pki(tmp_path_factory.mktemp("tianmen"))


@contextmanager
def gate_server(pki: DevPKI, http: str, loop: str, sock: socket.socket) -> Iterator[Server]:
    config = uvicorn.Config(
        app,
        http=guarded_protocol_class(http),  # type: ignore[arg-type]
        loop=loop,
        ws="none",
        lifespan="off",
        log_config=None,
        log_level="critical",
        **uvicorn_ssl_kwargs(TLSConfig(pki.server_cert, pki.server_key)),
    )
    server = Server(config, None, ConnectionLimits(header_timeout_s=60))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server failed to start"
            time.sleep(0.01)
        yield server
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize(("http", "loop"), COMBINATIONS, ids=[f"{h}-{lp}" for h, lp in COMBINATIONS])
def test_client_hello_waiting_before_accept_is_handed_to_tls(pki: DevPKI, http: str, loop: str) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(CLIENTS)
    ctx = client_ssl_context(pki.ca_cert)
    clients = []
    for _ in range(CLIENTS):  # connected (the kernel's backlog) and the ClientHello sent, before the server runs
        sock = socket.create_connection(listener.getsockname(), timeout=20)
        client = BioClient(ctx)
        sock.sendall(client.pending())
        clients.append((sock, client))
    with gate_server(pki, http, loop, listener) as server:
        for sock, client in clients:
            with sock:
                client.finish_handshake(sock)  # a lost ClientHello: the server never answers, recv times out
                response = client.request(sock, REQUEST)
            head, _, body = response.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            seen = json.loads(body)
            assert seen["loop"] == loop and seen["tls"]["version"] == "TLSv1.3"
        for _ in range(500):  # every gate lets go of its closed connection (the server sees the closes soon)
            if not server.guard.open:
                break
            time.sleep(0.01)
        assert not server.guard.open
    listener.close()
