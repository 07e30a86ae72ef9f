"""One audit event per request, in Elastic Common Schema field names plus `tianmen.*`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from audit.bounds import FIELD_LIMITS, bound_fields, bound_names
from audit.config import ContentPolicy
from audit.digest import sm3_text

CHECKPOINT_ACTION = "audit-checkpoint"
QUARANTINE_ACTION = "audit-quarantined"  # a stub shipped in place of an event Elasticsearch refused
# tianmen.phase: one request is one "complete" record, or (a streamed response) an "open" record at its
# first byte and a "close" record at its end; "interrupted" closes an open record a crash left behind
PHASES = ("complete", "open", "close", "interrupted")


@dataclass(slots=True)
class AuditEvent:
    """A finished request → `to_dict()`, the ECS document `Auditor.emit` takes.

    `content` comes from `content_fields()`; it is kept out of `repr` so it never reaches a log."""

    request_id: str
    action: str  # e.g. "chat.completions", "completions", "models"
    status_code: int | None = None
    outcome: str | None = None  # "success" | "failure" | "unknown"; None: from status_code
    timestamp: datetime | None = None  # when the request arrived; None: now
    duration_ns: int | None = None
    user_id: str | None = None
    tenant: str | None = None
    source_ip: str | None = None
    tls_version: str | None = None  # "1.3"
    tls_client_subject: str | None = None
    http_method: str | None = None
    url_path: str | None = None
    user_agent: str | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_ms: float | None = None
    finish_reason: str | None = None
    stream: bool | None = None
    ratelimit_decision: str | None = None  # "allowed" | "limited" | "unavailable"
    error_type: str | None = None  # "invalid_token", "rate_limited", "client_disconnected", ...
    phase: str = "complete"
    schema_constrained: bool | None = None  # the output had to match a JSON schema or grammar
    tool_calls: list[str] | None = None  # names of the functions the model called (arguments are content)
    content: dict[str, Any] = field(default_factory=dict, repr=False)
    # the privacy policies that fired: [{direction, policy, action, count}], never what they matched
    policy_hits: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The ECS document; client-controlled strings are cut to `audit.bounds.FIELD_LIMITS`."""
        assert self.phase in PHASES, f"phase: one of {PHASES}"
        v, cut = bound_fields({name: getattr(self, name) for name in FIELD_LIMITS})
        outcome = self.outcome or _outcome(self.status_code)
        doc: dict[str, Any] = {
            "@timestamp": format_timestamp(self.timestamp or datetime.now(timezone.utc)),
            "event": {
                "id": self.request_id,
                "kind": "event",
                "action": self.action,
                "outcome": outcome,
                "duration": self.duration_ns,
            },
            "user": {"id": v["user_id"]},
            "organization": {"id": v["tenant"]},
            "source": {"ip": v["source_ip"]},
            "tls": {"version": v["tls_version"], "version_protocol": "tls" if v["tls_version"] else None},
            "http": {"request": {"method": v["http_method"]}, "response": {"status_code": self.status_code}},
            "url": {"path": v["url_path"]},
            "user_agent": {"original": v["user_agent"]},
            "error": {"type": v["error_type"]},
            "tianmen": {
                "model": v["model"],
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
                "ttft_ms": _finite(self.ttft_ms),
                "finish_reason": v["finish_reason"],
                "stream": self.stream,
                "ratelimit": {"decision": v["ratelimit_decision"]},
                "phase": self.phase,
                "schema_constrained": self.schema_constrained,
                "tool_calls": bound_names(self.tool_calls, cut),
                **self.content,
            },
        }
        if cut:
            doc["tianmen"]["truncated"] = [t.to_dict() for t in cut]
        if self.policy_hits:
            doc["tianmen"]["policy"] = policy_fields(self.policy_hits)
        if v["tls_client_subject"] is not None:
            doc["tls"]["client"] = {"subject": v["tls_client_subject"]}
        return _prune(doc)


def content_fields(policy: ContentPolicy, prompt: str | bytes | None, response: str | bytes | None) -> dict[str, Any]:
    """The `tianmen.*` content fields under `policy`: nothing, SM3 digests (default), or digests + text."""
    out: dict[str, Any] = {"content_policy": policy}
    if policy == "none":
        return out
    for name, value in (("prompt", prompt), ("response", response)):
        if value is None:
            continue
        out[name] = {"sm3": sm3_text(value)}
        if policy == "full":
            out[name]["text"] = value if isinstance(value, str) else value.decode("utf-8", "replace")
    return out


def policy_fields(hits: list[dict[str, Any]]) -> dict[str, Any]:
    """`tianmen.policy`: each (direction, policy, action) with its count, plus flat lists to aggregate on (an
    array of objects is flattened by Elasticsearch, so "which policies fired" needs its own keyword list)."""
    rows = sorted(hits, key=lambda h: (h["direction"], h["policy"], h["action"]))
    return {
        "hits": [{k: h[k] for k in ("direction", "policy", "action", "count")} for h in rows],
        "fired": sorted({h["policy"] for h in rows}),
        "actions": sorted({h["action"] for h in rows}),
        "count": sum(int(h["count"]) for h in rows),
    }


def format_timestamp(ts: datetime) -> str:
    """ISO 8601 in UTC to the millisecond: 2026-12-05T03:04:05.123Z."""
    assert ts.tzinfo is not None, "audit timestamps are timezone-aware"
    if ts.tzinfo is not timezone.utc:
        ts = ts.astimezone(timezone.utc)
    return ts.isoformat(timespec="milliseconds")[:-6] + "Z"  # isoformat: half strftime's cost; drop "+00:00"


def _outcome(status: int | None) -> str:
    if status is None:
        return "unknown"
    return "success" if status < 400 else "failure"


def _finite(x: float | None) -> float | None:
    return round(x, 3) if x is not None and math.isfinite(x) else None


def _prune(d: dict[str, Any]) -> dict[str, Any]:
    """`d` without None values and without objects left empty; one per request, so kept lean."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if v is None:
            continue
        if isinstance(v, dict):
            v = _prune(v)
            if not v:
                continue
        out[k] = v
    return out
