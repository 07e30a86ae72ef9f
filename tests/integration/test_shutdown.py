"""SIGTERM on a real `tianmen serve` process: refuse new connections, drop idle ones, cut what outlives the grace.

The process must exit 0, and every request it was serving must leave its audit event in the spool,
the cut ones saying `server_shutdown`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from security.devpki import DevPKI, ensure_dev_pki, mint_token
from security.tls import client_ssl_context
from tests.gateway_server import free_port, run_gateway
from tests.tiny_model import build_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 3.0
LONG = 16384  # tokens: a stream this long, read slowly, is still running when the grace ends


def long_model(path: Path) -> Path:
    """The tiny chat model with room for very long completions (RoPE has no real position limit)."""
    model = build_tiny_chat_model(path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": LONG}))
    return model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_model(tmp_path_factory.mktemp("m") / "tiny-long")


def server_env(home: Path, model: Path, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TIANMEN_HOME": str(home),
        "TIANMEN_SERVER_PORT": str(port),
        "TIANMEN_SERVER_SHUTDOWN_GRACE_S": str(GRACE_S),
        "TIANMEN_ENGINE_MODEL": str(model),
        "TIANMEN_ENGINE_DTYPE": "float32",
        "TIANMEN_ENGINE_MAX_MODEL_LEN": str(LONG),
        "TIANMEN_AUDIT_SPOOL_DIR": str(home / "spool"),
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture
def served(tmp_path: Path, model: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    home, port = tmp_path / "home", free_port()
    env = server_env(home, model, port)
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        ctx = None
        for _ in range(1200):  # the first start builds the dev PKI and loads the model
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            if (home / "pki").exists() and ctx is None:
                ctx = client_ssl_context(ensure_dev_pki(home).ca_cert)
            if ctx is not None:
                try:
                    if httpx.get(f"https://127.0.0.1:{port}/health", verify=ctx, timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        else:
            pytest.fail("the gateway did not report healthy: " + (tmp_path / "server.log").read_text()[-2000:])
        yield proc, port, home
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


async def open_tls(port: int, ctx: ssl.SSLContext) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 20) == b""
    except (ConnectionError, ssl.SSLError):
        return True


async def stream_until_end(
    client: httpx.AsyncClient, body: dict, agent: str, started: asyncio.Event, drain: asyncio.Event
) -> str:
    """Read the stream slowly to its end, at full speed once `drain` is set; what it ended with: "done" ([DONE]
    seen) or "cut". WHY drain: a fast CPU's server has written hundreds of KB of a stream into the socket buffers
    before the cut, which lines 10 ms apart took longer to read than the test waits."""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers={"User-Agent": agent}) as r:
            assert r.status_code == 200
            started.set()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
                if not drain.is_set():
                    await asyncio.sleep(0.01)
    except (httpx.ReadError, httpx.RemoteProtocolError):
        pass
    return "cut"


def spool_events(home: Path) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TIANMEN_HOME": str(home),
        "TIANMEN_AUDIT_SPOOL_DIR": str(home / "spool"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "audit", "search", "--spool", "--json", "--limit", "1000"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


async def test_sigterm_refuses_new_drops_idle_cuts_the_rest_and_exits_0(
    served: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    proc, port, home = served
    pki: DevPKI = ensure_dev_pki(home)
    ctx = client_ssl_context(pki.ca_cert)
    token = mint_token(pki.jwt_key, pki.kid, sub="sre", tenant="acme")
    auth = {"Authorization": f"Bearer {token}"}
    url = f"https://127.0.0.1:{port}"
    chat = {"model": "tiny-long", "messages": [{"role": "user", "content": "Tell me everything."}]}
    async with httpx.AsyncClient(base_url=url, verify=ctx, headers=auth, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        chat["model"] = model
        done = await client.post("/v1/chat/completions", json=chat | {"max_tokens": 4}, headers={"User-Agent": "ok"})
        assert done.status_code == 200
        # keep-alive connections left idle after a request
        idle = [httpx.AsyncClient(base_url=url, verify=ctx, headers=auth, timeout=60) for _ in range(3)]
        for i, c in enumerate(idle):
            assert (await c.get("/v1/models", headers={"User-Agent": f"idle-{i}"})).status_code == 200
        # long streams, read slowly
        long = chat | {"stream": True, "max_tokens": LONG - 64, "ignore_eos": True}
        starts, drain = [asyncio.Event() for _ in range(3)], asyncio.Event()
        streams = [
            asyncio.create_task(stream_until_end(client, long, f"stream-{i}", starts[i], drain)) for i in range(3)
        ]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 120)
        # a request whose body never completes, one whose headers never complete, a TCP connection that sends nothing
        half_body = await open_tls(port, ctx)
        half_body[1].write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nUser-Agent: half-body\r\n"
            + f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n".encode()
            + b'Content-Length: 500\r\n\r\n{"model": '
        )
        half_headers = await open_tls(port, ctx)
        half_headers[1].write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nUser-Ag")
        silent = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(half_body[1].drain(), half_headers[1].drain())
        await asyncio.sleep(0.5)  # the half-sent body reaches the app

        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # at once: the listener is gone, and connections serving no request are closed, while the process lives on
        for _ in range(200):
            if refused(port):
                break
            await asyncio.sleep(0.02)
        assert refused(port) and proc.poll() is None
        for reader in (half_headers[0], silent[0]):
            assert await closed_by_server(reader)
        for c in idle:
            with pytest.raises(httpx.TransportError):
                await c.get("/v1/models")
        assert proc.poll() is None, "the grace period is not over: the streams and the half-sent body keep it"
        rc = await asyncio.to_thread(proc.wait, GRACE_S + 30)
        elapsed = time.monotonic() - sent
        drain.set()  # the server is gone: what it sent before the cut is read at full speed, to the cut
        ends = await asyncio.wait_for(asyncio.gather(*streams), 60)
        assert await closed_by_server(half_body[0])
        for c in idle:
            await c.aclose()
        for _, w in (half_body, half_headers, silent):
            w.close()
    assert rc == 0
    assert elapsed >= GRACE_S, "the in-flight requests got their grace period"
    assert "cut" in ends

    by_agent: dict[str, list[dict]] = {}
    for ev in spool_events(home):
        by_agent.setdefault((ev.get("user_agent") or {}).get("original") or "", []).append(ev)
    agents = ["ok", "idle-0", "idle-1", "idle-2", "stream-0", "stream-1", "stream-2", "half-body"]
    assert {a: len(by_agent.get(a, [])) for a in agents} == {a: 1 for a in agents}
    assert by_agent["ok"][0]["tianmen"]["finish_reason"] in ("length", "stop")
    for i, end in enumerate(ends):
        ev = by_agent[f"stream-{i}"][0]
        if end == "cut":
            assert ev["tianmen"]["finish_reason"] == "server_shutdown"
            assert ev["error"]["type"] == "server_shutdown"
    assert by_agent["half-body"][0]["error"]["type"] == "server_shutdown"
    assert "half-headers" not in by_agent  # never a request: its headers were not complete


def test_cut_streams_release_their_engine_blocks(tmp_path: Path, model: Path) -> None:
    env = {
        "TIANMEN_SERVER_SHUTDOWN_GRACE_S": "0.5",
        "TIANMEN_ENGINE_MAX_MODEL_LEN": str(LONG),
    }
    with run_gateway(tmp_path / "home", model, env) as gw:
        ctx = client_ssl_context(gw.pki.ca_cert)
        body = {
            "model": gw.model,
            "messages": [{"role": "user", "content": "Go on."}],
            "stream": True,
            "max_tokens": LONG - 64,
            "ignore_eos": True,
        }
        client = httpx.Client(base_url=gw.url, verify=ctx, headers={"Authorization": f"Bearer {gw.token()}"})
        response = client.send(client.build_request("POST", "/v1/chat/completions", json=body), stream=True)
        lines = response.iter_lines()
        next(lines)
        assert gw.engine.stats()["num_running"] == 1  # type: ignore[attr-defined]
    # run_gateway's exit is the server's shutdown: the grace is over long before the stream
    stats = gw.engine.stats()  # type: ignore[attr-defined]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_blocks_used"] == 0
    response.close()
    client.close()
