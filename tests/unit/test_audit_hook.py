"""The request's audit record is durable before its first byte: the app with a real Auditor (spool only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from audit import AuditConfig, Auditor, AuditUnavailable, SpoolSource, verify
from audit.chain import Chain
from audit.digest import canonical_json
from audit.events import AuditEvent
from audit.spool import Spool
from gateway.app import Deps, create_app
from gateway.audit_hook import AuditHook
from gateway.state import RequestState
from tests.unit.test_gateway_app import AUTH, CHAT, FakeEngine, FakeVerifier


def records(spool_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for p in sorted(spool_dir.glob("seg-*.jsonl")) for line in p.read_text().splitlines()]


def app_with(hook: AuditHook, startup: list[Any]) -> TestClient:
    async def on_complete(scope: Any, audit: dict[str, Any]) -> None:
        await hook(scope, scope["request_state"])

    deps = Deps(
        engine=FakeEngine(),
        verifier=FakeVerifier(),
        on_complete=on_complete,
        on_response_start=hook.opened,
        audit_precheck=hook.check,
        startup=startup,
    )
    return TestClient(create_app(deps))


@pytest.fixture
def auditor(tmp_path: Path) -> Auditor:
    return Auditor(AuditConfig(spool_dir=tmp_path / "spool", writer_id="gw-1"))


def test_a_plain_response_has_its_complete_record_written_at_response_start(auditor: Auditor, tmp_path: Path) -> None:
    seen: list[list[dict[str, Any]]] = []
    hook = AuditHook(auditor)
    opened = hook.opened

    async def spy(scope: Any, state: RequestState) -> None:
        await opened(scope, state)
        seen.append(records(tmp_path / "spool"))  # on disk (fsynced) before the response goes on

    hook.opened = spy  # type: ignore[method-assign]
    with app_with(hook, [auditor.start]) as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        rid = r.headers["x-request-id"]
        c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer bad"})
    (first, _), everything = seen, records(tmp_path / "spool")
    assert [e["event"]["id"] for e in first] == [rid]
    assert first[0]["tianmen"]["phase"] == "complete" and first[0]["tianmen"]["completion_tokens"] == 2
    assert [(e["tianmen"]["phase"], e["http"]["response"]["status_code"]) for e in everything] == [
        ("complete", 200),
        ("complete", 401),
    ]  # the end of the request adds nothing


def test_a_stream_gets_an_opening_and_a_closing_record(auditor: Auditor, tmp_path: Path) -> None:
    with app_with(AuditHook(auditor), [auditor.start]) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    assert r.status_code == 200 and "[DONE]" in r.text
    opening, closing = records(tmp_path / "spool")
    assert opening["event"]["id"] == closing["event"]["id"] == r.headers["x-request-id"]
    assert opening["tianmen"]["phase"] == "open" and opening["event"]["outcome"] == "unknown"
    assert "completion_tokens" not in opening["tianmen"] and "duration" not in opening["event"]
    assert closing["tianmen"]["phase"] == "close" and closing["event"]["outcome"] == "success"
    assert closing["tianmen"]["completion_tokens"] == 2 and closing["tianmen"]["chain"]["seq"] == 1


class UnwritableAuditor:
    """Passes the precheck, then cannot write (the disk filled between the two)."""

    def __init__(self) -> None:
        self.emitted = 0

    def check_writable(self) -> None:
        pass

    async def emit(self, event: Any) -> None:
        self.emitted += 1
        raise AuditUnavailable("audit spool write failed: ENOSPC")

    def content_fields(self, prompt: Any, response: Any) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("stream", [False, True])
def test_no_response_is_served_when_its_record_cannot_be_written(stream: bool) -> None:
    sink = UnwritableAuditor()
    with app_with(AuditHook(sink), []) as c:  # type: ignore[arg-type]
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=AUTH)
    assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.headers["x-request-id"]
    assert r.json()["error"]["code"] == "audit_unavailable" and "audit trail" in r.json()["error"]["message"]
    assert "hi" not in r.text and "data:" not in r.text
    assert sink.emitted == 2  # at response start, then (best effort) the 503's own record at the end


def write_records(spool_dir: Path, events: list[dict[str, Any]]) -> None:
    spool = Spool(spool_dir, max_bytes=1 << 20, segment_bytes=1 << 16, shipping=False, retention_s=1e9)
    spool.store_writer("gw-1")
    chain = Chain("gw-1")
    for e in events:
        line = canonical_json(chain.link(e)) + b"\n"
        spool.reserve(len(line))
        spool.write(line, 1)
    spool.sync()
    spool.close()


async def test_a_restart_closes_the_streams_a_crash_left_open(tmp_path: Path) -> None:
    def ev(rid: str, phase: str) -> dict[str, Any]:
        return AuditEvent(rid, "chat-completion", status_code=200, model="m", phase=phase).to_dict()

    spool_dir = tmp_path / "spool"
    write_records(spool_dir, [ev("a", "open"), ev("b", "complete"), ev("c", "open"), ev("a", "close")])
    report = await verify(SpoolSource(spool_dir))
    assert report.ok and [(n.event_id, n.seq) for n in report.interrupted] == [("c", 2)]
    assert "opened, never closed" in report.interrupted[0].reason

    auditor = Auditor(AuditConfig(spool_dir=spool_dir))
    await auditor.start()
    await auditor.stop()
    last = records(spool_dir)[-1]
    assert last["event"]["id"] == "c" and last["tianmen"]["phase"] == "interrupted"
    assert last["error"]["type"] == "interrupted" and last["event"]["outcome"] == "unknown"
    assert last["tianmen"]["model"] == "m" and last["tianmen"]["chain"]["seq"] == 4
    report = await verify(SpoolSource(spool_dir))
    assert report.ok and [n.event_id for n in report.interrupted] == ["c"]
    assert "closed as interrupted" in report.interrupted[0].reason
    await auditor.start()  # a second restart has nothing left to close
    await auditor.stop()
    assert len(records(spool_dir)) == 5
