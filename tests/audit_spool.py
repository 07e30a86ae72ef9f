"""What a gateway's audit spool holds, read back by tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def spooled(spool: Path) -> list[dict[str, Any]]:
    """Every record in the spool directory's segments, in order."""
    return [json.loads(line) for p in sorted(spool.glob("seg-*.jsonl")) for line in p.read_text().splitlines()]
