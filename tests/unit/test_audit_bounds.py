"""Client-controlled strings in an audit event are cut to byte bounds, on a UTF-8 boundary, and the cut is noted."""

from __future__ import annotations

import pytest

from audit.bounds import FIELD_LIMITS, cut_utf8
from audit.digest import canonical_json
from audit.events import AuditEvent


def test_cut_on_a_character_boundary() -> None:
    assert cut_utf8("abc", 3) == ("abc", None)
    assert cut_utf8("abcd", 3) == ("abc", 4)
    # "é" is 2 bytes, "天" 3: a cut inside a character drops the whole character
    assert cut_utf8("ééé", 5) == ("éé", 6)
    assert cut_utf8("天天", 5) == ("天", 6)
    assert cut_utf8("天", 2) == ("", 3)


def test_lone_surrogates_become_replacement_characters() -> None:
    text, original = cut_utf8("a\ud800b", 64)
    assert text == "a\ufffdb" and original is None
    text.encode("utf-8")  # valid UTF-8 now, so the event can be encoded


def test_a_one_mebibyte_model_name_is_cut_to_256_bytes_and_noted() -> None:
    doc = AuditEvent("r", "chat-completion", model="m" * (1 << 20), user_agent="ua").to_dict()
    assert doc["tianmen"]["model"] == "m" * 256
    assert doc["tianmen"]["truncated"] == [{"field": "tianmen.model", "bytes": 1 << 20}]
    assert doc["user_agent"]["original"] == "ua"


@pytest.mark.parametrize(("attr", "ecs", "limit"), [(a, e, n) for a, (e, n) in FIELD_LIMITS.items()])
def test_every_bounded_field(attr: str, ecs: str, limit: int) -> None:
    value = "天" * (limit // 3 + 10)  # over the limit, and not a multiple of the cut
    doc = AuditEvent("r", "a", **{attr: value}).to_dict()
    got = doc
    for part in ecs.split("."):
        got = got[part]
    assert isinstance(got, str) and len(got.encode()) <= limit and value.startswith(got)
    assert len(got.encode()) > limit - 3  # cut at the last whole character, not earlier
    assert doc["tianmen"]["truncated"] == [{"field": ecs, "bytes": len(value.encode())}]


def test_user_agent_512_and_several_cuts_in_one_event() -> None:
    doc = AuditEvent("r", "a", user_agent="u" * 600, url_path="/" + "p" * 5000, user_id="alice").to_dict()
    assert len(doc["user_agent"]["original"]) == 512
    assert {t["field"] for t in doc["tianmen"]["truncated"]} == {"user_agent.original", "url.path"}
    assert "truncated" not in AuditEvent("r", "a", user_agent="u" * 512).to_dict()["tianmen"]
    assert len(canonical_json(doc)) < 4096  # the whole event stays small whatever the client sent


def test_tool_names_are_bounded_in_count_and_length() -> None:
    doc = AuditEvent(request_id="r", action="chat", tool_calls=["f" * 100, *["g"] * 200], schema_constrained=True)
    out = doc.to_dict()["tianmen"]
    assert len(out["tool_calls"]) == 128 and out["tool_calls"][0] == "f" * 64 and out["schema_constrained"] is True
    assert {t["field"] for t in out["truncated"]} == {"tianmen.tool_calls"} and len(out["truncated"]) == 2
    plain = AuditEvent(request_id="r", action="chat").to_dict()["tianmen"]
    assert "tool_calls" not in plain and "schema_constrained" not in plain  # no tools, no constraint field
    none_called = AuditEvent(request_id="r", action="chat", tool_calls=[]).to_dict()["tianmen"]
    assert none_called["tool_calls"] == []  # tools offered, none called
