"""Ships durable spool records to Elasticsearch: bulk create, `_id` = event id, backoff, resume."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import deque
from typing import Any

from elastic_transport import TransportError
from elasticsearch import ApiError, AsyncElasticsearch

from audit.chain import chain_fields
from audit.config import AuditConfig
from audit.es import index_name, install_index_setup, make_client
from audit.quarantine import PERMANENT_STATUSES, Quarantine, quarantine_stub
from audit.spool import Position, Spool

log = logging.getLogger("tianmen.audit")

BACKOFF_START_S = 0.25
IDLE_POLL_S = 1.0


class RetryBatch(Exception):
    pass


class Shipper:
    """Reads durable records from the spool and bulk-creates them in `<prefix>-YYYY.MM.DD`.

    A 409 means the event is already there (a retry), unless the stored document's chain hash
    differs (another event reused the id): then it goes in under `<id>~<writer>~<seq>`. The ship
    position is committed `ship_commit_delay_s` after the server acknowledged it; after a
    connection error everything since the last commit is sent again (409s are cheap), so a server
    that lost its last acknowledged writes in a crash gets them back."""

    def __init__(self, config: AuditConfig, spool: Spool, client: AsyncElasticsearch | None = None) -> None:
        self.config, self.spool = config, spool
        self.quarantine = Quarantine(spool.directory, config.quarantine_max_bytes)
        self._client, self._own_client = client, client is None
        self._read_pos = spool.committed
        self._acked: deque[tuple[float, Position, int]] = deque()
        self._acked_records = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._draining = False
        self._setup_done = False
        self.ilm: bool | None = None
        self.last_ship_time: float | None = None
        self.shipped = 0
        self.failures = 0
        self.rejected = 0
        self.last_error: str | None = None

    @property
    def client(self) -> AsyncElasticsearch:
        if self._client is None:
            self._client = make_client(self.config)
        return self._client

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="audit-shipper")

    def notify(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Ship what the spool holds (up to `ship_drain_timeout_s`), commit, close the client."""
        if self._task is not None:
            self._draining = True
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.config.ship_drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("audit shipper stopped with %d events still in the spool", self.lag)
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        await self._commit_due()
        if self._own_client and self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def lag(self) -> int:
        """Durable events the server has not acknowledged yet."""
        return max(0, self.spool.unshipped_records - self._acked_records)

    def stats(self) -> dict[str, Any]:
        return {
            "unshipped_events": self.lag,
            "shipped_events": self.shipped,
            "last_ship_time": self.last_ship_time,
            "ship_failures": self.failures,
            "ship_rejected": self.rejected,
            "quarantine_bytes": self.quarantine.size(),
            "ship_error": self.last_error,
            "ilm": self.ilm,
        }

    async def _run(self) -> None:
        backoff = BACKOFF_START_S
        while True:
            try:
                if not self._setup_done:
                    self.ilm = await install_index_setup(self.client, self.config, quiet=self.ilm is not None)
                    self._setup_done = True
                self._wake.clear()
                n = await self.ship_once()
                await self._commit_due()
                if self.last_error is not None:
                    log.info("audit shipping to Elasticsearch resumed")
                    self.last_error = None
                backoff = BACKOFF_START_S
                if n == 0:
                    if self._draining:
                        return
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self._idle_wait())
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.failures += 1
                if self.last_error is None:
                    log.warning("audit shipping failed (%s); events wait in the spool", _describe(e))
                self.last_error = _describe(e)
                if isinstance(e, (TransportError, ApiError)):
                    self._rewind()
                    if isinstance(e, TransportError):
                        self._setup_done = False  # a restarted server may have lost the template too
                elif not isinstance(e, RetryBatch):
                    log.exception("audit shipper bug; retrying")
                if self._draining:
                    log.warning("audit shipper stopped with %d events still in the spool", self.lag)
                    return
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, self.config.ship_backoff_max_s)

    async def ship_once(self) -> int:
        """Ship one batch from the read position; the number of records acknowledged.

        The batch is cut into bulk requests of at most `ship_batch_bytes`, and a request refused as too
        large (413) is halved; an event refused for good (400/413) is quarantined, never retried."""
        lines, end = await asyncio.to_thread(self.spool.read, self._read_pos, self.config.ship_batch_size)
        if not lines:
            self._read_pos = end
            return 0
        docs: list[tuple[dict[str, Any], int]] = []
        for line in lines:
            try:
                docs.append((_parse(line), len(line)))
            except ValueError as e:  # a damaged spool line: keep it aside, ship the rest
                self.rejected += 1
                raw = {"raw": line.decode("utf-8", "replace")}
                await asyncio.to_thread(self.quarantine.store, [(raw, 0, {"type": "unparseable", "reason": str(e)})])
        for chunk in _chunks(docs, self.config.ship_batch_bytes):
            await self._ship_chunk([doc for doc, _ in chunk])
        self._read_pos = end
        self._acked.append((time.monotonic(), end, len(lines)))
        self._acked_records += len(lines)
        self.shipped += len(lines)
        self.last_ship_time = time.time()
        return len(lines)

    async def _ship_chunk(self, docs: list[dict[str, Any]]) -> None:
        ops: list[dict[str, Any]] = []
        for doc in docs:
            ops += [{"create": {"_index": self._index(doc), "_id": _id(doc)}}, doc]
        try:
            resp = (await self.client.bulk(operations=ops)).body
        except ApiError as e:
            if e.meta.status != 413:
                raise
            if len(docs) == 1:
                await self._quarantine([(docs[0], 413, {"type": "request_too_large", "reason": "HTTP 413"})])
                return
            half = len(docs) // 2
            await self._ship_chunk(docs[:half])
            await self._ship_chunk(docs[half:])
            return
        if resp.get("errors"):
            await self._handle_item_errors(docs, ops, resp["items"])

    def _index(self, doc: dict[str, Any]) -> str:
        return index_name(self.config.index_prefix, str(doc.get("@timestamp", "")))

    async def _handle_item_errors(
        self, docs: list[dict[str, Any]], ops: list[dict[str, Any]], items: list[dict[str, Any]]
    ) -> None:
        conflicts: list[tuple[dict[str, Any], str, str]] = []
        refused: list[tuple[dict[str, Any], int, object]] = []
        for doc, action, item in zip(docs, ops[::2], items):
            result = item.get("create", {})
            status = result.get("status", 500)
            if status in (200, 201):
                continue
            if status == 409:
                conflicts.append((doc, action["create"]["_index"], action["create"]["_id"]))
            elif status in PERMANENT_STATUSES:
                refused.append((doc, status, result.get("error")))
            else:  # 429, 5xx, and 401/403/404 (the cluster's setup, not the event): try again later
                raise RetryBatch(f"bulk item {status}: {_error_type(result.get('error'))}")
        if conflicts:
            await self._resolve_conflicts(conflicts)
        if refused:
            await self._quarantine(refused)

    async def _quarantine(self, refused: list[tuple[dict[str, Any], int, object]]) -> None:
        """Keep the originals locally (fsynced), then index a stub under each one's id."""
        self.rejected += len(refused)
        await asyncio.to_thread(self.quarantine.store, refused)
        ops: list[dict[str, Any]] = []
        for doc, status, error in refused:
            # NOTE: only the error's type is logged: its reason may quote field values (content)
            log.error(
                "Elasticsearch refused audit event %s (HTTP %d, %s); quarantined in %s",
                _id(doc),
                status,
                _error_type(error),
                self.quarantine.path.name,
            )
            ops += [{"create": {"_index": self._index(doc), "_id": _id(doc)}}, quarantine_stub(doc, status, error)]
        resp = (await self.client.bulk(operations=ops)).body
        for item in resp.get("items", []) if resp.get("errors") else []:
            status = item.get("create", {}).get("status", 500)
            if status == 429 or status >= 500:
                raise RetryBatch(f"bulk item {status} for a quarantine stub")
            if status not in (200, 201, 409):
                log.error("Elasticsearch refused a quarantine stub too (HTTP %d): the trail shows a gap", status)

    async def _resolve_conflicts(self, conflicts: list[tuple[dict[str, Any], str, str]]) -> None:
        got = await self.client.mget(
            docs=[{"_index": index, "_id": id_} for _, index, id_ in conflicts],
            source_includes=["tianmen.chain.hash"],
        )
        retry: list[dict[str, Any]] = []
        for (doc, index, id_), found in zip(conflicts, got["docs"]):
            if not found.get("found"):
                raise RetryBatch(f"document {id_} conflicted but is not there")
            stored = (found.get("_source") or {}).get("tianmen", {}).get("chain", {}).get("hash")
            mine = (chain_fields(doc) or {}).get("hash")
            if stored != mine:
                log.error("audit event id %s is already used by another event; indexing it as %s", id_, _alt_id(doc))
                retry += [{"create": {"_index": index, "_id": _alt_id(doc)}}, doc]
        if retry:
            resp = await self.client.bulk(operations=retry)
            for item in resp["items"]:
                status = item.get("create", {}).get("status", 500)
                if status not in (200, 201, 409):
                    raise RetryBatch(f"bulk item {status} for a reused event id")

    def _rewind(self) -> None:
        self._read_pos = self.spool.committed
        self._acked.clear()
        self._acked_records = 0

    async def _commit_due(self) -> None:
        cutoff = time.monotonic() - self.config.ship_commit_delay_s
        pos, n = None, 0
        while self._acked and self._acked[0][0] <= cutoff:
            _, pos, count = self._acked.popleft()
            n += count
        if pos is not None:
            self._acked_records -= n
            await asyncio.to_thread(self.spool.commit, pos, n)

    def _idle_wait(self) -> float:
        if not self._acked:
            return IDLE_POLL_S
        due = self._acked[0][0] + self.config.ship_commit_delay_s - time.monotonic()
        return min(IDLE_POLL_S, max(0.01, due))


