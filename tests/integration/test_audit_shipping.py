"""The audit trail against a real server speaking the Elasticsearch 8 API (noida-db)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from elasticsearch import AsyncElasticsearch

from audit.auditor import Auditor
from audit.config import AuditConfig
from audit.es import make_client
from audit.events import CHECKPOINT_ACTION, QUARANTINE_ACTION, AuditEvent
from audit.signer import public_key_of
from audit.source import ElasticsearchSource
from audit.template import TEMPLATE_NAME
from audit.verify import verify
from tests.es_server import EsServer

KEY = "3945208f7b2144b13f36e38ac6d39f95889393692860b51a42fb81ef4df7c5b8"
STATUSES = [200, 200, 401, 403, 429, 200, 413, 503, 499, 200]


@pytest.fixture
def es_server(tmp_path: Path) -> Iterator[EsServer]:
    with EsServer(tmp_path / "es") as server:
        yield server


@pytest.fixture
async def es(es_server: EsServer, tmp_path: Path) -> AsyncIterator[AsyncElasticsearch]:
    client = make_client(AuditConfig(spool_dir=tmp_path, elasticsearch_url=es_server.url))
    yield client
    await client.close()


def config(tmp_path: Path, url: str, **kw: Any) -> AuditConfig:
    key = tmp_path / "sm2.key"
    key.write_text(KEY)
    args: dict[str, Any] = {
        "spool_dir": tmp_path / "spool",
        "elasticsearch_url": url,
        "writer_id": "gw-1",
        "sm2_private_key_path": key,
        "checkpoint_every": 10,
        "ship_backoff_max_s": 0.2,
        "ship_commit_delay_s": 1.0,
        "ship_drain_timeout_s": 2.0,
    }
    return AuditConfig(**(args | kw))


def request_event(i: int, *, ts: datetime | None = None, user: str | None = None) -> dict[str, Any]:
    status = STATUSES[i % len(STATUSES)]
    return AuditEvent(
        request_id=f"req-{i:04d}",
        action="chat.completions",
        status_code=status,
        timestamp=ts,
        user_id=user or f"user-{i % 3}",
        tenant="acme",
        model="qwen2",
        error_type=None if status < 400 else f"e{status}",
        prompt_tokens=i,
    ).to_dict()


async def wait_until(pred: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


async def all_docs(es: AsyncElasticsearch) -> list[dict[str, Any]]:
    await es.indices.refresh(index="tianmen-audit-*")
    resp = await es.search(index="tianmen-audit-*", query={"match_all": {}}, size=10_000)
    return list(resp["hits"]["hits"])


def requests_only(hits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [h for h in hits if h["_source"]["event"]["action"] != CHECKPOINT_ACTION]


async def test_every_event_lands_once_with_its_id_in_a_dated_index(
    tmp_path: Path, es_server: EsServer, es: AsyncElasticsearch
) -> None:
    auditor = Auditor(config(tmp_path, es_server.url))
    await auditor.start()
    old = datetime.now(timezone.utc) - timedelta(days=3)
    events = [request_event(i, ts=old if i == 0 else None) for i in range(30)]
    await asyncio.gather(*(auditor.emit(e) for e in events))
    await wait_until(lambda: auditor.stats()["unshipped_events"] == 0, "shipping")
    stats = auditor.stats()
    await auditor.stop()

    hits = await all_docs(es)
    reqs = requests_only(hits)
    assert sorted(h["_id"] for h in reqs) == sorted(e["event"]["id"] for e in events)
    by_id = {h["_id"]: h for h in reqs}
    for e in events:
        src = by_id[e["event"]["id"]]["_source"]
        assert {k: v for k, v in src.items() if k != "tianmen"} == {k: v for k, v in e.items() if k != "tianmen"}
        assert src["tianmen"]["chain"]["writer"] == "gw-1"
    assert by_id["req-0000"]["_index"] == f"tianmen-audit-{old:%Y.%m.%d}"
    assert by_id["req-0001"]["_index"] == f"tianmen-audit-{datetime.now(timezone.utc):%Y.%m.%d}"
    assert len(hits) - len(reqs) == 3  # checkpoints after every 10 events
    assert stats["last_ship_time"] is not None and stats["ship_rejected"] == 0
    assert stats["ilm"] is False  # noida-db has no ILM: logged, and the template goes in without it

    template = (await es.indices.get_index_template(name=TEMPLATE_NAME))["index_templates"][0]["index_template"]
    assert template["index_patterns"] == ["tianmen-audit-*"]
    mapping = await es.indices.get_mapping(index=by_id["req-0001"]["_index"])
    props = next(iter(mapping.values()))["mappings"]["properties"]
    assert props["source"]["properties"]["ip"]["type"] == "ip"
    assert props["tianmen"]["properties"]["chain"]["properties"]["seq"]["type"] == "long"

    report = await verify(ElasticsearchSource(es, "tianmen-audit-*"), public_keys=[public_key_of(KEY)])
    assert report.ok, report.problems


async def test_resending_after_a_crash_before_the_commit_makes_no_duplicates(
    tmp_path: Path, es_server: EsServer, es: AsyncElasticsearch
) -> None:
    first = Auditor(config(tmp_path, es_server.url, ship_commit_delay_s=3600))
    await first.start()
    await asyncio.gather(*(first.emit(request_event(i)) for i in range(25)))
    await wait_until(lambda: first.stats()["unshipped_events"] == 0, "shipping")
    await first.stop()  # nothing committed: as if the gateway died right after the server acked
    assert not (tmp_path / "spool" / "shipped.json").exists()
    before = len(await all_docs(es))

    second = Auditor(config(tmp_path, es_server.url))
    await second.start()
    await wait_until(lambda: second.stats()["shipped_events"] >= 25, "re-shipping")
    await wait_until(lambda: second.stats()["unshipped_events"] == 0, "re-shipping")
    await wait_until((tmp_path / "spool" / "shipped.json").exists, "the ship position to be committed")
    stats = second.stats()
    await second.stop()
    hits = await all_docs(es)
    assert len(hits) == before
    assert len({h["_id"] for h in requests_only(hits)}) == 25
    assert stats["ship_rejected"] == 0
    assert json.loads((tmp_path / "spool" / "shipped.json").read_text())["offset"] > 0


async def test_server_killed_under_load_loses_nothing(
    tmp_path: Path, es_server: EsServer, es: AsyncElasticsearch
) -> None:
    # noida-db loses its last ~1 s of acknowledged writes on SIGKILL: the commit delay must exceed that
    auditor = Auditor(config(tmp_path, es_server.url, ship_batch_size=20, ship_commit_delay_s=2.0))
    await auditor.start()
    emitted: list[str] = []
    running = True

    async def load() -> None:
        i = 0
        while running:
            await asyncio.gather(*(auditor.emit(request_event(i + k)) for k in range(5)))
            emitted.extend(f"req-{i + k:04d}" for k in range(5))
            i += 5
            await asyncio.sleep(0.005)

    producer = asyncio.create_task(load())
    await wait_until(lambda: auditor.stats()["shipped_events"] >= 100, "shipping under load")
    es_server.kill()
    at_kill = len(emitted)
    await wait_until(lambda: auditor.stats()["ship_failures"] > 0, "the shipper to notice")
    await wait_until(lambda: len(emitted) > at_kill + 100, "emits while the server is down")
    assert auditor.stats()["unshipped_events"] > 0
    es_server.start()
    await asyncio.sleep(0.3)
    running = False
    await producer
    await wait_until(lambda: auditor.stats()["unshipped_events"] == 0, "catching up")
    await auditor.stop()

    hits = requests_only(await all_docs(es))
    ids = [h["_id"] for h in hits]
    assert len(ids) == len(set(ids)) == len(emitted)
    assert set(ids) == set(emitted)
    report = await verify(ElasticsearchSource(es, "tianmen-audit-*"), public_keys=[public_key_of(KEY)])
    assert report.ok, report.problems[:3]


async def test_spool_backlog_ships_after_a_gateway_restart(tmp_path: Path, es_server: EsServer) -> None:
    es_server.stop()  # Elasticsearch is down while the first gateway runs
    first = Auditor(config(tmp_path, es_server.url, ship_drain_timeout_s=0.2))
    await first.start()
    await asyncio.gather(*(first.emit(request_event(i)) for i in range(20)))
    await wait_until(lambda: first.stats()["ship_failures"] > 0, "a failed ship attempt")
    assert first.stats()["unshipped_events"] == 22  # 20 events + 2 checkpoints
    await first.stop()

    es_server.start()
    second = Auditor(config(tmp_path, es_server.url))
    await second.start()
    await wait_until(lambda: second.stats()["unshipped_events"] == 0, "the backlog to ship")
    await second.stop()
    client = make_client(AuditConfig(spool_dir=tmp_path, elasticsearch_url=es_server.url))
    try:
        hits = requests_only(await all_docs(client))
    finally:
        await client.close()
    assert sorted(h["_id"] for h in hits) == [f"req-{i:04d}" for i in range(20)]


async def test_a_reused_event_id_is_kept_not_dropped(
    tmp_path: Path, es_server: EsServer, es: AsyncElasticsearch
) -> None:
    auditor = Auditor(config(tmp_path, es_server.url))
    await auditor.start()
    await auditor.emit(request_event(7, user="alice"))
    await auditor.emit(request_event(7, user="mallory"))  # same request id, different event
    await wait_until(lambda: auditor.stats()["unshipped_events"] == 0, "shipping")
    await auditor.stop()
    hits = requests_only(await all_docs(es))
    assert sorted(h["_source"]["user"]["id"] for h in hits) == ["alice", "mallory"]
    assert sorted(h["_id"] for h in hits) == ["req-0007", "req-0007~gw-1~1"]
    report = await verify(ElasticsearchSource(es, "tianmen-audit-*"))
    assert report.ok, report.problems


async def test_a_document_the_server_refuses_is_quarantined_and_the_trail_still_verifies(
    tmp_path: Path, es_server: EsServer, es: AsyncElasticsearch
) -> None:
    auditor = Auditor(config(tmp_path, es_server.url))
    await auditor.start()
    await auditor.emit(request_event(1))
    await auditor.emit({**request_event(2), "user": "alice"})  # `user` is an object in the mapping: 400
    await auditor.emit(request_event(3))
    await wait_until(lambda: auditor.stats()["unshipped_events"] == 0, "shipping")
    assert auditor.stats()["ship_rejected"] == 1
    await auditor.stop()
    hits = {h["_id"]: h["_source"] for h in requests_only(await all_docs(es))}
    assert sorted(hits) == ["req-0001", "req-0002", "req-0003"]
    assert hits["req-0002"]["event"]["action"] == QUARANTINE_ACTION  # a stub with the chain fields
    (entry,) = (tmp_path / "spool" / "quarantine.jsonl").read_text().splitlines()
    assert json.loads(entry)["record"]["event"]["id"] == "req-0002" and json.loads(entry)["status"] == 400
    report = await verify(ElasticsearchSource(es, "tianmen-audit-*"))
    assert report.ok, report.problems  # no hole: verify knows the event is quarantined
    assert [q.event_id for q in report.quarantined] == ["req-0002"]
