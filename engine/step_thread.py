"""The one thread that does engines' CPU work: building each core (loading, packing and timing the kernels) and
then every step of every engine attached to it, in turns.

WHY one thread: libgomp (the OpenMP runtime of torch and of our kernels) keeps a pool of worker threads for each
thread that opens parallel regions. A core built on the caller's thread and stepped on another gives the process
two pools, more OpenMP threads than CPUs, and libgomp then stops spinning between regions: every GEMM of a step
began with a futex wake-up of its workers. Measured on a 2-core Zen 5, the demo model's shape at batch 1: 15-17 ms
a step built on one thread and stepped on another, 9.4-10.7 ms with both on the same thread. Several models
served on the CPU by one gateway share one such thread for the same reason (two engines in one process, one busy,
the other idle: 17-21 ms a step with a thread each, 12.2-13.8 sharing one); their steps take turns, which on
shared cores is what they would do anyway, each with all of the cores.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

ENGINE_THREAD_NAME = "tianmen-engine"  # in the OS too (name_os_thread); data-parallel replicas add "-<i>"

_Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"] | None


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS too (Linux: up to 15 bytes), so `top -H`, `ps -L` and /proc tell
    the engine's CPU apart from the gateway's (Python 3.11 names only its own Thread objects)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # no libc symbol to call: the name is only cosmetic
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME


class Stepper(Protocol):
    """An engine's step loop, a turn at a time (engine.async_engine.AsyncEngine)."""

    def turn(self) -> bool:
        """One pass: take in what arrived, run a step if there is work. True when it ran one."""
        ...

    @property
    def done(self) -> bool:
        """It has ended: the thread forgets it."""
        ...


class StepThread:
    """A daemon thread that runs the callables it is given, one after another, and between them gives every
    attached Stepper a turn while any has work; it sleeps on `wake` when none has. It ends once `finish()` was
    called and every stepper is done."""

    def __init__(self, name: str = ENGINE_THREAD_NAME) -> None:
        self.wake = threading.Event()  # set by anyone who gave a job or a stepper something to do
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._steppers: list[Stepper] = []  # touched on the thread only
        self._finishing = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        name_os_thread(self._thread.name)
        while True:
            self._run_jobs()
            busy = False
            for s in list(self._steppers):
                try:
                    busy = s.turn() or busy
                except BaseException:  # a turn handles its own failures; this one could not: the others go on
                    log.exception("an engine's step loop failed outside its step; that engine no longer steps")
                    self._steppers.remove(s)
                    continue
                if s.done:
                    self._steppers.remove(s)
            if self._finishing and not self._steppers:
                return
            if not busy:
                self.wake.wait()
                self.wake.clear()

    def _run_jobs(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._finishing = True
                continue
            fn, done = job
            try:
                done.set_result(fn())
            except BaseException as e:  # the caller hears of it through the future
                done.set_exception(e)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the thread after what was submitted before it."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, done))
        self.wake.set()
        return done

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread and wait for it: its result, or what it raised."""
        return self.submit(fn).result()

    def attach(self, stepper: Stepper) -> None:
        """Give `stepper` turns from now until it is done."""
        self.submit(lambda: self._steppers.append(stepper))

    def finish(self) -> None:
        """The thread ends once its jobs have run and every attached stepper is done."""
        self._jobs.put(None)
        self.wake.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def ident(self) -> int | None:
        """The thread's id (its CPU clock: time.pthread_getcpuclockid)."""
        return self._thread.ident
