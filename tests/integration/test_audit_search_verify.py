"""`search` and `verify` against Elasticsearch (noida-db) and against the spool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from elasticsearch import AsyncElasticsearch

from audit.auditor import Auditor
from audit.config import AuditConfig
from audit.es import make_client
from audit.events import AuditEvent
from audit.search import format_table, search
from audit.signer import public_key_of
from audit.source import AuditSource, ElasticsearchSource, SpoolSource
from audit.verify import verify
from tests.es_server import EsServer

KEY = "3945208f7b2144b13f36e38ac6d39f95889393692860b51a42fb81ef4df7c5b8"
NOW = datetime.now(timezone.utc)
# (id, user, tenant, status, model, age)
ROWS = [
    ("a1", "alice", "acme", 200, "qwen2", timedelta(minutes=5)),
    ("a2", "alice", "acme", 429, "qwen2", timedelta(minutes=20)),
    ("b1", "bob", "globex", 200, "llama3", timedelta(hours=2)),
    ("b2", "bob", "globex", 403, "qwen2", timedelta(hours=30)),
    ("c1", "carol", "globex", 500, "llama3", timedelta(days=3)),
    ("a3", "alice", "globex", 200, "llama3", timedelta(days=10)),
]


@pytest.fixture
async def trail(tmp_path: Path) -> AsyncIterator[tuple[AuditConfig, AsyncElasticsearch]]:
    with EsServer(tmp_path / "es") as server:
        key = tmp_path / "sm2.key"
        key.write_text(KEY)
        cfg = AuditConfig(
            spool_dir=tmp_path / "spool",
            elasticsearch_url=server.url,
            writer_id="gw-1",
            sm2_private_key_path=key,
            checkpoint_every=4,
        )
        auditor = Auditor(cfg)
        await auditor.start()
        for event_id, user, tenant, status, model, age in sorted(ROWS, key=lambda r: -r[5]):
            event = AuditEvent(
                request_id=event_id,
                action="chat.completions",
                status_code=status,
                timestamp=NOW - age,
                user_id=user,
                tenant=tenant,
                model=model,
            )
            await auditor.emit(event.to_dict())
        for _ in range(1000):
            if auditor.stats()["unshipped_events"] == 0:
                break
            await asyncio.sleep(0.02)
        assert auditor.stats()["unshipped_events"] == 0
        await auditor.stop()
        client = make_client(cfg)
        await client.indices.refresh(index=cfg.index_pattern)
        yield cfg, client
        await client.close()


def sources(cfg: AuditConfig, client: AsyncElasticsearch) -> dict[str, AuditSource]:
    return {"es": ElasticsearchSource(client, cfg.index_pattern), "spool": SpoolSource(cfg.spool_dir)}


@pytest.mark.parametrize("where", ["es", "spool"])
async def test_search_filters(trail: tuple[AuditConfig, AsyncElasticsearch], where: str) -> None:
    source = sources(*trail)[where]

    async def ids(**kw: Any) -> list[str]:
        return [e["event"]["id"] for e in await search(source, **kw)]

    assert await ids() == ["a1", "a2", "b1", "b2", "c1", "a3"]  # newest first, no checkpoints
    assert await ids(user="alice") == ["a1", "a2", "a3"]
    assert await ids(tenant="globex", outcome="failure") == ["b2", "c1"]
    assert await ids(model="llama3") == ["b1", "c1", "a3"]
    assert await ids(since="1h") == ["a1", "a2"]
    assert await ids(since="7d", outcome="success") == ["a1", "b1"]
    assert await ids(since=(NOW - timedelta(hours=3)).isoformat()) == ["a1", "a2", "b1"]
    assert await ids(limit=2) == ["a1", "a2"]
    assert await ids(user="nobody") == []
    table = format_table(await search(source, user="bob"))
    assert "b1" in table and "globex" in table and "(2 events)" in table


async def test_verify_from_elasticsearch_catches_edits_made_there(
    trail: tuple[AuditConfig, AsyncElasticsearch],
) -> None:
    cfg, es = trail
    source = ElasticsearchSource(es, cfg.index_pattern)
    keys = [public_key_of(KEY)]

    async def check() -> tuple[bool, Any]:
        await es.indices.refresh(index=cfg.index_pattern)
        report = await verify(source, public_keys=keys)
        return report.ok, report.first_bad

    assert await check() == (True, None)
    hits = (await es.search(index=cfg.index_pattern, query={"match_all": {}}, size=100))["hits"]["hits"]
    doc = {h["_id"]: h for h in hits}

    # an edit in place
    b1 = doc["b1"]
    await es.index(index=b1["_index"], id="b1", document={**b1["_source"], "user": {"id": "mallory"}})
    ok, bad = await check()
    assert not ok and (bad.event_id, bad.seq) == ("b1", b1["_source"]["tianmen"]["chain"]["seq"])
    assert "hash mismatch" in bad.reason
    await es.index(index=b1["_index"], id="b1", document=b1["_source"])
    assert (await check())[0]

    # a deletion: the next event in the chain names the gap
    await es.delete(index=b1["_index"], id="b1")
    ok, bad = await check()
    assert not ok and "missing" in bad.reason and bad.seq == b1["_source"]["tianmen"]["chain"]["seq"] + 1
    await es.index(index=b1["_index"], id="b1", document=b1["_source"])
    assert (await check())[0]

    # a swapped pair of documents
    a1, a2 = doc["a1"], doc["a2"]
    await es.index(index=a1["_index"], id="a1", document=a2["_source"])
    await es.index(index=a2["_index"], id="a2", document=a1["_source"])
    ok, bad = await check()
    assert not ok and "swapped" in bad.reason


async def test_verify_from_the_spool_passes(trail: tuple[AuditConfig, AsyncElasticsearch]) -> None:
    cfg, _ = trail
    report = await verify(SpoolSource(cfg.spool_dir), public_keys=[public_key_of(KEY)])
    assert report.ok and report.records == len(ROWS) + 2 and report.writers[0].unsigned_tail == 0
