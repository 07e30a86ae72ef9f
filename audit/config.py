from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

ContentPolicy = Literal["none", "sm3", "full"]


@dataclass(slots=True)
class AuditConfig:
    """Everything `audit` needs, read once by `gateway.settings`.

    Index naming: dated indices `{index_prefix}-YYYY.MM.DD` (UTC day of the event's `@timestamp`)
    under one index template; a re-shipped event always lands in the same index, so `_id` stays
    unique. Data streams would roll over and let a retry duplicate an event in a new backing index."""

    spool_dir: Path
    content_policy: ContentPolicy = "sm3"
    elasticsearch_url: str | None = None
    es_username: str | None = None
    es_password: str | None = field(default=None, repr=False)
    es_api_key: str | None = field(default=None, repr=False)
    es_ca_certs: Path | None = None
    es_node_class: str | None = None  # "aiohttp" | "httpxasync"; None: whichever is installed
    index_prefix: str = "tianmen-audit"
    retention_days: int = 180
    checkpoint_every: int = 1000
    checkpoint_interval_s: float = 60.0
    sm2_private_key_path: Path | None = None
    sm2_public_key_path: Path | None = None
    fsync_interval_ms: float = 50.0  # fsync when the queue runs dry, and at least this often under load
    max_spool_bytes: int = 1 << 30
    segment_bytes: int = 16 << 20
    writer_id: str | None = None  # None: the id stored in the spool, else "<hostname>-<pid>"
    max_pending_events: int = 100_000
    ship_batch_size: int = 500
    ship_batch_bytes: int = 8 << 20  # a bulk request's body; a larger batch is split (ES refuses > 100 MB)
    quarantine_max_bytes: int = 64 << 20  # events Elasticsearch refuses for good, kept beside the spool
    recover_scan_bytes: int = 64 << 20  # at start, the spool's tail searched for streams a crash left open
    ship_commit_delay_s: float = 5.0  # acked events are re-sent after a connection error within this window
    ship_backoff_max_s: float = 30.0
    ship_drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        self.spool_dir = Path(self.spool_dir)
        for name in ("es_ca_certs", "sm2_private_key_path", "sm2_public_key_path"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, Path(value))
        assert self.content_policy in get_args(ContentPolicy), f"content_policy: one of {get_args(ContentPolicy)}"
        assert not (self.es_api_key and (self.es_username or self.es_password)), "an API key or a password, not both"
        assert bool(self.es_username) == bool(self.es_password), "es_username and es_password go together"
        assert self.es_node_class in (None, "aiohttp", "httpxasync"), "es_node_class: aiohttp or httpxasync"
        assert self.index_prefix and self.index_prefix == self.index_prefix.lower(), "index_prefix: lowercase"
        assert self.retention_days >= 1 and self.checkpoint_every >= 1 and self.checkpoint_interval_s > 0
        assert self.fsync_interval_ms >= 0 and self.max_pending_events >= 1 and self.ship_batch_size >= 1
        assert self.ship_batch_bytes >= 1024 and self.quarantine_max_bytes >= 4096 and self.recover_scan_bytes >= 0
        assert 4096 <= self.segment_bytes <= self.max_spool_bytes, "segment_bytes: at least 4 KiB, at most the spool"
        assert self.writer_id is None or (self.writer_id and "\n" not in self.writer_id)

    @property
    def index_pattern(self) -> str:
        return f"{self.index_prefix}-*"


def default_writer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"
