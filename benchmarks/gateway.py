"""Gateway overhead: the full HTTPS + JWT path against calling the engine directly, max_tokens=1.

    python -m benchmarks.gateway [--requests 640] [--concurrency 32] [--model DIR | --tiny]

Starts `tianmen serve` in a subprocess (embedded default: dev TLS + dev JWT, the demo model unless --model)
and drives it from this process with 32 keep-alive HTTPS clients; the direct run uses AsyncEngine in-process.
Also reports the server's CPU per request during the timed run: its event loop (the main thread) and the
whole process (engine threads included), read from /proc (Linux). `--tiny` serves a 2-layer random model (the
tests' tiny chat model) so that engine time is negligible and what is left is the gateway's own cost. Then the
same clients drive `benchmarks.gateway_floor` (uvicorn + TLS 1.3 with a route that does nothing) on the same
CPUs: the HTTP layer's own cost on this machine at this moment, which the gateway's figure includes.

With `wrk` installed (a Debian package), both servers are then also driven to saturation from the client's
cores (benchmarks.wrk, `--saturate SECONDS`, 0 to skip): the requests a second the server's CPUs serve and its
CPU per request at that load, the figure capacity planning needs (Python clients cannot keep it busy).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import wrk
from engine import SamplingParams
from engine.step_thread import ENGINE_THREAD_NAME
from gateway.demo import dev_key_spec, ensure_demo_model
from gateway.server import build_engine
from gateway.settings import Settings, load_settings
from security.devpki import ensure_dev_pki, mint_token
from security.tls import client_ssl_context

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def loop_cpu_s(pid: int) -> float:
    """CPU seconds of the process's main thread, which runs uvicorn's event loop (ns resolution: schedstat)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


def _stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds from a /proc .../stat file (clock-tick resolution)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """Every thread of the process."""
    return _stat_cpu_s(Path(f"/proc/{pid}/stat"))


