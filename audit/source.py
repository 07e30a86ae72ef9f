"""Where `search` and `verify` read the trail: Elasticsearch, or the local spool."""

from __future__ import annotations

import asyncio
import heapq
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from elasticsearch import AsyncElasticsearch
from elasticsearch.helpers import async_scan

from audit.config import AuditConfig
from audit.es import make_client
from audit.events import CHECKPOINT_ACTION
from audit.search import SearchQuery

# (document _id or None, record); a spool line that does not parse comes as {"_unparseable": where}
ChainRecord = tuple[str | None, dict[str, Any]]


class AuditSource(Protocol):
    async def search(self, query: SearchQuery) -> list[dict[str, Any]]: ...

    def chain_records(self) -> AsyncIterator[ChainRecord]:
        """Every record, each writer's in chain order (the spool: file order)."""
        ...

    async def close(self) -> None: ...


class SpoolSource:
    """Reads spool segments without taking the spool's lock, so it works next to a running gateway."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    async def search(self, query: SearchQuery) -> list[dict[str, Any]]:
        def scan() -> list[dict[str, Any]]:
            hits = (rec for path in _segments(self.directory) for rec in _segment_records(path) if query.matches(rec))
            return heapq.nlargest(query.limit, hits, key=lambda e: str(e.get("@timestamp", "")))

        return await asyncio.to_thread(scan)

    async def chain_records(self) -> AsyncIterator[ChainRecord]:
        for path in _segments(self.directory):
            for rec in await asyncio.to_thread(_segment_records, path):
                yield None, rec

    async def close(self) -> None:
        pass

    async def __aenter__(self) -> SpoolSource:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ElasticsearchSource:
    def __init__(self, client: AsyncElasticsearch, index_pattern: str, *, own_client: bool = False) -> None:
        self.client, self.index_pattern, self._own_client = client, index_pattern, own_client

    async def search(self, query: SearchQuery) -> list[dict[str, Any]]:
        filters: list[dict[str, Any]] = [{"term": {field: value}} for field, value in query.terms().items()]
        if query.since is not None:
            filters.append({"range": {"@timestamp": {"gte": query.since.isoformat()}}})
        resp = await self.client.search(
            index=self.index_pattern,
            query={
                "bool": {
                    "filter": filters,
                    "must_not": [{"term": {"event.action": CHECKPOINT_ACTION}}, {"term": {"tianmen.phase": "open"}}],
                }
            },
            sort=[{"@timestamp": {"order": "desc"}}],
            size=query.limit,
            ignore_unavailable=True,
            allow_no_indices=True,
        )
        return [hit["_source"] for hit in resp["hits"]["hits"]]

    async def chain_records(self) -> AsyncIterator[ChainRecord]:
        body = {
            "query": {"match_all": {}},
            "sort": [{"tianmen.chain.writer": "asc"}, {"tianmen.chain.seq": "asc"}],
        }
        async for hit in async_scan(
            self.client, index=self.index_pattern, query=body, preserve_order=True, size=1000, scroll="2m"
        ):
            yield hit["_id"], hit["_source"]

    async def close(self) -> None:
        if self._own_client:
            await self.client.close()

    async def __aenter__(self) -> ElasticsearchSource:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def open_source(config: AuditConfig, *, spool: bool = False) -> SpoolSource | ElasticsearchSource:
    """Elasticsearch when configured (unless `spool`), else the spool directory. Use `async with`."""
    if config.elasticsearch_url and not spool:
        return ElasticsearchSource(make_client(config), config.index_pattern, own_client=True)
    return SpoolSource(config.spool_dir)


def _segments(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("seg-*.jsonl"))


def _segment_records(path: Path) -> list[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # shipped and deleted meanwhile
        return []
    out: list[dict[str, Any]] = []
    for n, line in enumerate(data.split(b"\n")[:-1], 1):  # a line still being written has no newline yet
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        out.append(rec if isinstance(rec, dict) else {"_unparseable": f"{path.name}:{n}"})
    return out
