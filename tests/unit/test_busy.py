"""engine.kernels.busy: timings taken while other work competed for our CPU are recognised (and so not cached)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.kernels.busy import WAIT_SHARE, Contention, run_queue_wait_ns
from engine.kernels.select import PlanCache, ShapeChoice


class Fake:
    def __init__(self) -> None:
        self.now, self.wait = 100.0, 0

    def advance(self, seconds: float, waited: float) -> None:
        self.now += seconds
        self.wait += int(waited * 1e9)


def test_waiting_for_a_cpu_beyond_the_share_is_busy_and_each_window_stands_alone() -> None:
    f = Fake()
    busy = Contention(read=lambda: f.wait, clock=lambda: f.now, load=lambda: False)
    f.advance(1.0, WAIT_SHARE * 0.5)
    assert not busy()
    f.advance(0.5, 0.5 * WAIT_SHARE * 2)  # this window only: the quiet one before does not dilute it
    assert busy()
    f.advance(2.0, 0.0)
    assert not busy()


def test_without_schedstat_the_load_average_decides() -> None:
    assert Contention(read=lambda: None, load=lambda: True)()
    assert not Contention(read=lambda: None, load=lambda: False)()


def test_run_queue_wait_sums_every_thread_and_skips_what_it_cannot_read(tmp_path: Path) -> None:
    for tid, text in (("1", "500 1000 3\n"), ("2", "7 2500 1\n"), ("3", "garbage\n")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(text)
    (tmp_path / "4").mkdir()  # a thread that ended between listing and reading
    assert run_queue_wait_ns(tmp_path) == 3500
    assert run_queue_wait_ns(tmp_path / "missing") is None


def test_a_choice_timed_while_contended_is_used_but_not_cached(tmp_path: Path) -> None:
    f = Fake()
    cache = PlanCache(tmp_path, "k", Contention(read=lambda: f.wait, clock=lambda: f.now, load=lambda: False))
    f.advance(1.0, 0.9)
    cache.put("s", ShapeChoice(["ours"], {"ours": [1.0]}))
    assert cache.get("s") is not None  # this process goes on with it
    assert PlanCache(tmp_path, "k", lambda: False).get("s") is None  # the next start times it again


@pytest.mark.skipif(run_queue_wait_ns() is None, reason="this kernel reports no schedstat")
def test_a_neighbour_on_our_core_is_seen_at_once() -> None:
    """The real signal: this thread and another process spinning on one core; the load average cannot see it
    within the second (it is switched off here), the run-queue wait does."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    spin = (
        "import os, time\nos.sched_setaffinity(0, {%d})\nprint('spinning', flush=True)\n"
        "t = time.monotonic()\nwhile time.monotonic() - t < 10: pass"
    )
    with subprocess.Popen([sys.executable, "-c", spin % cpu], stdout=subprocess.PIPE, text=True) as child:
        try:
            os.sched_setaffinity(0, {cpu})
            assert child.stdout is not None and child.stdout.readline().strip() == "spinning"  # up, on our core
            busy = Contention(load=lambda: False)
            t = time.monotonic()
            while time.monotonic() - t < 0.6:
                pass
            assert busy()
        finally:
            os.sched_setaffinity(0, before)
            child.kill()
