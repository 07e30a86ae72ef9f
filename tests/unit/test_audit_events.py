from __future__ import annotations

from datetime import datetime, timezone

from audit.digest import sm3_text
from audit.events import AuditEvent, content_fields

T0 = datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=timezone.utc)


def test_event_uses_ecs_names_and_drops_unset_fields() -> None:
    doc = AuditEvent(
        request_id="req-1",
        action="chat.completions",
        status_code=429,
        timestamp=T0,
        duration_ns=1_500_000,
        user_id="alice",
        tenant="acme",
        source_ip="10.0.0.7",
        tls_version="1.3",
        tls_client_subject="CN=alice",
        http_method="POST",
        url_path="/v1/chat/completions",
        user_agent="curl/8",
        model="qwen",
        prompt_tokens=12,
        ratelimit_decision="limited",
        error_type="rate_limited",
    ).to_dict()
    assert doc == {
        "@timestamp": "2026-11-29T12:00:00.123Z",
        "event": {
            "id": "req-1",
            "kind": "event",
            "action": "chat.completions",
            "outcome": "failure",
            "duration": 1_500_000,
        },
        "user": {"id": "alice"},
        "organization": {"id": "acme"},
        "source": {"ip": "10.0.0.7"},
        "tls": {"version": "1.3", "version_protocol": "tls", "client": {"subject": "CN=alice"}},
        "http": {"request": {"method": "POST"}, "response": {"status_code": 429}},
        "url": {"path": "/v1/chat/completions"},
        "user_agent": {"original": "curl/8"},
        "error": {"type": "rate_limited"},
        "tianmen": {"model": "qwen", "prompt_tokens": 12, "ratelimit": {"decision": "limited"}, "phase": "complete"},
    }


def test_outcome_follows_status_unless_given() -> None:
    assert AuditEvent("r", "a", status_code=200).to_dict()["event"]["outcome"] == "success"
    assert AuditEvent("r", "a").to_dict()["event"]["outcome"] == "unknown"
    assert AuditEvent("r", "a", status_code=200, outcome="failure").to_dict()["event"]["outcome"] == "failure"


def test_non_finite_ttft_is_dropped_and_finite_rounded() -> None:
    assert "ttft_ms" not in AuditEvent("r", "a", ttft_ms=float("inf")).to_dict().get("tianmen", {})
    assert AuditEvent("r", "a", ttft_ms=12.34567).to_dict()["tianmen"]["ttft_ms"] == 12.346


def test_content_policies() -> None:
    assert content_fields("none", "secret prompt", "secret answer") == {"content_policy": "none"}
    sm3 = content_fields("sm3", "secret prompt", b"secret answer")
    assert sm3 == {
        "content_policy": "sm3",
        "prompt": {"sm3": sm3_text("secret prompt")},
        "response": {"sm3": sm3_text("secret answer")},
    }
    full = content_fields("full", "secret prompt", None)
    assert full == {"content_policy": "full", "prompt": {"sm3": sm3_text("secret prompt"), "text": "secret prompt"}}


def test_content_lands_in_the_document_but_never_in_repr() -> None:
    event = AuditEvent("r", "a", content=content_fields("full", "secret prompt", "secret answer"))
    assert event.to_dict()["tianmen"]["response"]["text"] == "secret answer"
    assert "secret" not in repr(event)


def test_policy_hits_are_counts_never_text() -> None:
    hits = [
        {"direction": "prompt", "policy": "id_card", "action": "tokenize", "count": 1},
        {"direction": "completion", "policy": "bank_card", "action": "mask", "count": 2},
        {"direction": "prompt", "policy": "bank_card", "action": "mask", "count": 3},
    ]
    doc = AuditEvent(request_id="r", action="chat", policy_hits=hits).to_dict()
    assert doc["tianmen"]["policy"] == {
        "hits": sorted(hits, key=lambda h: (h["direction"], h["policy"])),
        "fired": ["bank_card", "id_card"],
        "actions": ["mask", "tokenize"],
        "count": 6,
    }
    assert "policy" not in AuditEvent(request_id="r", action="chat").to_dict()["tianmen"]
