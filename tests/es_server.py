"""A real server speaking the Elasticsearch 8 REST API for tests: PyPI noida-db, started per test."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

NOIDA = Path(sys.executable).with_name("noida-db")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EsServer:
    """`noida-db start --only elasticsearch` on a free port; stop (SIGTERM), kill (SIGKILL), start again.

    The port and data directory stay the same across restarts, so clients reconnect to the same URL."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir, self.port = Path(data_dir), port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = self.data_dir.parent / f"noida-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> EsServer:
        assert self.proc is None, "already running"
        if not NOIDA.exists():
            raise RuntimeError(f"{NOIDA} is missing: pip install noida-db")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [str(NOIDA), "start", "--only", "elasticsearch", "--elasticsearch-port", str(self.port)]
        with open(self._log, "ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--data-dir", str(self.data_dir)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"noida-db exited at start: {self._log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url, timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"noida-db did not answer on {self.url} within {timeout}s")

    def stop(self) -> None:
        """SIGTERM: the server saves its data."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: like a crash; the server may lose its last ~1 s of writes."""
        self._signal(signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        self.start()

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # NOTE: `noida-db` is a Python wrapper around the server binary; the wrapper exits at once on a
        # signal while the binary may still answer for a moment as it saves its data. Down means the
        # port refuses connections.
        deadline = time.monotonic() + 10
        while self._answers() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._answers():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

    def _answers(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def __enter__(self) -> EsServer:
        return self.start() if self.proc is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()
