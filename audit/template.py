"""The Elasticsearch index template and ILM policy for the audit indices (also in deploy/elasticsearch/)."""

from __future__ import annotations

from typing import Any

TEMPLATE_VERSION = 3
TEMPLATE_NAME = "tianmen-audit"
POLICY_NAME = "tianmen-audit-retention"

_K: dict[str, Any] = {"type": "keyword"}
_L: dict[str, Any] = {"type": "long"}


def _obj(**props: dict[str, Any]) -> dict[str, Any]:
    return {"properties": props}


# NOTE: `dynamic: false` keeps unknown fields in _source (so hashes still verify) without mapping them.
MAPPINGS: dict[str, Any] = {
    "dynamic": False,
    "properties": {
        "@timestamp": {"type": "date"},
        "event": _obj(id=_K, kind=_K, action=_K, outcome=_K, duration=_L),
        "user": _obj(id=_K),
        "organization": _obj(id=_K),
        "source": _obj(ip={"type": "ip"}),
        "tls": _obj(version=_K, version_protocol=_K, client=_obj(subject=_K)),
        "http": _obj(request=_obj(method=_K), response=_obj(status_code=_L)),
        "url": _obj(path=_K),
        "user_agent": _obj(original=_K),
        "error": _obj(type=_K),
        "tianmen": _obj(
            model=_K,
            prompt_tokens=_L,
            completion_tokens=_L,
            cached_tokens=_L,
            ttft_ms={"type": "double"},
            finish_reason=_K,
            stream={"type": "boolean"},
            content_policy=_K,
            ratelimit=_obj(decision=_K),
            phase=_K,
            schema_constrained={"type": "boolean"},
            tool_calls=_K,  # names only: an array of keywords
            truncated=_obj(field=_K, bytes=_L),
            quarantine=_obj(status=_L, error=_K),
            prompt=_obj(sm3=_K, text={"type": "text"}),
            response=_obj(sm3=_K, text={"type": "text"}),
            chain=_obj(writer=_K, seq=_L, prev=_K, hash=_K),
            policy=_obj(hits=_obj(direction=_K, policy=_K, action=_K, count=_L), fired=_K, actions=_K, count=_L),
            checkpoint=_obj(seq=_L, hash=_K, key_id=_K, signature={"type": "keyword", "index": False}),
        ),
    },
}


def index_template(prefix: str, *, lifecycle: str | None) -> dict[str, Any]:
    """Body for PUT _index_template/<name>: dated indices `<prefix>-YYYY.MM.DD`."""
    settings: dict[str, Any] = {
        "index.number_of_shards": 1,
        "index.auto_expand_replicas": "0-1",
        "index.mapping.ignore_malformed": True,
    }
    if lifecycle:
        # retention counts from the date in the index name, so a late replay still expires on time
        settings["index.lifecycle.name"] = lifecycle
        settings["index.lifecycle.parse_origination_date"] = True
    return {
        "index_patterns": [f"{prefix}-*"],
        "priority": 200,
        "version": TEMPLATE_VERSION,
        "_meta": {"managed_by": "tianmen", "description": "Tianmen audit trail: one event per request"},
        "template": {"settings": settings, "mappings": MAPPINGS},
    }


def ilm_policy(retention_days: int) -> dict[str, Any]:
    """Body for PUT _ilm/policy/<name>: delete an index `retention_days` after its date."""
    return {
        "policy": {
            "_meta": {"managed_by": "tianmen"},
            "phases": {
                "hot": {"min_age": "0ms", "actions": {}},
                "delete": {"min_age": f"{retention_days}d", "actions": {"delete": {}}},
            },
        }
    }


def mapped_fields(mappings: dict[str, Any] = MAPPINGS) -> set[str]:
    """Dotted names of every leaf field in `mappings`."""
    out: set[str] = set()

    def walk(props: dict[str, Any], prefix: str) -> None:
        for name, spec in props.items():
            if "properties" in spec:
                walk(spec["properties"], f"{prefix}{name}.")
            else:
                out.add(prefix + name)

    walk(mappings["properties"], "")
    return out
