"""`tianmen audit search`: filters → events (from Elasticsearch or the spool) → a table."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from audit.events import CHECKPOINT_ACTION

if TYPE_CHECKING:
    from audit.source import AuditSource

_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


@dataclass(frozen=True, slots=True)
class SearchQuery:
    user: str | None = None
    tenant: str | None = None
    outcome: str | None = None
    model: str | None = None
    since: datetime | None = None
    limit: int = 100

    def terms(self) -> dict[str, str]:
        """Dotted field → required value."""
        pairs = {
            "user.id": self.user,
            "organization.id": self.tenant,
            "event.outcome": self.outcome,
            "tianmen.model": self.model,
        }
        return {k: v for k, v in pairs.items() if v is not None}

    def matches(self, event: Mapping[str, Any]) -> bool:
        if _get(event, "event.action") == CHECKPOINT_ACTION or _get(event, "tianmen.phase") == "open":
            return False  # one event per request: a stream's closing (or interrupted) record stands for it
        if any(_get(event, field) != value for field, value in self.terms().items()):
            return False
        return self.since is None or _timestamp(event) >= self.since


async def search(
    source: AuditSource,
    *,
    user: str | None = None,
    tenant: str | None = None,
    outcome: str | None = None,
    model: str | None = None,
    since: str | datetime | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Newest first, at most `limit`; `since` is "30m", "1h", "7d", "2w" or an ISO time. No checkpoints,
    no opening records of streams (their closing record has everything)."""
    assert limit >= 1
    start = parse_since(since) if isinstance(since, str) else since
    query = SearchQuery(user=user, tenant=tenant, outcome=outcome, model=model, since=start, limit=limit)
    return await source.search(query)


def parse_since(text: str, now: datetime | None = None) -> datetime:
    m = re.fullmatch(r"\s*(\d+)\s*([smhdw])\s*", text)
    if m:
        return (now or datetime.now(timezone.utc)) - timedelta(**{_UNITS[m[2]]: int(m[1])})
    try:
        ts = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since: {text!r} is neither a duration (30m, 1h, 7d) nor an ISO time") from None
    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)


_COLUMNS = [
    ("time", "@timestamp"),
    ("outcome", "event.outcome"),
    ("status", "http.response.status_code"),
    ("user", "user.id"),
    ("tenant", "organization.id"),
    ("model", "tianmen.model"),
    ("in", "tianmen.prompt_tokens"),
    ("out", "tianmen.completion_tokens"),
    ("ms", "event.duration"),
    ("error", "error.type"),
    ("id", "event.id"),
]


def format_table(events: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table for humans: one row per event, no content fields."""
    rows = [[name for name, _ in _COLUMNS]]
    for ev in events:
        row = []
        for name, field in _COLUMNS:
            value = _get(ev, field)
            if name == "ms" and isinstance(value, int):
                value = f"{value / 1e6:.0f}"
            row.append("-" if value is None else str(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + f"\n({len(events)} events)"


def _get(doc: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = doc
    for part in dotted.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def _timestamp(event: Mapping[str, Any]) -> datetime:
    try:
        return datetime.fromisoformat(str(event.get("@timestamp", "")).replace("Z", "+00:00"))
    except ValueError:
        return datetime.min.replace(tzinfo=timezone.utc)
