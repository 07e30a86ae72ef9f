"""Events Elasticsearch refuses for good: kept in a bounded local file, and a stub shipped in their place.

The stub carries the event's chain fields (writer, seq, prev, hash), so `audit verify` on Elasticsearch
sees no gap: it reports the event as quarantined, and the original (in the spool, and here) still hashes
to the stub's `hash`. Only a 400 (mapping, immense term, parse error) or 413 (too large) is permanent."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from audit.bounds import cut_utf8
from audit.chain import chain_fields
from audit.events import QUARANTINE_ACTION

PERMANENT_STATUSES = frozenset({400, 413})
FILE, OLD_FILE = "quarantine.jsonl", "quarantine.1.jsonl"


def quarantine_stub(doc: Mapping[str, Any], status: int, error: object) -> dict[str, Any]:
    """What goes to Elasticsearch instead of `doc`: its id, time and chain fields, and why."""
    kind = error.get("type") if isinstance(error, Mapping) else error
    stub: dict[str, Any] = {
        "event": {
            "id": (doc.get("event") or {}).get("id"),
            "kind": "event",
            "action": QUARANTINE_ACTION,
            "outcome": "unknown",
        },
        "tianmen": {"quarantine": {"status": status, "error": cut_utf8(str(kind), 256)[0]}},
    }
    if isinstance(phase := (doc.get("tianmen") or {}).get("phase"), str):
        stub["tianmen"]["phase"] = phase[:16]
    if isinstance(doc.get("@timestamp"), str):
        stub["@timestamp"] = doc["@timestamp"][:64]  # same dated index as the original
    if (chain := chain_fields(doc)) is not None:
        stub["tianmen"]["chain"] = {k: chain.get(k) for k in ("writer", "seq", "prev", "hash")}
    return stub


class Quarantine:
    """`quarantine.jsonl` in the spool directory, at most `max_bytes` with its one predecessor: past half
    of it, the file becomes `quarantine.1.jsonl` and the older one is dropped (the spool keeps the
    originals until they are shipped past). An entry over half the quota keeps only the chain fields."""

    def __init__(self, directory: Path, max_bytes: int, fsync: Callable[[int], None] = os.fsync) -> None:
        self.path, self.old_path = Path(directory) / FILE, Path(directory) / OLD_FILE
        self.max_bytes, self._fsync = max_bytes, fsync
        self.dropped_bytes = 0

    def store(self, entries: list[tuple[Mapping[str, Any], int, object]]) -> None:
        """(record, status, error) each; fsynced before it returns."""
        lines = [self._line(record, status, error) for record, status, error in entries]
        with contextlib.suppress(FileNotFoundError):
            if self.path.stat().st_size + sum(map(len, lines)) > self.max_bytes // 2:
                with contextlib.suppress(FileNotFoundError):
                    self.dropped_bytes += self.old_path.stat().st_size
                os.replace(self.path, self.old_path)
        with open(self.path, "ab") as f:
            f.write(b"".join(lines))
            f.flush()
            self._fsync(f.fileno())

    def size(self) -> int:
        total = 0
        for p in (self.path, self.old_path):
            with contextlib.suppress(FileNotFoundError):
                total += p.stat().st_size
        return total

    def _line(self, record: Mapping[str, Any], status: int, error: object) -> bytes:
        # NOTE: the error's reason may quote field values (content); it goes to this file, never to a log
        entry: dict[str, Any] = {"status": status, "error": error, "record": record}
        line = json.dumps(entry, ensure_ascii=False).encode() + b"\n"
        if len(line) > self.max_bytes // 2:
            entry = {"status": status, "error": quarantine_stub(record, status, error)["tianmen"]["quarantine"]}
            entry |= {"record_bytes": len(line), "chain": chain_fields(record)}
            line = json.dumps(entry, ensure_ascii=False).encode() + b"\n"
        return line
