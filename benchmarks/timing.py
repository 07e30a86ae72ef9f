"""Best-of-N wall-clock timing for the micro-benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(f: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` calls, after one warm-up call."""
    f()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best
