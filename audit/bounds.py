"""Byte bounds on the client-controlled strings of an event, so that Elasticsearch never refuses one.

A keyword term over 32 KiB is an "immense term" that ES refuses; the bounds below keep every field far
under that and an event far under the bulk size limit. A cut string is noted in `tianmen.truncated`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# AuditEvent attribute -> (ECS field name, max UTF-8 bytes); event.id and event.action are the gateway's own
FIELD_LIMITS: dict[str, tuple[str, int]] = {
    "user_id": ("user.id", 256),
    "tenant": ("organization.id", 256),
    "source_ip": ("source.ip", 64),
    "tls_version": ("tls.version", 16),
    "tls_client_subject": ("tls.client.subject", 1024),
    "http_method": ("http.request.method", 32),
    "url_path": ("url.path", 1024),
    "user_agent": ("user_agent.original", 512),
    "model": ("tianmen.model", 256),
    "finish_reason": ("tianmen.finish_reason", 256),
    "ratelimit_decision": ("tianmen.ratelimit.decision", 256),
    "error_type": ("error.type", 256),
}


@dataclass(slots=True)
class Truncation:
    field: str  # the ECS name
    bytes: int  # the original length in UTF-8 bytes

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "bytes": self.bytes}


def cut_utf8(text: str, limit: int) -> tuple[str, int | None]:
    """`text` in at most `limit` UTF-8 bytes, cut on a character boundary, and its original byte
    length when it was cut (else None). Lone surrogates (valid JSON, not UTF-8) become U+FFFD."""
    if text.isascii():  # the usual field (O(1) in CPython): a byte a character, no surrogate possible
        return (text, None) if len(text) <= limit else (text[:limit], len(text))
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
        data = text.encode("utf-8")
    if len(data) <= limit:
        return text, None
    return data[:limit].decode("utf-8", "ignore"), len(data)


def bound_fields(values: dict[str, str | None]) -> tuple[dict[str, str | None], list[Truncation]]:
    """Each value (by AuditEvent attribute name) cut to its limit; the list of what was cut."""
    out: dict[str, str | None] = {}
    cut: list[Truncation] = []
    for name, value in values.items():
        if value is None or name not in FIELD_LIMITS:
            out[name] = value
            continue
        ecs, limit = FIELD_LIMITS[name]
        out[name], original = cut_utf8(value, limit)
        if original is not None:
            cut.append(Truncation(ecs, original))
    return out, cut


MAX_NAMES, MAX_NAME_BYTES = 128, 64  # tianmen.tool_calls: OpenAI's limit on tools, and on a function name


def bound_names(names: list[str] | None, cut: list[Truncation]) -> list[str] | None:
    """At most MAX_NAMES names of at most MAX_NAME_BYTES each; a cut is noted in `cut`."""
    if names is None:
        return None
    out = []
    for name in names[:MAX_NAMES]:
        short, original = cut_utf8(name, MAX_NAME_BYTES)
        out.append(short)
        if original is not None:
            cut.append(Truncation("tianmen.tool_calls", original))
    if len(names) > MAX_NAMES:
        cut.append(Truncation("tianmen.tool_calls", sum(len(n.encode("utf-8", "replace")) for n in names)))
    return out
