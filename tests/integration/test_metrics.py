"""/metrics after real traffic through the gateway, and the engine profiler endpoint."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from security.tls import client_ssl_context
from tests.gateway_server import RunningGateway, run_gateway
from tests.tiny_model import build_tiny_chat_model

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    model = build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")
    env = {"TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE": "3"}
    with run_gateway(tmp_path_factory.mktemp("home"), model, env) as g:
        yield g


def client(gw: RunningGateway) -> httpx.Client:
    return httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=60)


def scrape(gw: RunningGateway) -> dict[str, float]:
    with client(gw) as c:
        r = c.get("/metrics", headers={"Authorization": f"Bearer {gw.token(sub='prom', scopes=['admin'])}"})
    assert r.status_code == 200
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        m = re.match(r"^(tianmen:[^\s]+)\s+(\S+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def total(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix))


def test_metrics_move_with_traffic(gw: RunningGateway) -> None:
    before = scrape(gw)
    with client(gw) as c:
        auth = {"Authorization": f"Bearer {gw.token(sub='m-user', tenant='t1')}"}
        statuses = [
            c.post("/v1/chat/completions", json={"model": gw.model, **CHAT}, headers=auth).status_code for _ in range(4)
        ]
        c.get("/v1/models", headers={"Authorization": "Bearer nonsense"})
    assert statuses == [200, 200, 200, 429]
    after = scrape(gw)
    for family in (
        "tianmen:time_to_first_token_seconds_count",
        "tianmen:e2e_request_latency_seconds_count",
        "tianmen:inter_token_latency_seconds_count",
        "tianmen:generation_tokens_total",
        "tianmen:prompt_tokens_total",
        "tianmen:prefix_cache_queries_total",
    ):
        assert total(after, family) > total(before, family), family
    assert total(after, "tianmen:generation_tokens_total") - total(before, "tianmen:generation_tokens_total") == 15
    assert after['tianmen:http_requests_total{status="429"}'] >= 1
    assert after['tianmen:auth_failures_total{reason="malformed"}'] >= 1
    assert after['tianmen:ratelimit_refusals_total{limit="requests"}'] >= 1
    assert 'model="' + gw.model in next(k for k in after if k.startswith("tianmen:time_to_first_token_seconds_count"))
    for gauge in (
        "tianmen:num_requests_running",
        "tianmen:num_requests_waiting",
        "tianmen:kv_cache_usage_perc",
        "tianmen:audit_spool_bytes",
        "tianmen:audit_unshipped_events",
    ):
        assert any(k.startswith(gauge) for k in after), gauge
    assert total(after, "tianmen:audit_spool_bytes") > 0


def test_metrics_and_profiler_need_the_admin_scope(gw: RunningGateway, tmp_path: object) -> None:
    with client(gw) as c:
        user = {"Authorization": f"Bearer {gw.token(sub='plain')}"}
        assert c.get("/metrics", headers=user).status_code == 403
        assert c.post("/admin/profile", json={"steps": 2}, headers=user).status_code == 403
        admin = {"Authorization": f"Bearer {gw.token(sub='ops', scopes=['admin'])}"}
        assert c.post("/admin/profile", json={"steps": 0}, headers=admin).status_code == 400
        r = c.post("/admin/profile", json={"steps": 2}, headers=admin)
        assert r.status_code == 200
        trace = r.json()["trace"]
        c.post(
            "/v1/chat/completions",
            json={"model": gw.model, **CHAT},
            headers={"Authorization": f"Bearer {gw.token(sub='p2')}"},
        )
    from pathlib import Path

    for _ in range(100):
        if Path(trace).exists():
            break
        time.sleep(0.05)
    assert "traceEvents" in json.loads(Path(trace).read_text())
