"""At start: find the streams the previous run opened and never closed (it was killed mid-response)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_PHASE = b'"phase":"'  # canonical JSON: no spaces, so a cheap byte test skips every other record


def unclosed_streams(directory: Path, scan_bytes: int) -> list[dict[str, Any]]:
    """The open records in the newest segments (about `scan_bytes` of them, at least the last one)
    that have no close or interrupted record after them, oldest first. Older ones stay for
    `audit verify` to report as interrupted."""
    segments = sorted(Path(directory).glob("seg-*.jsonl"), reverse=True)
    chosen: list[Path] = []
    total = 0
    for path in segments:
        if chosen and total >= scan_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    opened: dict[str, dict[str, Any]] = {}
    for path in reversed(chosen):
        data = path.read_bytes()
        for line in data.split(b"\n")[:-1]:  # the last piece is empty or a torn line
            if _PHASE + b"open" not in line and _PHASE + b"close" not in line and _PHASE + b"interrupted" not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            event_id = (record.get("event") or {}).get("id")
            phase = (record.get("tianmen") or {}).get("phase")
            if not isinstance(event_id, str):
                continue
            if phase == "open":
                opened[event_id] = record
            elif phase in ("close", "interrupted"):
                opened.pop(event_id, None)
    return list(opened.values())


def interrupted_record(opening: dict[str, Any]) -> dict[str, Any]:
    """The closing record for an open one: its fields, outcome unknown, `error.type: interrupted`."""
    record = {k: v for k, v in opening.items() if k != "tianmen"}
    tianmen = {k: v for k, v in (opening.get("tianmen") or {}).items() if k != "chain"}
    record["tianmen"] = tianmen | {"phase": "interrupted", "finish_reason": "interrupted"}
    record["event"] = {**(opening.get("event") or {}), "outcome": "unknown"}
    record["error"] = {"type": "interrupted"}
    return record
