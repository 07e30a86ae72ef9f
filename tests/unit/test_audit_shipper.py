"""The shipper against a scripted Elasticsearch client: batches split by size, refusals quarantined, never
retried forever, and the trail in Elasticsearch still verifies (the stub stands in for the refused event)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from elastic_transport import ApiResponseMeta, HttpHeaders, NodeConfig
from elasticsearch import ApiError

from audit.chain import Chain
from audit.config import AuditConfig
from audit.digest import canonical_json
from audit.events import QUARANTINE_ACTION, AuditEvent
from audit.quarantine import Quarantine
from audit.shipper import RetryBatch, Shipper
from audit.spool import Spool
from audit.verify import ChainVerifier

Item = Callable[[dict[str, Any]], dict[str, Any]]  # a document -> its bulk item result


def api_error(status: int) -> ApiError:
    meta = ApiResponseMeta(status, "1.1", HttpHeaders(), 0.0, NodeConfig("http", "localhost", 9200))
    return ApiError("refused", meta, {"error": {"type": "x"}})


def created(_: dict[str, Any]) -> dict[str, Any]:
    return {"status": 201}


@dataclass
class ScriptedES:
    """`bulk` indexes what `item` accepts; over `max_docs` or `max_bytes` a request is refused whole (413)."""

    item: Item = created
    max_docs: int = 10_000
    max_bytes: int = 1 << 30
    requests: list[list[tuple[str, dict[str, Any]]]] = field(default_factory=list)
    index: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def bulk(self, operations: list[dict[str, Any]]) -> Any:
        pairs = [(op["create"]["_id"], doc) for op, doc in zip(operations[::2], operations[1::2])]
        self.requests.append(pairs)
        if len(pairs) > self.max_docs or sum(len(canonical_json(d)) for _, d in pairs) > self.max_bytes:
            raise api_error(413)
        items = []
        for id_, doc in pairs:
            result = self.item(doc) if doc["event"].get("action") != QUARANTINE_ACTION else {"status": 201}
            if result["status"] == 201:
                self.index[id_] = doc
            items.append({"create": result})
        return type("R", (), {"body": {"errors": any(i["create"]["status"] != 201 for i in items), "items": items}})


def spool_with(tmp_path: Path, events: list[dict[str, Any]]) -> Spool:
    spool = Spool(tmp_path, max_bytes=8 << 20, segment_bytes=1 << 20, shipping=True, retention_s=1e9)
    chain = Chain("gw-1")
    for event in events:
        line = canonical_json(chain.link(event)) + b"\n"
        spool.reserve(len(line))
        spool.write(line, 1)
    spool.sync()
    return spool


def event(i: int, **kw: Any) -> dict[str, Any]:
    return AuditEvent(f"req-{i}", "chat-completion", status_code=200, user_id="alice", **kw).to_dict()


def shipper(tmp_path: Path, es: ScriptedES, events: list[dict[str, Any]], **kw: Any) -> Shipper:
    cfg = AuditConfig(spool_dir=tmp_path, elasticsearch_url="http://es.invalid", **kw)
    return Shipper(cfg, spool_with(tmp_path, events), es)  # type: ignore[arg-type]


def verify_index(es: ScriptedES) -> Any:
    v = ChainVerifier()
    for id_, doc in sorted(es.index.items(), key=lambda kv: kv[1]["tianmen"]["chain"]["seq"]):
        v.feed(id_, doc)
    return v.report()


async def test_a_batch_is_cut_into_requests_under_the_byte_bound(tmp_path: Path) -> None:
    es = ScriptedES()
    s = shipper(tmp_path, es, [event(i, user_agent="u" * 500) for i in range(12)], ship_batch_bytes=2048)
    assert await s.ship_once() == 12
    assert all(sum(len(canonical_json(d)) for _, d in r) <= 2048 for r in es.requests)
    assert len(es.requests) >= 4 and [i for r in es.requests for i, _ in r] == [f"req-{i}" for i in range(12)]
    assert verify_index(es).ok


async def test_a_request_refused_as_too_large_is_halved(tmp_path: Path) -> None:
    es = ScriptedES(max_docs=3)
    s = shipper(tmp_path, es, [event(i) for i in range(10)])
    assert await s.ship_once() == 10
    assert sorted(es.index) == sorted(f"req-{i}" for i in range(10)) and s.rejected == 0
    assert [len(r) for r in es.requests][:3] == [10, 5, 2]  # 10 -> 5 -> (2, 3) ...


async def test_one_event_too_large_alone_is_quarantined_not_retried(tmp_path: Path) -> None:
    es = ScriptedES(max_bytes=4096)
    huge = event(1) | {"tianmen": {**event(1)["tianmen"], "prompt": {"text": "p" * 10_000}}}  # content: "full"
    s = shipper(tmp_path, es, [event(0), huge, event(2)])
    assert await s.ship_once() == 3
    assert await s.ship_once() == 0  # nothing left to retry
    (line,) = (tmp_path / "quarantine.jsonl").read_text().splitlines()
    assert json.loads(line)["status"] == 413 and json.loads(line)["record"]["event"]["id"] == "req-1"
    assert es.index["req-1"]["event"]["action"] == QUARANTINE_ACTION and verify_index(es).ok


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (400, {"type": "mapper_parsing_exception", "reason": "failed to parse field [user]"}),
        (400, {"type": "illegal_argument_exception", "reason": "Document contains at least one immense term"}),
        (413, {"type": "document_too_large", "reason": "too large"}),
    ],
)
async def test_an_event_refused_for_good_is_quarantined_and_a_stub_keeps_the_chain(
    tmp_path: Path, status: int, error: dict[str, Any]
) -> None:
    es = ScriptedES(item=lambda d: {"status": status, "error": error} if d["event"]["id"] == "req-1" else created(d))
    s = shipper(tmp_path, es, [event(i) for i in range(3)])
    assert await s.ship_once() == 3 and await s.ship_once() == 0
    assert s.rejected == 1
    stub = es.index["req-1"]
    assert stub["event"]["action"] == QUARANTINE_ACTION and stub["tianmen"]["quarantine"]["status"] == status
    (line,) = (tmp_path / "quarantine.jsonl").read_text().splitlines()
    original = json.loads(line)["record"]
    assert original["tianmen"]["chain"] == stub["tianmen"]["chain"]  # the original still hashes to the stub's hash
    report = verify_index(es)
    assert report.ok, report.problems
    assert report.num_quarantined == 1 and report.quarantined[0].event_id == "req-1"


@pytest.mark.parametrize("status", [429, 503, 403, 404])
async def test_a_transient_or_setup_refusal_is_retried_not_quarantined(tmp_path: Path, status: int) -> None:
    es = ScriptedES(item=lambda d: {"status": status, "error": {"type": "busy"}})
    s = shipper(tmp_path, es, [event(0)])
    with pytest.raises(RetryBatch):
        await s.ship_once()
    assert s.rejected == 0 and not (tmp_path / "quarantine.jsonl").exists()
    es.item = created
    assert await s.ship_once() == 1 and "req-0" in es.index  # the same batch, once the server takes it


def test_the_quarantine_stays_under_its_quota(tmp_path: Path) -> None:
    q = Quarantine(tmp_path, max_bytes=8192)
    records = [event(i, user_agent="u" * 300) for i in range(60)]
    for r in records:
        q.store([(r, 400, {"type": "mapper_parsing_exception"})])
        assert q.size() <= 8192
    newest = [json.loads(line)["record"]["event"]["id"] for line in q.path.read_text().splitlines()]
    assert newest[-1] == "req-59" and q.dropped_bytes > 0  # the oldest went
    q.store([(event(99, user_agent="u" * 500, model="m" * 250) | {"big": "x" * 9000}, 413, {"type": "too_large"})])
    last = json.loads(q.path.read_text().splitlines()[-1])
    assert "record" not in last and last["chain"] is None and last["record_bytes"] > 9000
