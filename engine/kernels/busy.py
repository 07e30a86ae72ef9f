"""Whether other work competed with this process for the CPU while something was timed.

Timings taken while a neighbour runs say more about the neighbour than about the paths, and a cached choice
outlives the moment: on a 2-core Zen 4, a load generator started beside an engine made the MLA decode kernel
measure 4.7 ms against its 1.2 ms (its two OpenMP threads wait for each other whenever one is preempted), gather +
SDPA (2.9 ms) was chosen for 32-row decode steps and cached, and every later start of that model ran 2.3x slower
attention. The 1-minute load average had not moved. What does move at once is the time this process's own
threads spend runnable but not running (Linux schedstat's run-queue wait): it is read around each timed choice.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# Run-queue wait of our threads, summed, as a share of the wall time between two checks, above which the
# timings in between are not trusted. DeepSeek-V2-tiny's start on a 2-core Zen 4 measured 0.3-6% per choice when
# quiet, 76-118% beside two processes spinning on its cores.
WAIT_SHARE = 0.2


def load_busy() -> bool:
    """More runnable work than cores besides our own threads (1-minute load average)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    return load > (os.cpu_count() or 1) + 1


def run_queue_wait_ns(tasks: Path = Path("/proc/self/task")) -> int | None:
    """Nanoseconds this process's threads have spent waiting for a CPU while runnable (the second field of each
    thread's schedstat); None where the kernel does not report it."""
    total, seen = 0, False
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return None
    for t in threads:
        try:
            total += int((t / "schedstat").read_text().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile, or no schedstat
            continue
    return total if seen else None


class Contention:
    """Called after each timed choice: True when, since the previous call (or since it was made), this process's
    threads waited for a CPU more than WAIT_SHARE of the wall time, or the load average says the machine is
    oversubscribed. Where schedstat is missing only the load average counts."""

    def __init__(
        self,
        read: Callable[[], int | None] = run_queue_wait_ns,
        clock: Callable[[], float] = time.monotonic,
        load: Callable[[], bool] = load_busy,
    ) -> None:
        self._read, self._clock, self._load = read, clock, load
        self._since = (clock(), read())

    def __call__(self) -> bool:
        now, wait = self._clock(), self._read()
        then, before = self._since
        self._since = (now, wait)
        if wait is not None and before is not None and now > then:
            share = (wait - before) / 1e9 / (now - then)
            if share > WAIT_SHARE:
                log.debug("run-queue wait %.0f%% of the last %.2f s", share * 100, now - then)
                return True
        return self._load()
