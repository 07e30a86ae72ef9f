"""The one thread that does all of an engine's CPU work: building the core (loading, packing and timing the
kernels) and then every step.

WHY one thread: libgomp (the OpenMP runtime of torch and of our kernels) keeps a pool of worker threads for each
thread that opens parallel regions. A core built on the caller's thread and stepped on another gives the process
two pools, more OpenMP threads than CPUs, and libgomp then stops spinning between regions: every GEMM of a step
began with a futex wake-up of its workers. Measured on a 2-core Zen 5, the demo model's shape at batch 1: 15-17 ms
a step built on one thread and stepped on another, 9.4-10.7 ms with both on the same thread.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"] | None


class StepThread:
    """A daemon thread that runs the callables it is given, one after another, until `finish()`."""

    def __init__(self, name: str = "tianmen-engine") -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            try:
                done.set_result(fn())
            except BaseException as e:  # the caller hears of it through the future
                done.set_exception(e)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the thread after what was submitted before it."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, done))
        return done

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread and wait for it: its result, or what it raised."""
        return self.submit(fn).result()

    def finish(self) -> None:
        """The thread ends once what was submitted has run."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