def _chunks(docs: list[tuple[dict[str, Any], int]], max_bytes: int) -> list[list[tuple[dict[str, Any], int]]]:
    """Consecutive runs of at most `max_bytes` (each document alone when it is larger)."""
    out: list[list[tuple[dict[str, Any], int]]] = []
    size = 0
    for doc, n in docs:
        if not out or size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append((doc, n))
        size += n
    return out


def _error_type(error: object) -> str:
    kind = error.get("type") if isinstance(error, dict) else error
    return str(kind)[:100]


def _parse(line: bytes) -> dict[str, Any]:
    doc = json.loads(line)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def _id(doc: dict[str, Any]) -> str:
    """The event id; a stream's open record is `<id>~open` (its close, later, takes the event id)."""
    event_id = (doc.get("event") or {}).get("id")
    if event_id:
        return f"{event_id}~open" if (doc.get("tianmen") or {}).get("phase") == "open" else str(event_id)
    chain = chain_fields(doc) or {}
    return f"{chain.get('writer')}-{chain.get('seq')}"


def _alt_id(doc: dict[str, Any]) -> str:
    chain = chain_fields(doc) or {}
    return f"{_id(doc)}~{chain.get('writer')}~{chain.get('seq')}"


def _describe(e: BaseException) -> str:
    if isinstance(e, ApiError):
        return f"HTTP {e.meta.status}: {e.message}"
    return f"{type(e).__name__}: {e}"
