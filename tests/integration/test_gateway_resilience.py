"""Outages and restarts through the real gateway: Elasticsearch killed under load, gateway restarted with a
backlog, Redis killed under load and back, mTLS with the client subject in the audit trail, and no secrets or
prompts in the logs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from elasticsearch import Elasticsearch

from security.tls import client_ssl_context
from tests.es_server import EsServer
from tests.gateway_server import RunningGateway, run_gateway
from tests.redis_server import RedisServer
from tests.tiny_model import build_tiny_chat_model

SECRET_PROMPT = "my-very-secret-prompt-4711"
CHAT = {"messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 2}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


def send(gw: RunningGateway, n: int, token: str) -> list[str]:
    ids = []
    with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as c:
        for _ in range(n):
            r = c.post(
                "/v1/chat/completions", json={"model": gw.model, **CHAT}, headers={"Authorization": f"Bearer {token}"}
            )
            assert r.status_code == 200, r.text
            ids.append(r.headers["x-request-id"])
    return ids


def counts(es_url: str, ids: list[str], want: int) -> dict[str, int]:
    client = Elasticsearch(es_url)
    found: dict[str, int] = {}
    for _ in range(300):  # shipping retries with backoff after an outage
        try:
            client.indices.refresh(index="tianmen-audit-*")
            hits = client.search(index="tianmen-audit-*", size=10_000, query={"terms": {"event.id": ids}})
            found = {}
            for h in hits["hits"]["hits"]:
                found[h["_source"]["event"]["id"]] = found.get(h["_source"]["event"]["id"], 0) + 1
            if len(found) >= want:
                break
        except Exception:  # the server may still be coming up
            pass
        time.sleep(0.1)
    client.close()
    return found


def test_es_killed_under_load_then_gateway_restarted(model: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    spool = tmp_path / "spool"
    with EsServer(tmp_path / "es") as es:
        env = {
            "TIANMEN_AUDIT_ELASTICSEARCH_URL": es.url,
            "TIANMEN_AUDIT_SPOOL_DIR": str(spool),
            "TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE": "none",
        }
        with run_gateway(home, model, env) as gw:
            token = gw.token(sub="load")
            ids = send(gw, 5, token)
            es.kill()  # SIGKILL: the server also loses its last second of acknowledged writes
            ids += send(gw, 10, token)  # served: the spool is the first hop
        # the gateway is down; events written during the outage wait in the spool
        es.restart()
        with run_gateway(home, model, env) as gw:  # a new process resumes shipping from its spool
            ids += send(gw, 3, gw.token(sub="load"))
            found = counts(es.url, ids, len(ids))
    assert found == {i: 1 for i in ids}


def test_mtls_client_subject_reaches_the_audit_trail(model: Path, tmp_path: Path) -> None:
    from security.devpki import ensure_dev_pki

    home = tmp_path / "home"
    pki = ensure_dev_pki(home)
    with (
        EsServer(tmp_path / "es") as es,
        run_gateway(
            home, model, {"TIANMEN_SERVER_CLIENT_CA": str(pki.ca_cert), "TIANMEN_AUDIT_ELASTICSEARCH_URL": es.url}
        ) as gw,
    ):
        token = gw.token(sub="mtls-user")
        with (
            httpx.Client(base_url=gw.url, verify=client_ssl_context(pki.ca_cert), timeout=30) as c,
            pytest.raises((httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError)),
        ):
            c.get("/health")
        ctx = client_ssl_context(pki.ca_cert, pki.client_cert, pki.client_key)
        with httpx.Client(base_url=gw.url, verify=ctx, timeout=30) as c:
            r = c.post(
                "/v1/chat/completions", json={"model": gw.model, **CHAT}, headers={"Authorization": f"Bearer {token}"}
            )
        assert r.status_code == 200
        client = Elasticsearch(es.url)
        doc = None
        for _ in range(100):
            client.indices.refresh(index="tianmen-audit-*")
            hits = client.search(index="tianmen-audit-*", query={"term": {"event.id": r.headers["x-request-id"]}})
            if hits["hits"]["hits"]:
                doc = hits["hits"]["hits"][0]["_source"]
                break
            time.sleep(0.1)
        client.close()
    assert doc is not None and "tianmen-dev-client" in doc["tls"]["client"]["subject"]


def test_no_token_key_or_prompt_in_logs(model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with run_gateway(tmp_path / "home", model, {"TIANMEN_SERVER_LOG_LEVEL": "debug"}) as gw:
        token = gw.token(sub="quiet")
        send(gw, 2, token)
        with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=30) as c:
            c.post("/v1/chat/completions", json={"model": gw.model, **CHAT}, headers={"Authorization": "Bearer x.y.z"})
            c.post(
                "/v1/chat/completions",
                content=b"{broken " + SECRET_PROMPT.encode(),
                headers={"Authorization": f"Bearer {token}"},
            )
        key = gw.pki.jwt_key.read_text()
    text = caplog.text
    assert caplog.records  # something was logged at debug level
    assert token not in text and token.split(".")[2] not in text and SECRET_PROMPT not in text
    assert key.splitlines()[1] not in text


def test_redis_killed_under_load_503s_then_recovers_at_once(model: Path, tmp_path: Path) -> None:
    env = {"TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE": "100000", "TIANMEN_RATELIMIT_TOKENS_PER_MINUTE": "none"}
    with (
        RedisServer() as redis,
        run_gateway(tmp_path / "home", model, {**env, "TIANMEN_RATELIMIT_REDIS_URL": redis.url}) as gw,
    ):
        token = gw.token(sub="load")
        results: list[tuple[float, float, int, dict | None]] = []  # (sent, answered, status, 503 body)
        stop = threading.Event()

        def client() -> None:
            with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as c:
                while not stop.is_set():
                    sent = time.monotonic()
                    r = c.post(
                        "/v1/chat/completions",
                        json={"model": gw.model, **CHAT},
                        headers={"Authorization": f"Bearer {token}"},
                    )
                    results.append((sent, time.monotonic(), r.status_code, r.json() if r.status_code == 503 else None))

        workers = [threading.Thread(target=client) for _ in range(4)]  # a bounded load: 4 requests at a time
        for w in workers:
            w.start()
        try:
            _wait_for(lambda: sum(r[2] == 200 for r in results) >= 8)
            redis.kill()
            killed = time.monotonic()
            _wait_for(lambda: sum(r[0] > killed and r[2] == 503 for r in results) >= 4)
            redis.start()  # same port, empty
            back = time.monotonic()
            _wait_for(lambda: sum(r[0] > back + 1.0 for r in results) >= 8)
        finally:
            stop.set()
            for w in workers:
                w.join(60)
    assert {r[2] for r in results} <= {200, 503}
    down = [r for r in results if r[0] > killed and r[1] < back]
    assert down and all(r[2] == 503 for r in down), "a request was served while Redis was down"
    for _, _, status, body in results:
        if status == 503:
            assert body is not None and body["error"]["code"] == "ratelimit_unavailable"
            assert "rate limiting is temporarily unavailable" in body["error"]["message"]
    late = [r[2] for r in results if r[0] > back + 1.0]
    assert late and all(s == 200 for s in late), f"503s a second after Redis came back: {late}"


def _wait_for(cond: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the load did not get there in time"
        time.sleep(0.05)
