"""Every request through the real gateway leaves exactly one audit event, shipped to a real ES-API server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from elasticsearch import Elasticsearch

from gateway.cli import main as cli
from security.tls import client_ssl_context
from tests.es_server import EsServer
from tests.gateway_server import RunningGateway, run_gateway
from tests.tiny_model import build_tiny_chat_model

CHAT = {"messages": [{"role": "user", "content": "secret plan: what is the capital of France?"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def es(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EsServer]:
    with EsServer(tmp_path_factory.mktemp("es")) as server:
        yield server


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, es: EsServer) -> Iterator[RunningGateway]:
    model = build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")
    env = {
        "TIANMEN_AUDIT_ELASTICSEARCH_URL": es.url,
        "TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE": "1000",
        "TIANMEN_AUDIT_CHECKPOINT_EVERY": "5",
    }
    with run_gateway(tmp_path_factory.mktemp("home"), model, env) as g:
        yield g


def events(es: EsServer, request_ids: list[str]) -> dict[str, list[dict]]:
    client = Elasticsearch(es.url)
    found: dict[str, list[dict]] = {}
    for _ in range(100):  # the shipper bulk-indexes asynchronously
        client.indices.refresh(index="tianmen-audit-*")
        query = {
            "bool": {
                "filter": [{"terms": {"event.id": request_ids}}],
                "must_not": [{"term": {"tianmen.phase": "open"}}],
            }
        }
        hits = client.search(index="tianmen-audit-*", size=1000, query=query)  # Kibana's one-event-per-request view
        found = {}
        for h in hits["hits"]["hits"]:
            found.setdefault(h["_source"]["event"]["id"], []).append(h["_source"])
        if len(found) == len(request_ids):
            break
        asyncio.run(asyncio.sleep(0.1))
    client.close()
    return found


def test_one_event_per_request_whatever_the_outcome(gw: RunningGateway, es: EsServer) -> None:
    token = gw.token(sub="auditor-alice", tenant="bank")
    ctx = client_ssl_context(gw.pki.ca_cert)
    ids: dict[str, str] = {}
    with httpx.Client(base_url=gw.url, verify=ctx, timeout=60, headers={"User-Agent": "audit-test"}) as c:
        auth = {"Authorization": f"Bearer {token}"}
        ids["ok"] = c.post("/v1/chat/completions", json={"model": gw.model, **CHAT}, headers=auth).headers[
            "x-request-id"
        ]
        ids["bad"] = c.post("/v1/chat/completions", json={"model": gw.model}, headers=auth).headers["x-request-id"]
        ids["noauth"] = c.post("/v1/chat/completions", json={}).headers["x-request-id"]
        ids["nomodel"] = c.post("/v1/chat/completions", json={**CHAT, "model": "x"}, headers=auth).headers[
            "x-request-id"
        ]
        big = {"model": gw.model, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
        ids["big"] = c.post("/v1/chat/completions", json=big, headers=auth).headers["x-request-id"]
        with c.stream(
            "POST",
            "/v1/chat/completions",
            headers=auth,
            json={"model": gw.model, **CHAT, "max_tokens": 300, "stream": True, "ignore_eos": True},
        ) as r:
            ids["cut"] = r.headers["x-request-id"]
            lines = r.iter_lines()
            next(lines)
            next(lines)
    found = events(es, list(ids.values()))
    assert {k: len(found.get(v, [])) for k, v in ids.items()} == {k: 1 for k in ids}
    ev = {k: found[v][0] for k, v in ids.items()}
    ok = ev["ok"]
    assert ok["event"]["outcome"] == "success" and ok["http"]["response"]["status_code"] == 200
    assert ok["user"]["id"] == "auditor-alice" and ok["organization"]["id"] == "bank"
    assert ok["tls"]["version"] in ("1.3", "TLSv1.3") and ok["user_agent"]["original"] == "audit-test"
    assert ok["tianmen"]["model"] == gw.model and ok["tianmen"]["completion_tokens"] >= 1
    assert ok["tianmen"]["chain"]["hash"] and "secret plan" not in json.dumps(ok)  # sm3 policy: digests only
    assert [ev[k]["http"]["response"]["status_code"] for k in ("bad", "noauth", "nomodel", "big")] == [
        400,
        401,
        404,
        413,
    ]
    assert all(ev[k]["event"]["outcome"] == "failure" for k in ("bad", "noauth", "nomodel", "big"))
    assert ev["cut"]["tianmen"]["finish_reason"] == "client_disconnected" and ev["cut"]["tianmen"]["phase"] == "close"
    assert all(ev[k]["tianmen"]["phase"] == "complete" for k in ("ok", "bad", "noauth", "nomodel", "big"))
    client = Elasticsearch(es.url)  # the stream's opening record, written before its first byte
    opening = client.get(
        index=f"tianmen-audit-{ev['cut']['@timestamp'][:10].replace('-', '.')}", id=ids["cut"] + "~open"
    )
    client.close()
    assert opening["_source"]["tianmen"]["phase"] == "open" and opening["_source"]["event"]["outcome"] == "unknown"
    assert opening["_source"]["tianmen"]["chain"]["seq"] < ev["cut"]["tianmen"]["chain"]["seq"]


def test_cli_search_and_verify(gw: RunningGateway, es: EsServer, capsys: pytest.CaptureFixture[str]) -> None:
    token = gw.token(sub="auditor-bob", tenant="bank")
    with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as c:
        rid = c.post(
            "/v1/chat/completions", json={"model": gw.model, **CHAT}, headers={"Authorization": f"Bearer {token}"}
        ).headers["x-request-id"]
    events(es, [rid])
    home = gw.settings.home
    config = home / "tianmen.toml"
    config.write_text(
        f'home = "{home}"\n[audit]\nelasticsearch_url = "{es.url}"\nspool_dir = "{gw.settings.audit.spool_dir}"\n'
    )
    capsys.readouterr()
    assert cli(["audit", "search", "--config", str(config), "--user", "auditor-bob", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [e["event"]["id"] for e in found] == [rid]
    assert cli(["audit", "verify", "--config", str(config), "--spool"]) == 0
    assert "OK" in capsys.readouterr().out


def test_full_spool_refuses_with_503(tmp_path: Path) -> None:
    # no Elasticsearch: nothing ships, so a 32 KiB spool fills and then refuses (it never drops unshipped events)
    model = build_tiny_chat_model(tmp_path / "m")
    with run_gateway(tmp_path / "home", model, {"TIANMEN_AUDIT_MAX_SPOOL_BYTES": str(32 << 10)}) as g:
        with httpx.Client(base_url=g.url, verify=client_ssl_context(g.pki.ca_cert), timeout=60) as c:
            auth = {"Authorization": f"Bearer {g.token()}"}
            statuses = []
            for _ in range(200):
                r = c.post("/v1/chat/completions", json={"model": g.model, **CHAT}, headers=auth)
                statuses.append(r.status_code)
                if r.status_code != 200:
                    break
        assert statuses[0] == 200 and statuses[-1] == 503, statuses
        assert r.json()["error"]["code"] == "audit_unavailable" and "retry-after" in r.headers


def test_a_token_claim_of_the_wrong_type_is_a_401_through_the_gateway(gw: RunningGateway, es: EsServer) -> None:
    import time

    import jwt
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(gw.pki.jwt_key.read_bytes(), password=None)
    now = int(time.time())
    claims = {"iss": "tianmen-dev", "aud": "tianmen", "sub": 4711, "tenant": "bank", "iat": now, "exp": now + 60}
    token = jwt.PyJWS().encode(json.dumps(claims).encode(), key, "EdDSA", {"kid": gw.pki.kid})  # type: ignore[arg-type]
    with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as c:
        r = c.post(
            "/v1/chat/completions", json={"model": gw.model, **CHAT}, headers={"Authorization": f"Bearer {token}"}
        )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"
    assert r.json()["error"]["message"] == "token claim 'sub' must be a string, not a number"
    assert 'error_description="invalid_claim"' in r.headers["www-authenticate"]
    (event,) = events(es, [r.headers["x-request-id"]])[r.headers["x-request-id"]]
    assert event["error"]["type"] == "invalid_claim" and event["http"]["response"]["status_code"] == 401
