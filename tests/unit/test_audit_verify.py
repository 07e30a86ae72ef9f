from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from audit.auditor import Auditor
from audit.chain import event_hash
from audit.config import AuditConfig
from audit.digest import canonical_json
from audit.events import CHECKPOINT_ACTION, AuditEvent
from audit.signer import Sm2Signer, public_key_of
from audit.source import SpoolSource
from audit.verify import ChainVerifier, VerifyReport, format_report, verify

KEY = "3945208f7b2144b13f36e38ac6d39f95889393692860b51a42fb81ef4df7c5b8"
OTHER_KEY = "7a1c3b5d9e2f4a6b8c0d1e3f5a7b9c2d4e6f8a0b1c3d5e7f9a2b4c6d8e0f1a3b"
PUB = public_key_of(KEY)


@pytest.fixture
async def trail(tmp_path: Path) -> Path:
    key = tmp_path / "sm2.key"
    key.write_text(KEY)
    cfg = AuditConfig(spool_dir=tmp_path / "spool", writer_id="gw-1", sm2_private_key_path=key, checkpoint_every=5)
    auditor = Auditor(cfg)
    await auditor.start()
    for i in range(20):
        await auditor.emit(AuditEvent(f"r{i}", "chat.completions", status_code=200, user_id=f"u{i % 3}").to_dict())
    await auditor.stop()
    return tmp_path / "spool" / "seg-000000000001.jsonl"


def load(seg: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in seg.read_bytes().splitlines()]


def save(seg: Path, records: list[dict[str, Any]]) -> None:
    seg.write_bytes(b"".join(canonical_json(r) + b"\n" for r in records))


def index_of(records: list[dict[str, Any]], event_id: str) -> int:
    return next(i for i, r in enumerate(records) if r["event"]["id"] == event_id)


async def check(seg: Path, keys: tuple[str, ...] = (PUB,)) -> VerifyReport:
    return await verify(SpoolSource(seg.parent), public_keys=keys)


async def test_intact_trail_verifies_with_signatures(trail: Path) -> None:
    report = await check(trail)
    assert report.ok and report.signatures_checked
    (w,) = report.writers
    assert (w.writer, w.first_seq, w.events, w.checkpoints, w.unsigned_tail) == ("gw-1", 0, 24, 4, 0)
    assert format_report(report).startswith("OK: 24 records")


async def test_edited_field_is_named(trail: Path) -> None:
    records = load(trail)
    i = index_of(records, "r7")
    records[i]["user"]["id"] = "someone-else"
    save(trail, records)
    report = await check(trail)
    assert not report.ok and report.num_problems == 1
    bad = report.first_bad
    assert bad is not None
    assert (bad.writer, bad.seq, bad.event_id) == ("gw-1", records[i]["tianmen"]["chain"]["seq"], "r7")
    assert "hash mismatch" in bad.reason
    assert "first bad event: writer gw-1" in format_report(report)


async def test_deleted_event_is_found_at_the_next_one(trail: Path) -> None:
    records = load(trail)
    i = index_of(records, "r7")
    del records[i]
    save(trail, records)
    report = await check(trail)
    bad = report.first_bad
    assert bad is not None and bad.event_id == records[i]["event"]["id"]
    assert "missing" in bad.reason


async def test_reordered_events_are_found(trail: Path) -> None:
    records = load(trail)
    i = index_of(records, "r7")
    records[i], records[i + 1] = records[i + 1], records[i]
    save(trail, records)
    report = await check(trail)
    assert report.num_problems == 2
    bad = report.first_bad
    assert bad is not None and bad.event_id == "r8"


def rechain_from(records: list[dict[str, Any]], start: int) -> None:
    """What a forger without the key can do: recompute every hash after an edit."""
    prev = records[start - 1]["tianmen"]["chain"]["hash"]
    for r in records[start:]:
        r["tianmen"]["chain"]["prev"] = prev
        if r["event"]["action"] == CHECKPOINT_ACTION:
            r["tianmen"]["checkpoint"]["hash"] = prev
        r["tianmen"]["chain"]["hash"] = prev = event_hash(r)


