"""The spool's writer thread: chains events, appends them, and group-commits with one fsync per batch."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from audit.chain import Chain
from audit.digest import canonical_json
from audit.errors import AuditUnavailable
from audit.signer import Sm2Signer
from audit.spool import Spool, SpoolFull

log = logging.getLogger("tianmen.audit")

MAX_BATCH = 4096
_STOP = object()
Item = tuple[Mapping[str, Any], "asyncio.Future[None]"]


class SpoolWriter:
    """`submit(event)` returns a future that resolves once the chained event is fsynced.

    The thread fsyncs as soon as its queue runs dry, and at least every `fsync_interval_s` while
    events keep coming, so a busy spool shares one fsync among many events (group commit).

    WHY a deque and one wake-up per event-loop pass: waking a sleeping thread costs the event loop a futex call
    and, on a busy core, a context switch and a GIL hand-off (~15-20 µs of the waker's CPU on a shared core,
    measured alone). The events of one pass (a step's finished requests all reach `on_response_start` together)
    share one wake-up; the writer reads the deque without locks."""

    def __init__(
        self,
        spool: Spool,
        chain: Chain,
        *,
        signer: Sm2Signer | None,
        fsync_interval_s: float,
        checkpoint_every: int,
        checkpoint_interval_s: float,
        max_pending: int,
        on_durable: Callable[[], None] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
    ) -> None:
        self.spool, self.chain, self.signer = spool, chain, signer
        self.fsync_interval_s = fsync_interval_s
        self.checkpoint_every, self.checkpoint_interval_s = checkpoint_every, checkpoint_interval_s
        self.on_durable, self.clock = on_durable, clock
        self.max_pending = max_pending
        self._inbox: collections.deque[Item | object] = collections.deque()  # append/popleft are atomic
        self._wake = threading.Event()
        self._kick_pending = False  # a wake-up is scheduled on the loop for this pass
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_checkpoint = time.monotonic()
        self.write_failures = 0
        self.rejected = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="audit-spool-writer", daemon=True)
        self._thread.start()

    def submit(self, event: Mapping[str, Any]) -> asyncio.Future[None]:
        """On the event loop given to `start`."""
        assert self._loop is not None, "SpoolWriter.start() first"
        if not self.alive:
            raise AuditUnavailable("the audit spool writer has stopped")
        if len(self._inbox) >= self.max_pending:
            raise AuditUnavailable("too many audit events waiting for the spool")
        fut: asyncio.Future[None] = self._loop.create_future()
        self._inbox.append((event, fut))
        if not self._kick_pending:
            self._kick_pending = True
            self._loop.call_soon(self._kick)
        return fut

    def _kick(self) -> None:
        self._kick_pending = False
        self._wake.set()

    def stop(self) -> None:
        """Blocking: write what is queued, sign the tail, fsync, join."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.append(_STOP)
            self._wake.set()
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> int:
        return len(self._inbox)

    # writer thread

    def _run(self) -> None:
        unsynced: list[asyncio.Future[None]] = []
        try:
            self._loop_forever(unsynced)
        except BaseException as e:  # a bug: fail everything rather than leave emitters waiting
            log.exception("audit spool writer crashed")
            while self._inbox:
                got = self._inbox.popleft()
                if got is not _STOP:
                    unsynced.append(got[1])  # type: ignore[index]
            self._settle(unsynced, AuditUnavailable(f"audit spool writer crashed: {e!r}"))

    def _loop_forever(self, unsynced: list[asyncio.Future[None]]) -> None:
        durable_state = self.chain.snapshot()
        dirty_since: float | None = None  # when the oldest unsynced line was written
        stopping = False
        while not stopping:
            items: list[Item] = []
            if not self._inbox:
                self._wake.wait(self.fsync_interval_s if dirty_since is not None else self._checkpoint_wait())
            self._wake.clear()  # before reading: an append after this point sets it again
            while self._inbox and len(items) < MAX_BATCH:
                got = self._inbox.popleft()
                if got is _STOP:
                    stopping = True
                    break
                items.append(got)  # type: ignore[arg-type]
            lines: list[bytes] = []
            for event, fut in items:
                line = self._link(event, fut)
                if line is not None:
                    lines.append(line)
                    unsynced.append(fut)
                if self.signer is not None and self.chain.unsigned >= self.checkpoint_every:
                    lines.extend(self._checkpoint())
            if self._time_for_checkpoint() or (stopping and self.signer is not None and self.chain.unsigned):
                lines.extend(self._checkpoint())
            try:
                if lines:
                    self.spool.write(b"".join(lines), len(lines))
                    dirty_since = time.monotonic() if dirty_since is None else dirty_since
                if dirty_since is not None and (
                    stopping or not self._inbox or time.monotonic() - dirty_since >= self.fsync_interval_s
                ):
                    self.spool.sync()
                    durable_state, dirty_since = self.chain.snapshot(), None
                    self._settle(unsynced, None)
                    unsynced.clear()
            except OSError as e:
                self.write_failures += 1
                log.error("audit spool write failed: %s; %d events refused", e, len(unsynced))
                self.spool.rollback(e)
                self.chain.restore(durable_state)
                self._settle(unsynced, AuditUnavailable(f"audit spool write failed: {e}"))
                unsynced.clear()
                dirty_since = None

    def _link(self, event: Mapping[str, Any], fut: asyncio.Future[None]) -> bytes | None:
        before = self.chain.snapshot()
        try:
            line = self.chain.link_encoded(event) + b"\n"
            self.spool.reserve(len(line))
            return line
        except SpoolFull as e:
            self.rejected += 1
            self.chain.restore(before)
            self._settle([fut], e)
        except (TypeError, ValueError) as e:  # not JSON-serializable: the caller's bug
            self.chain.restore(before)
            self._settle([fut], e)
        return None

    def _checkpoint(self) -> list[bytes]:
        assert self.signer is not None
        before = self.chain.snapshot()
        try:
            line = canonical_json(self.chain.checkpoint(self.signer, self.clock())) + b"\n"
            self.spool.reserve(len(line))
        except SpoolFull:
            self.chain.restore(before)
            return []
        except Exception:
            log.exception("cannot sign an audit checkpoint; trying again later")
            self.chain.restore(before)
            self._last_checkpoint = time.monotonic()
            return []
        self._last_checkpoint = time.monotonic()
        return [line]

    def _checkpoint_wait(self) -> float | None:
        if self.signer is None or not self.chain.unsigned:
            return None
        return max(0.0, self._last_checkpoint + self.checkpoint_interval_s - time.monotonic())

    def _time_for_checkpoint(self) -> bool:
        wait = self._checkpoint_wait()
        return wait is not None and wait <= 0

    def _settle(self, futs: list[asyncio.Future[None]], error: BaseException | None) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(_resolve, list(futs), error, self.on_durable if error is None else None)


def _resolve(
    futs: list[asyncio.Future[None]], error: BaseException | None, on_durable: Callable[[], None] | None
) -> None:
    for fut in futs:
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
    if on_durable is not None:
        on_durable()
