"""A throwaway redis-server for tests and benchmarks: a free port, nothing on disk, killable and restartable.

with redis_url() as url: ...            # $TIANMEN_TEST_REDIS_URL if set, else a fresh server
with RedisServer() as server: server.kill(); server.restart()   # always our own process (outage tests)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from types import TracebackType

ENV_URL = "TIANMEN_TEST_REDIS_URL"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-2000:]
    except FileNotFoundError:
        return ""


def _ready(log: str) -> bool:
    return "Ready to accept connections" in _tail(log)


class RedisServer:
    """One redis-server subprocess (not daemonized, so it can be killed like a crash and restarted on its port)."""

    def __init__(self, binary: str | None = None) -> None:
        found = binary or shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(found):
            raise RuntimeError("redis-server not found: apt-get install -y redis-server, or set " + ENV_URL)
        self.binary = found
        self.port = _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="tianmen-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 5.0) -> None:
        assert self._proc is None, "already running"
        log = os.path.join(self._dir.name, "redis.log")
        with contextlib.suppress(FileNotFoundError):
            os.remove(log)  # a restart must not read the last run's "ready"
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", self._dir.name, "--daemonize", "no", "--loglevel", "notice", "--logfile", log]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        # NOTE: our own log says ready, not just any PONG: another server could hold the port
        while not (_ready(log) and _ping(self.port)):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start: {_tail(log)}")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL, like a crash: connections drop and every key is lost (nothing is saved)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()
        self._dir.cleanup()


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """A Redis URL for tests: $TIANMEN_TEST_REDIS_URL when set, else a server started here and stopped after."""
    if url := os.environ.get(ENV_URL):
        yield url
        return
    with RedisServer() as server:
        yield server.url
