"""A server driven to saturation by `wrk` (C, keep-alive, TLS): the most requests a second it serves on its CPUs,
and its CPU per request there.

httpx clients in Python top out at a few hundred requests a second on one core, below what the gateway serves,
so a figure taken under them counts the server's idle wake-ups and half-empty engine steps as cost. wrk on
the other core keeps the server busy: its CPU per request is then what capacity planning needs. wrk is a
Debian package (`apt-get install wrk`); without it this part is skipped with a note.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Saturated:
    requests_per_s: float
    loop_ms: float  # the event loop's CPU per request
    process_ms: float  # every thread's
    busy: float  # the whole process's CPU over the run, in cores
    p50_ms: float
    p99_ms: float
    failed: int  # non-2xx answers and socket errors: must be 0 for the figures to mean anything
    engine_ms: float | None = None  # the engine's step thread's CPU per request, where it could be told apart

    def line(self, what: str) -> str:
        own = ""
        if self.engine_ms:  # the gateway's own: every thread but the engine's (scheduling, forward); none: the floor
            own = f"; without the engine's step thread ({self.engine_ms:.3f} ms) "
            own += f"{self.process_ms - self.engine_ms:.3f} ms"
        return (
            f"{what}: {self.requests_per_s:,.0f} req/s, event loop {self.loop_ms:.3f} ms and whole process "
            f"{self.process_ms:.3f} ms a request{own} ({self.busy:.2f} cores busy), p50 {self.p50_ms:.1f} ms, "
            f"p99 {self.p99_ms:.1f} ms" + (f", {self.failed} FAILED" if self.failed else "")
        )


def available() -> bool:
    return shutil.which("wrk") is not None


_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("failed %d\\n", e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def _script(path: Path, body: dict, headers: dict[str, str]) -> Path:
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(json.dumps(body))}"]
    for k, v in {"Content-Type": "application/json", **headers}.items():
        lines.append(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}")
    path.write_text("\n".join(lines) + _DONE)
    return path


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if m is None:
        raise ValueError(f"wrk latency {text!r}")
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]


def saturate(
    url: str,
    body: dict,
    headers: dict[str, str],
    loop_cpu_s: Callable[[], float],
    process_cpu_s: Callable[[], float],
    connections: int = 64,
    seconds: int = 15,
    engine_cpu_s: Callable[[], float] | None = None,
) -> Saturated:
    """wrk POSTs `body` to `url` on `connections` keep-alive connections for `seconds` (after 3 s of warm-up);
    the two clocks read the server's CPU seconds. wrk runs on this process's CPUs (see --server-cpus)."""
    with tempfile.TemporaryDirectory(prefix="tianmen-wrk-") as tmp:
        cmd = ["wrk", "-t1", f"-c{connections}", "-s", str(_script(Path(tmp) / "post.lua", body, headers)), "--latency"]
        subprocess.run([*cmd, "-d3s", url], capture_output=True, check=True)
        engine = engine_cpu_s or (lambda: 0.0)
        loop0, proc0, eng0, t0 = loop_cpu_s(), process_cpu_s(), engine(), time.perf_counter()
        out = subprocess.run([*cmd, f"-d{seconds}s", url], capture_output=True, text=True, check=True).stdout
        loop1, proc1, eng1, t1 = loop_cpu_s(), process_cpu_s(), engine(), time.perf_counter()
    done = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    failed = int(re.search(r"failed (\d+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    return Saturated(
        done / (t1 - t0),
        (loop1 - loop0) / done * 1e3,
        (proc1 - proc0) / done * 1e3,
        (proc1 - proc0) / (t1 - t0),
        _ms(lat["50"]),
        _ms(lat["99"]),
        failed + (int(non2xx.group(1)) if non2xx else 0),
        (eng1 - eng0) / done * 1e3 if engine_cpu_s is not None else None,
    )
