"""The one object the gateway holds: spool + chain + writer thread + optional Elasticsearch shipper."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, Protocol

from elasticsearch import AsyncElasticsearch

from audit.chain import Chain
from audit.config import AuditConfig, default_writer_id
from audit.errors import AuditUnavailable
from audit.events import content_fields, format_timestamp
from audit.recovery import interrupted_record, unclosed_streams
from audit.shipper import Shipper
from audit.signer import Sm2Signer
from audit.spool import Spool
from audit.writer import SpoolWriter

log = logging.getLogger("tianmen.audit")


class AuditSink(Protocol):
    def check_writable(self) -> None: ...

    async def emit(self, event: Mapping[str, Any]) -> None: ...


class Auditor:
    """`check_writable()` before serving a request, `await emit(event)` before its first byte.

    Both raise `AuditUnavailable` when the event cannot be made durable (answer 503). `emit`
    returns once the chained event is fsynced in the local spool (group commit); shipping follows in
    the background. At start, streams the last run left open get an `interrupted` closing record."""

    def __init__(
        self,
        config: AuditConfig,
        *,
        es_client: AsyncElasticsearch | None = None,
        fsync: Callable[[int], None] = os.fsync,
    ) -> None:
        self.config = config
        self._es_client, self._fsync = es_client, fsync
        self._spool: Spool | None = None
        self._writer: SpoolWriter | None = None
        self._shipper: Shipper | None = None
        self._chain: Chain | None = None
        self._running = False

    async def start(self) -> None:
        cfg = self.config
        shipping = bool(cfg.elasticsearch_url or self._es_client)
        spool = await asyncio.to_thread(
            Spool,
            cfg.spool_dir,
            max_bytes=cfg.max_spool_bytes,
            segment_bytes=cfg.segment_bytes,
            shipping=shipping,
            retention_s=cfg.retention_days * 86400.0,
            fsync=self._fsync,
        )
        try:
            stored = spool.load_writer()
            writer_id = cfg.writer_id or stored or default_writer_id()
            if writer_id != stored:
                spool.store_writer(writer_id)
            signer = Sm2Signer.from_file(cfg.sm2_private_key_path) if cfg.sm2_private_key_path else None
        except BaseException:
            spool.close()
            raise
        self._chain = Chain.resume(writer_id, spool.last_record)
        try:
            unclosed = await asyncio.to_thread(unclosed_streams, cfg.spool_dir, cfg.recover_scan_bytes)
        except OSError as e:
            log.warning("cannot scan the audit spool for interrupted streams: %s", e)
            unclosed = []
        if signer is None:
            log.warning("no SM2 key configured: the audit chain gets no signed checkpoints")
        self._shipper = Shipper(cfg, spool, self._es_client) if shipping else None
        self._writer = SpoolWriter(
            spool,
            self._chain,
            signer=signer,
            fsync_interval_s=cfg.fsync_interval_ms / 1000,
            checkpoint_every=cfg.checkpoint_every,
            checkpoint_interval_s=cfg.checkpoint_interval_s,
            max_pending=cfg.max_pending_events,
            on_durable=self._shipper.notify if self._shipper else None,
        )
        self._spool = spool
        self._writer.start(asyncio.get_running_loop())
        if self._shipper is not None:
            await self._shipper.start()
        self._running = True
        log.info("audit trail: writer %s at seq %d, spool %s", writer_id, self._chain.last_seq, cfg.spool_dir)
        if unclosed:
            log.warning("closing %d stream(s) the previous run left open as interrupted", len(unclosed))
            await asyncio.gather(*(self._writer.submit(interrupted_record(r)) for r in unclosed))

    async def stop(self) -> None:
        """Write and sign what is queued, ship what the drain timeout allows, release the spool."""
        if not self._running:
            return
        self._running = False
        assert self._writer is not None and self._spool is not None
        await asyncio.to_thread(self._writer.stop)
        if self._shipper is not None:
            await self._shipper.stop()
        self._spool.close()

    def check_writable(self) -> None:
        if not self._running or self._writer is None or self._spool is None:
            raise AuditUnavailable("the audit trail is not running")
        if not self._writer.alive:
            raise AuditUnavailable("the audit spool writer has stopped")
        self._spool.check_writable()

    async def emit(self, event: Mapping[str, Any]) -> None:
        """Chain and spool one event (an `AuditEvent.to_dict()`); returns once it is durable."""
        if not isinstance((event.get("event") or {}).get("id"), str) or not event["event"]["id"]:
            raise ValueError("an audit event needs event.id (the request id)")
        if "@timestamp" not in event:
            event = {**event, "@timestamp": format_timestamp(datetime.now(timezone.utc))}
        self.check_writable()
        assert self._writer is not None
        await self._writer.submit(event)

    def content_fields(self, prompt: str | bytes | None, response: str | bytes | None) -> dict[str, Any]:
        """`AuditEvent.content` under the configured policy."""
        return content_fields(self.config.content_policy, prompt, response)

    @property
    def writer_id(self) -> str | None:
        return self._chain.writer if self._chain else None

    def stats(self) -> dict[str, Any]:
        """Gauges for metrics: spool bytes, unshipped events, last ship time, failures."""
        out: dict[str, Any] = {"running": self._running, "writer": self.writer_id, "elasticsearch": False}
        out |= {"unshipped_events": 0, "shipped_events": 0, "last_ship_time": None, "ship_failures": 0}
        out |= {"ship_rejected": 0, "quarantine_bytes": 0, "ship_error": None, "ilm": None}
        if self._spool is not None:
            out |= self._spool.stats()
        if self._writer is not None:
            out |= {
                "queued_events": self._writer.pending,
                "chain_seq": self._writer.chain.last_seq,
                "write_failures": self._writer.write_failures,
                "refused_events": self._writer.rejected,
            }
        if self._shipper is not None:
            out |= self._shipper.stats()
            out["elasticsearch"] = True
        return out
