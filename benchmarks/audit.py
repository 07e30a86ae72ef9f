"""Audit trail throughput: emit (chain + spool + fsync) and shipping to a server speaking the ES API.

    python -m benchmarks.audit [--events 20000] [--concurrency 1,64,512] [--dir PATH]

emit: events/s through `Auditor.emit` with N concurrent emitters (closed loop, saturating) and with
and without real fsyncs (group commit); "paced" runs emit at a fixed rate, as a gateway would, and
their p50/p99 is the latency one emit adds to a request. ship: a spool backlog bulk-indexed into
noida-db, events/s until the lag is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from audit.auditor import Auditor
from audit.config import AuditConfig
from audit.events import AuditEvent
from audit.signer import generate_keypair
from tests.es_server import EsServer


def event(i: int) -> dict[str, Any]:
    return AuditEvent(
        request_id=f"bench-{i:08d}",
        action="chat.completions",
        status_code=200 if i % 10 else 429,
        duration_ns=123_456_789,
        user_id=f"user-{i % 100}",
        tenant=f"tenant-{i % 7}",
        source_ip="10.1.2.3",
        tls_version="1.3",
        http_method="POST",
        url_path="/v1/chat/completions",
        user_agent="bench/1.0",
        model="qwen2-0.5b",
        prompt_tokens=128,
        completion_tokens=128,
        cached_tokens=64,
        ttft_ms=42.5,
        finish_reason="stop",
        ratelimit_decision="allowed",
        content={"content_policy": "sm3", "prompt": {"sm3": "ab" * 32}, "response": {"sm3": "cd" * 32}},
    ).to_dict()


class CountingFsync:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        os.fsync(fd)


def summary(n: int, elapsed: float, latencies: list[float], fsyncs: int) -> dict[str, float]:
    latencies = sorted(latencies)
    return {
        "events_per_s": n / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1e3,
        "fsyncs": fsyncs,
    }


async def bench_emit(root: Path, key: Path, n: int, concurrency: int, fsync: bool) -> dict[str, float]:
    counter = CountingFsync()
    cfg = AuditConfig(spool_dir=root / f"emit-{concurrency}-{fsync}", writer_id="bench", sm2_private_key_path=key)
    auditor = Auditor(cfg, fsync=counter if fsync else (lambda fd: None))
    await auditor.start()
    latencies: list[float] = []
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            t = time.perf_counter()
            await auditor.emit(event(i))
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await auditor.stop()
    return summary(n, elapsed, latencies, counter.calls)


async def bench_paced(root: Path, key: Path, rate: int, seconds: float) -> dict[str, float]:
    """Open loop at `rate` events/s, as a gateway would emit them: the latency one emit adds."""
    counter = CountingFsync()
    auditor = Auditor(
        AuditConfig(spool_dir=root / f"paced-{rate}", writer_id="bench", sm2_private_key_path=key), fsync=counter
    )
    await auditor.start()
    latencies: list[float] = []

    async def one(i: int) -> None:
        t = time.perf_counter()
        await auditor.emit(event(i))
        latencies.append(time.perf_counter() - t)

    tasks = []
    t0 = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    await auditor.stop()
    return summary(n, elapsed, latencies, counter.calls)


async def bench_ship(root: Path, key: Path, n: int) -> dict[str, float]:
    with EsServer(root / "es") as server:
        cfg = AuditConfig(
            spool_dir=root / "ship",
            elasticsearch_url=server.url,
            writer_id="bench",
            sm2_private_key_path=key,
            ship_batch_size=1000,
        )
        offline = Auditor(AuditConfig(spool_dir=cfg.spool_dir, writer_id="bench", sm2_private_key_path=key))
        await offline.start()
        await asyncio.gather(*(offline.emit(event(i)) for i in range(n)))
        await offline.stop()
        auditor = Auditor(cfg)
        t0 = time.perf_counter()
        await auditor.start()
        while auditor.stats()["unshipped_events"] > 0:
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - t0
        shipped = auditor.stats()["shipped_events"]
        await auditor.stop()
    return {"events_per_s": shipped / elapsed, "events": shipped, "seconds": elapsed}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--concurrency", default="1,64,512")
    ap.add_argument("--dir", type=Path, default=None, help="where the spools go (default: a temp dir)")
    args = ap.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        key = root / "sm2.key"
        generate_keypair(key, root / "sm2.pub")
        print(f"# {platform.node()} · {os.cpu_count()} CPUs · Python {platform.python_version()} · spool in {root}")
        print(f"{'run':<34} {'events/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'fsyncs':>8}")
        for c in [int(x) for x in args.concurrency.split(",")]:
            n = min(args.events, 2000) if c == 1 else args.events
            for fsync in (True, False):
                r = await bench_emit(root, key, n, c, fsync)
                label = f"emit, {c} concurrent, {'fsync' if fsync else 'no fsync'}"
                print(
                    f"{label:<34} {r['events_per_s']:>10,.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['fsyncs']:>8}"
                )
        for rate in (100, 1000):
            r = await bench_paced(root, key, rate, 3.0)
            label = f"emit, paced at {rate}/s, fsync"
            print(f"{label:<34} {r['events_per_s']:>10,.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['fsyncs']:>8}")
        s = await bench_ship(root, key, args.events)
        label = "ship backlog to noida-db (bulk 1000)"
        print(f"{label:<34} {s['events_per_s']:>10,.0f}   ({s['events']} in {s['seconds']:.2f}s)")


if __name__ == "__main__":
    asyncio.run(main())
