"""An unauthenticated flood through the real gateway: 429 per source past the failed-auth budget, every refusal
still audited, the spool within its quota, and authenticated requests served with 200 all along."""

from __future__ import annotations

from pathlib import Path

import httpx

from security.tls import client_ssl_context
from tests.audit_spool import spooled
from tests.gateway_server import run_gateway
from tests.tiny_model import build_tiny_chat_model

QUOTA = 8 << 20  # audit.max_spool_bytes: small next to the 1 GiB default
FLOOD, BURST = 300, 20
AGENT = "flood/" + "x" * (16 << 10)  # a 16 KiB user agent, in every audit event


def spool_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_unauthenticated_flood_is_bounded_and_does_not_starve_others(tmp_path: Path) -> None:
    model = build_tiny_chat_model(tmp_path / "tiny")
    env = {
        "TIANMEN_AUDIT_MAX_SPOOL_BYTES": str(QUOTA),
        "TIANMEN_SERVER_AUTH_FAILURES_PER_MINUTE": "60",
        "TIANMEN_SERVER_AUTH_FAILURE_BURST": str(BURST),
    }
    with run_gateway(tmp_path / "home", model, env) as gw:
        spool = gw.settings.audit.spool_dir
        assert spool is not None
        body = {"model": gw.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        flood: list[int] = []
        served: list[int] = []
        with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as c:
            for i in range(FLOOD):
                bad = {"User-Agent": AGENT} | ({"Authorization": "Bearer garbage"} if i % 2 else {})
                r = c.post("/v1/chat/completions", json=body, headers=bad)
                flood.append(r.status_code)
                if r.status_code == 429:
                    assert r.json()["error"]["code"] == "too_many_auth_failures" and int(r.headers["retry-after"]) >= 1
                if i % 25 == 0:
                    ok = c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {gw.token()}"})
                    served.append(ok.status_code)
            after = c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {gw.token()}"})
        assert set(served) == {200} and after.status_code == 200
        assert set(flood) == {401, 429}
        assert flood[:BURST] == [401] * BURST and flood.count(429) >= FLOOD - BURST - 10  # ~1/s refills
        used = spool_bytes(spool)
        assert 0 < used <= QUOTA
    statuses = [e.get("http", {}).get("response", {}).get("status_code") for e in spooled(spool)]
    assert statuses.count(429) == flood.count(429) and statuses.count(401) == flood.count(401)  # each one audited
