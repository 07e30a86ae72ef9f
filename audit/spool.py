"""Append-only local spool: JSON-lines segment files, fsynced, bounded, with a committed ship position."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from audit.errors import AuditUnavailable

RETRY_AFTER_FAILURE_S = 1.0
_READ_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, order=True)
class Position:
    segment: int
    offset: int


class SpoolFull(AuditUnavailable):
    pass


class Spool:
    """Segments `seg-<n>.jsonl` in one directory, owned by one process (flock on `lock`).

    One writer thread calls `reserve`/`write`/`sync`/`rollback`; readers see only fsynced bytes.
    `shipped.json` holds the committed ship position; segments before it may be deleted when the
    size bound needs room (without shipping: segments older than the retention)."""

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        segment_bytes: int,
        shipping: bool,
        retention_s: float,
        fsync: Callable[[int], None] = os.fsync,
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes, self.segment_bytes = max_bytes, segment_bytes
        self.shipping, self.retention_s = shipping, retention_s
        self._fsync = fsync
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise AuditUnavailable(f"audit spool {self.directory} is in use by another process") from None
        self._sizes: dict[int, int] = {}
        self._closed_at: dict[int, float] = {}
        for path in sorted(self.directory.glob("seg-*.jsonl")):
            n = int(path.stem[4:])
            st = path.stat()
            self._sizes[n], self._closed_at[n] = st.st_size, st.st_mtime
        if not self._sizes:
            self._sizes[1] = 0
        self._active = max(self._sizes)
        self._closed_at.pop(self._active, None)
        self._last_record = self._recover_tail()
        self._fd = os.open(self._path(self._active), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._fsync_dir()
        self._durable = Position(self._active, self._sizes[self._active])
        self._committed = self._load_committed()
        self.durable_records = sum(1 for _ in self._lines(self._committed, self._durable, self._sizes))
        self.committed_records = 0
        self._reserved = 0
        self._refused_size = 0
        self._unsynced_records = 0
        self._dir_dirty = False
        self._failed_at: float | None = None
        self.last_error: str | None = None
        self._closed = False

    # writer thread

    def reserve(self, nbytes: int) -> None:
        """Claim room for `nbytes` of the next `write`, deleting shipped segments if needed."""
        with self._lock:
            need = self._total() + self._reserved + nbytes - self.max_bytes
        if need > 0:
            self._free(need)
            with self._lock:
                if self._total() + self._reserved + nbytes > self.max_bytes:
                    self._refused_size = nbytes
                    raise SpoolFull(f"audit spool {self.directory} is full ({self.max_bytes} bytes unshipped)")
        with self._lock:
            self._reserved += nbytes
            self._refused_size = 0

    def write(self, data: bytes, records: int) -> None:
        if self._sizes[self._active] and self._sizes[self._active] + len(data) > self.segment_bytes:
            self._roll()
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        with self._lock:
            self._sizes[self._active] += len(data)
            self._reserved = max(0, self._reserved - len(data))
        self._unsynced_records += records

    def sync(self) -> None:
        self._fsync(self._fd)
        if self._dir_dirty:
            self._fsync_dir()
            self._dir_dirty = False
        with self._lock:
            self._durable = Position(self._active, self._sizes[self._active])
            self.durable_records += self._unsynced_records
            self._failed_at, self.last_error = None, None
        self._unsynced_records = 0

    def rollback(self, error: BaseException) -> None:
        """After a failed write or fsync: drop everything since the last durable point."""
        with self._lock:
            self._failed_at, self.last_error = time.monotonic(), f"{type(error).__name__}: {error}"
            self._reserved, self._unsynced_records = 0, 0
            durable = self._durable
        with contextlib.suppress(OSError):
            os.close(self._fd)
        for n in [n for n in self._sizes if n > durable.segment]:
            with contextlib.suppress(OSError):
                self._path(n).unlink()
            with self._lock:
                del self._sizes[n]
        self._active = durable.segment
        self._fd = os.open(self._path(self._active), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.ftruncate(self._fd, durable.offset)
        with self._lock:
            self._closed_at.pop(self._active, None)
            self._sizes[self._active] = durable.offset

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The last record found at open (for resuming the chain)."""
        return self._last_record

    # any thread

    def check_writable(self) -> None:
        with self._lock:
            if self._closed:
                raise AuditUnavailable("audit spool is closed")
            if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER_FAILURE_S:
                raise AuditUnavailable(f"audit spool write failed: {self.last_error}")
            # full: the last event that did not fit would still not fit (what may be deleted is counted only when
            # the whole spool is past the limit: it takes a sorted walk of the segments)
            need = self._total() + max(1, self._refused_size)
            if need > self.max_bytes and need - self._deletable_bytes() > self.max_bytes:
                raise SpoolFull(f"audit spool {self.directory} is full ({self.max_bytes} bytes unshipped)")

    def read(self, pos: Position, max_records: int) -> tuple[list[bytes], Position]:
        """Up to `max_records` durable lines from `pos`, and the position after them."""
        with self._lock:
            end, sizes = self._durable, dict(self._sizes)
        lines: list[bytes] = []
        for line, after in self._lines(pos, end, sizes):
            lines.append(line)
            pos = after
            if len(lines) >= max_records:
                break
        else:
            pos = self._normalize(pos, end, sizes)
        return lines, pos

    def commit(self, pos: Position, records: int) -> None:
        """Persist the ship position (atomic rename); `records` lines were shipped since the last commit."""
        tmp = self.directory / "shipped.json.tmp"
        with open(tmp, "w") as f:
            json.dump({"segment": pos.segment, "offset": pos.offset}, f)
            f.flush()
            self._fsync(f.fileno())
        os.replace(tmp, self.directory / "shipped.json")
        self._fsync_dir()
        with self._lock:
            self._committed = pos
            self.committed_records += records

    @property
    def committed(self) -> Position:
        with self._lock:
            return self._committed

    @property
    def unshipped_records(self) -> int:
        with self._lock:
            return self.durable_records - self.committed_records

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "spool_bytes": self._total(),
                "spool_segments": len(self._sizes),
                "spool_error": self.last_error,
            }

    def load_writer(self) -> str | None:
        path = self.directory / "writer"
        if not path.exists():
            return None
        return path.read_text().strip() or None

    def store_writer(self, writer: str) -> None:
        path = self.directory / "writer"
        path.write_text(writer + "\n")
        with open(path) as f:
            self._fsync(f.fileno())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self._fd)
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)

    # internals

    def _path(self, n: int) -> Path:
        return self.directory / f"seg-{n:012d}.jsonl"

    def _total(self) -> int:
        return sum(self._sizes.values())

    def _deletable(self) -> list[int]:
        if self.shipping:
            return sorted(n for n in self._sizes if n < self._committed.segment and n != self._active)
        cutoff = time.time() - self.retention_s
        return sorted(n for n, t in self._closed_at.items() if t < cutoff and n != self._active)

    def _deletable_bytes(self) -> int:
        return sum(self._sizes[n] for n in self._deletable())

    def _free(self, need: int) -> None:
        with self._lock:
            victims = self._deletable()
        for n in victims:
            if need <= 0:
                break
            with contextlib.suppress(FileNotFoundError):
                self._path(n).unlink()
            with self._lock:
                need -= self._sizes.pop(n)
                self._closed_at.pop(n, None)
            self._dir_dirty = True

    def _roll(self) -> None:
        if self._unsynced_records:
            self._fsync(self._fd)
        os.close(self._fd)
        nxt = self._active + 1
        self._fd = os.open(self._path(nxt), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with self._lock:
            self._closed_at[self._active] = time.time()
            self._sizes[nxt] = 0
        self._active = nxt
        self._dir_dirty = True

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            self._fsync(fd)
        finally:
            os.close(fd)

    def _recover_tail(self) -> dict[str, Any] | None:
        """Cut a torn tail off the active segment (crash mid-write); return the last good record."""
        for n in sorted(self._sizes, reverse=True):
            path = self._path(n)
            data = path.read_bytes() if path.exists() else b""
            keep, last = data.rfind(b"\n") + 1, None
            while keep:
                start = data.rfind(b"\n", 0, keep - 1) + 1
                try:
                    last = json.loads(data[start:keep])
                    break
                except ValueError:
                    keep = start
            if n == self._active and keep != len(data):
                with open(path, "r+b") as f:
                    f.truncate(keep)
                    self._fsync(f.fileno())
                self._sizes[n] = keep
            if last is not None:
                return dict(last)
        return None

    def _load_committed(self) -> Position:
        first = min(self._sizes)
        try:
            raw = json.loads((self.directory / "shipped.json").read_text())
            pos = Position(int(raw["segment"]), int(raw["offset"]))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return Position(first, 0)
        if pos.segment < first:
            return Position(first, 0)
        if pos.segment not in self._sizes:
            return self._durable
        return Position(pos.segment, min(pos.offset, self._sizes[pos.segment]))

    @staticmethod
    def _normalize(pos: Position, end: Position, sizes: dict[int, int]) -> Position:
        # a fully read, closed segment: continue at the start of the next one
        while pos.segment < end.segment and pos.offset >= sizes.get(pos.segment, 0):
            pos = Position(min(n for n in sizes if n > pos.segment), 0)
        return pos

    def _lines(self, start: Position, end: Position, sizes: dict[int, int]) -> Iterator[tuple[bytes, Position]]:
        """Complete lines in [start, end), each with the position just after it."""
        pos = self._normalize(start, end, sizes)
        while pos <= end:
            limit = end.offset if pos.segment == end.segment else sizes.get(pos.segment, 0)
            try:
                with open(self._path(pos.segment), "rb") as f:
                    f.seek(pos.offset)
                    base, buf, remaining = pos.offset, b"", limit - pos.offset
                    while remaining > 0:
                        chunk = f.read(min(_READ_CHUNK, remaining))
                        if not chunk:
                            break
                        remaining -= len(chunk)
                        buf += chunk
                        i = 0
                        while (nl := buf.find(b"\n", i)) >= 0:
                            yield buf[i:nl], Position(pos.segment, base + nl + 1)
                            i = nl + 1
                        base, buf = base + i, buf[i:]
            except FileNotFoundError:  # deleted after shipping
                pass
            later = [n for n in sizes if n > pos.segment]
            if pos.segment >= end.segment or not later:
                return
            pos = Position(min(later), 0)