async def test_rehashed_edit_is_caught_by_the_next_checkpoint(trail: Path) -> None:
    records = load(trail)
    i = index_of(records, "r7")
    records[i]["user"]["id"] = "someone-else"
    rechain_from(records, i)
    save(trail, records)
    report = await check(trail)
    bad = report.first_bad
    assert bad is not None and str(bad.event_id).startswith("checkpoint-gw-1-")
    assert bad.seq is not None and bad.seq > records[i]["tianmen"]["chain"]["seq"]
    assert "signature is invalid" in bad.reason
    # without the public key the forgery would pass: say so
    unsigned = await check(trail, keys=())
    assert unsigned.ok and not unsigned.signatures_checked
    assert "not checked" in format_report(unsigned)


async def test_checkpoint_forged_with_another_key_is_caught(trail: Path) -> None:
    records = load(trail)
    i = next(i for i, r in enumerate(records) if r["event"]["action"] == CHECKPOINT_ACTION)
    forger = Sm2Signer(OTHER_KEY)
    cp = records[i]["tianmen"]["checkpoint"]
    cp["key_id"] = forger.key_id
    cp["signature"] = forger.sign(json.dumps({"hash": cp["hash"], "seq": cp["seq"], "writer": "gw-1"}).encode())
    records[i]["tianmen"]["chain"]["hash"] = event_hash(records[i])
    rechain_from(records, i + 1)
    save(trail, records)
    report = await check(trail)
    bad = report.first_bad
    assert bad is not None and bad.event_id == records[i]["event"]["id"] and "unknown key id" in bad.reason


def test_document_id_must_match_event_id() -> None:
    from audit.chain import Chain

    chain = Chain("gw-1")
    a, b = (chain.link(AuditEvent(f"r{i}", "chat", status_code=200).to_dict()) for i in range(2))
    v = ChainVerifier()
    v.feed("r1", a)  # the documents' bodies were swapped
    v.feed("r0", b)
    report = v.report()
    assert report.num_problems == 2
    assert report.first_bad is not None and "swapped" in report.first_bad.reason


def test_record_without_chain_fields_is_a_problem() -> None:
    v = ChainVerifier()
    v.feed("x", {"event": {"id": "x"}})
    v.feed(None, {"_unparseable": "seg-000000000001.jsonl:3"})
    report = v.report()
    assert [p.reason for p in report.problems] == ["no chain fields", "unparseable record at seg-000000000001.jsonl:3"]


def linked(writer: str, *events: tuple[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """(Elasticsearch _id the shipper gives it, record) for each (event id, phase)."""
    from audit.chain import Chain

    chain = Chain(writer)
    out = []
    for rid, phase in events:
        record = chain.link(AuditEvent(rid, "chat-completion", status_code=200, phase=phase).to_dict())
        out.append((f"{rid}~open" if phase == "open" else rid, record))
    return out


def test_an_open_record_without_its_close_is_interrupted_not_tampering() -> None:
    v = ChainVerifier()
    for doc_id, record in linked("gw-1", ("a", "open"), ("b", "open"), ("a", "close"), ("c", "complete")):
        v.feed(doc_id, record)
    report = v.report()
    assert report.ok and [(n.event_id, n.seq) for n in report.interrupted] == [("b", 1)]
    text = format_report(report)
    assert text.startswith("OK") and "1 interrupted request(s) (not tampering" in text and "event b" in text


def test_a_close_by_another_writer_may_come_before_its_open() -> None:
    # Elasticsearch sorts by writer: a restart under a new writer id closes an old writer's open record
    v = ChainVerifier()
    for doc_id, record in [
        *linked("gw-2", ("a", "interrupted"), ("b", "close")),
        *linked("gw-1", ("a", "open"), ("b", "open")),
    ]:
        v.feed(doc_id, record)
    report = v.report()
    assert report.ok and [n.event_id for n in report.interrupted] == ["a"]
    assert "closed as interrupted" in report.interrupted[0].reason


def test_an_opening_record_under_the_plain_event_id_is_a_swap() -> None:
    v = ChainVerifier()
    ((_, record),) = linked("gw-1", ("a", "open"))
    v.feed("a", record)  # the opening record is `a~open`; `a` is its closing record's
    assert not v.report().ok and "does not match event.id" in str(v.report().first_bad)
