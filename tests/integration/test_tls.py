from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from cryptography import x509
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.tls_protocol import http_protocol_class
from security.devpki import DevPKI, ensure_dev_pki
from security.tls import TLSConfig, client_ssl_context, uvicorn_ssl_kwargs

OPENSSL = "/usr/bin/openssl"


async def echo_tls(request: Request) -> JSONResponse:
    return JSONResponse(request.scope.get("extensions", {}).get("tls"))


app = Starlette(routes=[Route("/tls", echo_tls)])


@contextmanager
def serving(tls: TLSConfig) -> Iterator[int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        http=http_protocol_class(),
        ws="none",
        lifespan="off",
        log_config=None,
        log_level="critical",
        **uvicorn_ssl_kwargs(tls),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn failed to start"
            time.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPKI:
    return ensure_dev_pki(tmp_path_factory.mktemp("tianmen"))


@pytest.fixture(scope="module")
def tls_port(pki: DevPKI) -> Iterator[int]:
    with serving(TLSConfig(pki.server_cert, pki.server_key)) as port:
        yield port


@pytest.fixture(scope="module")
def mtls_port(pki: DevPKI) -> Iterator[int]:
    with serving(TLSConfig(pki.server_cert, pki.server_key, client_ca=pki.ca_cert)) as port:
        yield port


def handshake(pki: DevPKI, port: int, ctx: ssl.SSLContext) -> str | None:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as s,
    ):
        return s.version()


def s_client(pki: DevPKI, port: int, version_flag: str) -> subprocess.CompletedProcess[str]:
    cmd = [OPENSSL, "s_client", version_flag, "-connect", f"127.0.0.1:{port}", "-CAfile", str(pki.ca_cert)]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20)


def test_tls13_client_accepted_and_every_request_sees_tls_scope(pki: DevPKI, tls_port: int) -> None:
    with httpx.Client(verify=client_ssl_context(pki.ca_cert)) as client:
        for host in ("127.0.0.1", "localhost", "127.0.0.1"):
            r = client.get(f"https://{host}:{tls_port}/tls")
            assert r.status_code == 200
            tls = r.json()
            assert tls["version"] == "TLSv1.3" and tls["client_subject"] is None
            assert tls["cipher"].startswith("TLS_")


def test_python_client_capped_at_tls12_is_refused(pki: DevPKI, tls_port: int) -> None:
    capped = ssl.create_default_context(cafile=str(pki.ca_cert))
    capped.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        handshake(pki, tls_port, capped)
    assert handshake(pki, tls_port, ssl.create_default_context(cafile=str(pki.ca_cert))) == "TLSv1.3"


def test_openssl_s_client_tls12_is_refused(pki: DevPKI, tls_port: int) -> None:
    refused = s_client(pki, tls_port, "-tls1_2")
    # the server just closes: no alert, no certificate, no cipher
    assert refused.returncode != 0
    assert "Cipher is (NONE)" in refused.stdout and "no peer certificate available" in refused.stdout
    ok = s_client(pki, tls_port, "-tls1_3")
    assert ok.returncode == 0, ok.stderr
    assert "New, TLSv1.3, Cipher is TLS_" in ok.stdout and "Verify return code: 0 (ok)" in ok.stdout


def test_mtls_dev_client_cert_accepted_and_subject_reaches_app(pki: DevPKI, mtls_port: int) -> None:
    ctx = client_ssl_context(pki.ca_cert, pki.client_cert, pki.client_key)
    with httpx.Client(verify=ctx) as client:
        tls = client.get(f"https://localhost:{mtls_port}/tls").json()
    subject = x509.load_pem_x509_certificate(pki.client_cert.read_bytes()).subject.rfc4514_string()
    assert tls["client_subject"] == subject == "CN=tianmen-dev-client,O=Tianmen Dev"
    assert tls["version"] == "TLSv1.3"


# NOTE: in TLS 1.3 the server checks the client certificate after the client has finished its
# side of the handshake, so a refusal surfaces as a read error on the first request, not on connect.
def test_mtls_without_client_cert_refused(pki: DevPKI, mtls_port: int) -> None:
    with (
        httpx.Client(verify=client_ssl_context(pki.ca_cert)) as client,
        pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)),
    ):
        client.get(f"https://localhost:{mtls_port}/tls")


def test_mtls_client_cert_from_another_ca_refused(pki: DevPKI, mtls_port: int, tmp_path: Path) -> None:
    stranger = ensure_dev_pki(tmp_path)
    assert stranger.ca_cert.read_bytes() != pki.ca_cert.read_bytes()
    ctx = client_ssl_context(pki.ca_cert, stranger.client_cert, stranger.client_key)
    with httpx.Client(verify=ctx) as client, pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        client.get(f"https://localhost:{mtls_port}/tls")


def test_tls_config_rejects_missing_files(pki: DevPKI, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="client_ca"):
        TLSConfig(pki.server_cert, pki.server_key, client_ca=tmp_path / "nope.pem")
    kwargs = uvicorn_ssl_kwargs(TLSConfig(pki.server_cert, pki.server_key))
    assert "ssl_cert_reqs" not in kwargs and kwargs["ssl_certfile"] == str(pki.server_cert)
