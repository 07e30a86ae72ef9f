from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from audit.template import POLICY_NAME, ilm_policy, index_template, mapped_fields

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
FIELDS = mapped_fields()


def saved_objects() -> list[dict[str, Any]]:
    lines = (DEPLOY / "kibana" / "saved-objects.ndjson").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_deploy_files_are_what_the_shipper_installs() -> None:
    template = json.loads((DEPLOY / "elasticsearch" / "index-template.json").read_text())
    assert template == index_template("tianmen-audit", lifecycle=POLICY_NAME)
    policy = json.loads((DEPLOY / "elasticsearch" / "ilm-policy.json").read_text())
    assert policy == ilm_policy(180)
    assert policy["policy"]["phases"]["delete"]["min_age"] == "180d"


def test_template_maps_every_field_an_event_can_carry() -> None:
    from audit.chain import Chain
    from audit.events import AuditEvent, content_fields
    from audit.quarantine import quarantine_stub
    from audit.signer import Sm2Signer

    full = AuditEvent(
        request_id="r",
        action="chat",
        status_code=200,
        duration_ns=1,
        user_id="u",
        tenant="t",
        source_ip="10.0.0.1",
        tls_version="1.3",
        tls_client_subject="CN=u",
        http_method="POST",
        url_path="/v1",
        user_agent="ua",
        model="m",
        prompt_tokens=1,
        completion_tokens=2,
        cached_tokens=3,
        ttft_ms=4.5,
        finish_reason="stop",
        stream=True,
        ratelimit_decision="allowed",
        error_type="none",
        phase="close",
        schema_constrained=True,
        tool_calls=["get_weather"],
        content=content_fields("full", "p", "r"),
        policy_hits=[{"direction": "prompt", "policy": "bank_card", "action": "mask", "count": 2}],
    ).to_dict()
    cut = AuditEvent(request_id="r", action="chat", model="m" * 300).to_dict()
    assert cut["tianmen"]["truncated"]
    chain = Chain("w")
    record = chain.link(full)
    stub = quarantine_stub(chain.link(cut), 400, {"type": "mapper_parsing_exception"})
    checkpoint = chain.checkpoint(Sm2Signer(f"{11:064x}"), datetime.now(timezone.utc))

    def leaves(d: dict[str, Any], prefix: str = "") -> set[str]:
        out: set[str] = set()
        for k, v in d.items():
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):  # a list of objects
                for x in v:
                    out |= leaves(x, f"{prefix}{k}.")
            else:
                out |= leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
        return out

    assert leaves(record) | leaves(checkpoint) | leaves(stub) <= FIELDS
    assert {f"tianmen.truncated.{k}" for k in cut["tianmen"]["truncated"][0]} <= FIELDS  # a list of objects


def test_saved_objects_parse_and_every_reference_resolves() -> None:
    objects = saved_objects()
    ids = {(o["type"], o["id"]) for o in objects}
    assert len(ids) == len(objects)
    assert {o["type"] for o in objects} >= {"index-pattern", "search", "visualization", "dashboard"}
    for o in objects:
        names = set()
        for ref in o["references"]:
            assert (ref["type"], ref["id"]) in ids, f"{o['id']}: dangling reference {ref}"
            names.add(ref["name"])
        meta = o["attributes"].get("kibanaSavedObjectMeta", {}).get("searchSourceJSON")
        if meta and "indexRefName" in json.loads(meta):
            assert json.loads(meta)["indexRefName"] in names
        if o["type"] == "dashboard":
            panels = json.loads(o["attributes"]["panelsJSON"])
            assert len(panels) >= 6
            assert {p["panelRefName"] for p in panels} <= names


def test_data_view_matches_the_template_and_every_field_exists() -> None:
    objects = saved_objects()
    (view,) = (o for o in objects if o["type"] == "index-pattern")
    assert [view["attributes"]["title"]] == index_template("tianmen-audit", lifecycle=None)["index_patterns"]
    used: set[str] = {view["attributes"]["timeFieldName"]}
    for o in objects:
        attrs = o["attributes"]
        used |= set(attrs.get("columns", []))
        used |= {field for field, _ in attrs.get("sort", [])}
        if "visState" in attrs:
            for agg in json.loads(attrs["visState"])["aggs"]:
                if "field" in agg["params"]:
                    used.add(agg["params"]["field"])
        meta = attrs.get("kibanaSavedObjectMeta", {}).get("searchSourceJSON")
        if meta:
            used |= set(re.findall(r"([\w@.]+)\s*:", json.loads(meta)["query"]["query"]))
    assert used - FIELDS == set()
    assert {"event.outcome", "error.type", "organization.id", "tianmen.model", "user.id", "event.duration"} <= used
    assert {"tianmen.policy.fired", "tianmen.policy.actions", "tianmen.policy.count"} <= used  # hits by tenant


def test_kibana_shows_one_event_per_request() -> None:
    # a stream writes an opening record at its first byte and a closing one at its end: only the latter counts
    for o in saved_objects():
        meta = o["attributes"].get("kibanaSavedObjectMeta", {}).get("searchSourceJSON")
        if meta and o["type"] in ("search", "visualization"):
            query = json.loads(meta)["query"]["query"]
            assert 'NOT tianmen.phase : "open"' in query and 'NOT event.action : "audit-checkpoint"' in query, o["id"]