def threads_cpu_s(pid: int, prefix: str) -> float:
    """The process's threads whose OS name starts with `prefix` (the engine names its step threads, and the
    OpenMP workers they start inherit the name)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().startswith(prefix):
                total += _stat_cpu_s(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
    return total


def pin(cpus: str | None):  # type: ignore[no-untyped-def]
    """With --server-cpus the server and the load generator do not share cores (stabler CPU figures)."""
    if cpus is None:
        return None
    server = {int(c) for c in cpus.split(",")}
    client = set(os.sched_getaffinity(0)) - server
    if client:
        os.sched_setaffinity(0, client)
    return lambda: os.sched_setaffinity(0, server)


def pct(xs: list[float], p: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(p) - 1] if len(xs) > 1 else xs[0]


async def drive(n: int, concurrency: int, call) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    latencies: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for _ in counter:
            t = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0), latencies


async def direct(settings: Settings, n: int, concurrency: int) -> tuple[float, list[float]]:
    engine = build_engine(settings)  # the same model, sealed or not, the same engine settings as the server
    ids = engine.tokenizer.encode_chat(PROMPT)
    params = SamplingParams(max_tokens=1, temperature=0)
    seq = iter(range(10**9))

    async def call() -> None:
        async for _ in engine.generate(ids, params, f"d{next(seq)}"):
            pass

    await drive(concurrency, concurrency, call)  # warm-up
    try:
        return await drive(n, concurrency, call)
    finally:
        await engine.shutdown()


def chat_body(model: str) -> dict:
    return {"model": model, "messages": PROMPT, "max_tokens": 1, "temperature": 0}


def saturated(url: str, model: str, token: str, pid: int, args: argparse.Namespace) -> wrk.Saturated | None:
    if not args.saturate or not wrk.available():
        return None
    try:
        return wrk.saturate(
            url + "/v1/chat/completions",
            chat_body(model),
            {"Authorization": f"Bearer {token}"},
            lambda: loop_cpu_s(pid),
            lambda: process_cpu_s(pid),
            args.wrk_connections,
            args.saturate,
            lambda: threads_cpu_s(pid, ENGINE_THREAD_NAME),
        )
    except (subprocess.CalledProcessError, ValueError, AttributeError, KeyError) as e:  # the other rows still print
        print(f"wrk against {url} failed ({type(e).__name__}: {e}); no saturated row for it", file=sys.stderr)
        return None


async def through_gateway(
    url: str, token: str, ca: Path, model: str, n: int, concurrency: int, pid: int
) -> tuple[float, list[float], float, float]:
    """(req/s, latencies, then the server's event-loop and whole-process CPU seconds per request)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    body = chat_body(model)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(verify=client_ssl_context(ca), limits=limits, timeout=120) as client:

        async def call() -> None:
            r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text

        await drive(concurrency, concurrency, call)  # warm-up: TLS handshakes, connection pool
        loop0, proc0 = loop_cpu_s(pid), process_cpu_s(pid)
        rps, latencies = await drive(n, concurrency, call)
        return rps, latencies, (loop_cpu_s(pid) - loop0) / n, (process_cpu_s(pid) - proc0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=640)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--model", type=Path, help="model directory (default: the demo model)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model: (almost) no engine time")
    ap.add_argument("--server-cpus", help="pin the server to these CPUs (e.g. 0) and this client to the others")
    ap.add_argument("--port", type=int, default=18443)
    ap.add_argument("--saturate", type=int, default=15, help="seconds of wrk load on each server (0: skip)")
    ap.add_argument("--wrk-connections", type=int, default=64)
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="tianmen-bench-"))
    cpus = os.sched_getaffinity(0)
    env = {
        **os.environ,
        "TIANMEN_HOME": str(home),
        "TIANMEN_SERVER_PORT": str(args.port),
        "TIANMEN_ENGINE_MAX_NUM_SEQS": str(max(args.concurrency, args.wrk_connections)),
        "TIANMEN_SERVER_LOG_LEVEL": "warning",
        # the limiter still runs on every request; it must not be what bounds the rate measured
        "TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE": "1000000000",
        "TIANMEN_RATELIMIT_MAX_CONCURRENT": "1000000",  # a connection's next request may come before its lease ends
    }
    if args.tiny:
        from tests.tiny_model import build_tiny_chat_model

        args.model = build_tiny_chat_model(home / "tiny-chat")
    elif args.model is None:  # the demo model, sealed under the dev key of the usual home
        demo_home = Path(os.environ.get("TIANMEN_HOME", ".tianmen"))
        args.model = ensure_demo_model(demo_home)
        env.setdefault("TIANMEN_ENGINE_KEY_PROVIDER", dev_key_spec(demo_home))
    env["TIANMEN_ENGINE_MODEL"] = str(args.model)
    settings = load_settings(environ=env)
    pki = ensure_dev_pki(home)
    server = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve"], env=env, preexec_fn=pin(args.server_cpus))
    url = f"https://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/ready", verify=client_ssl_context(pki.ca_cert)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        token = mint_token(pki.jwt_key, pki.kid, sub="bench", tenant="bench")
        gw_rps, gw_lat, loop_cpu, proc_cpu = asyncio.run(
            through_gateway(url, token, pki.ca_cert, args.model.name, args.requests, args.concurrency, server.pid)
        )
        gw_sat = saturated(url, args.model.name, token, server.pid, args)
    finally:
        server.terminate()
        server.wait(30)
    floor, f_sat = measure_floor(args, pki.server_cert, pki.server_key, pki.ca_cert)
    # NOTE: --server-cpus moved this process to the client's cores; the engine's threads need all of them back
    # (two OpenMP threads on one core made the direct row ~20x slower)
    os.sched_setaffinity(0, cpus)
    d_rps, d_lat = asyncio.run(direct(settings, args.requests, args.concurrency))

    print(f"\n{args.requests} chat requests, max_tokens=1, {args.concurrency} concurrent, model {args.model.name}")
    print(f"{'path':<28} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for name, rps, lat in (("engine direct (in-process)", d_rps, d_lat), ("HTTPS + JWT gateway", gw_rps, gw_lat)):
        print(f"{name:<28} {rps:>8.1f} {pct(lat, 50) * 1e3:>8.1f} {pct(lat, 99) * 1e3:>8.1f}")
    print(
        f"{'added by the gateway':<28} {'':>8} {(pct(gw_lat, 50) - pct(d_lat, 50)) * 1e3:>8.1f} "
        f"{(pct(gw_lat, 99) - pct(d_lat, 99)) * 1e3:>8.1f}"
    )
    print(f"gateway CPU per request: event loop {loop_cpu * 1e3:.2f} ms, whole process {proc_cpu * 1e3:.2f} ms")
    f_rps, f_lat, f_loop, f_proc = floor
    print(
        f"HTTP layer floor (uvicorn + TLS, an empty route, the same clients): event loop {f_loop * 1e3:.2f} ms, "
        f"whole process {f_proc * 1e3:.2f} ms, {f_rps:.1f} req/s, p50 {pct(f_lat, 50) * 1e3:.1f} ms, "
        f"p99 {pct(f_lat, 99) * 1e3:.1f} ms"
    )
    print(f"the gateway's own work on its event loop: {(loop_cpu - f_loop) * 1e3:.2f} ms a request")
    if not args.saturate:
        return
    if gw_sat is None or f_sat is None:
        why = "see the error above" if wrk.available() else "wrk is not installed: apt-get install wrk"
        print(f"saturated: skipped ({why})")
        return
    print(f"saturated by wrk ({args.wrk_connections} keep-alive connections, {args.saturate} s, the client's cores):")
    print("  " + gw_sat.line("HTTPS + JWT gateway"))
    print("  " + f_sat.line("HTTP layer floor"))


def measure_floor(
    args: argparse.Namespace, cert: Path, key: Path, ca: Path
) -> tuple[tuple[float, list[float], float, float], wrk.Saturated | None]:
    """benchmarks.gateway_floor on the same CPUs, driven like the gateway (its certificate: the dev PKI's)."""
    port = args.port + 1
    cmd = [sys.executable, "-m", "benchmarks.gateway_floor", str(port), str(cert), str(key)]
    floor = subprocess.Popen(cmd, preexec_fn=pin(args.server_cpus))
    url = f"https://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(url + "/", verify=client_ssl_context(ca))
                break
            except httpx.TransportError:
                time.sleep(0.1)
        driven = asyncio.run(through_gateway(url, "unused", ca, "floor", args.requests, args.concurrency, floor.pid))
        return driven, saturated(url, "floor", "unused", floor.pid, args)
    finally:
        floor.terminate()
        floor.wait(30)


if __name__ == "__main__":
    main()
