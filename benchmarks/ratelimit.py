"""Rate-limiter cost per request: admit + settle against a real redis-server and against the in-process store.

    python -m benchmarks.ratelimit [--tasks 1 16 64] [--requests 5000] [--redis-url redis://...]

Each of N tasks loops admit → settle for its share of the requests (requests/min, tokens/min and a concurrency
lease all enforced, limits high enough that every call is admitted). Decisions/s = admits per wall second;
latency = one admit + its settle, as the request sees it. "PING×2" is the floor: the same two redis-py round trips.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

from redis.asyncio import BlockingConnectionPool, Redis

from security.ratelimit import RateLimitConfig, RateLimiter, RateLimitTier
from tests.redis_server import RedisServer

TIER = RateLimitTier(requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent=10**6)


async def admit_settle(limiter: RateLimiter, i: int) -> None:
    adm = await limiter.admit("bench", f"user{i % 100}", None, 300)
    assert adm.allowed, adm.message
    await limiter.settle(adm, 120)


async def two_pings(client: Redis, i: int) -> None:
    await client.ping()
    await client.ping()


async def run(
    request: Callable[[int], Awaitable[None]], num_tasks: int, num_requests: int
) -> tuple[float, float, float]:
    per_task = max(1, num_requests // num_tasks)
    latencies: list[float] = []

    async def worker(i: int) -> None:
        for _ in range(per_task):
            t = time.perf_counter()
            await request(i)
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(worker(i) for i in range(num_tasks)))  # warm-up: connections, script load
    latencies.clear()
    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(num_tasks)))
    wall = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100)
    return len(latencies) / wall, q[49] * 1e6, q[98] * 1e6


async def bench(url: str | None, tasks: list[int], num_requests: int) -> list[tuple[str, int, float, float, float]]:
    rows = []
    for n in tasks:
        cfg = RateLimitConfig(redis_url=url, tiers={"default": TIER}, key_prefix=f"bench:{os.getpid()}:{n}:")
        limiter = RateLimiter(cfg)
        rows.append(("redis" if url else "in-process", n, *await run(partial(admit_settle, limiter), n, num_requests)))
        await limiter.aclose()
        if url:  # the floor: the same two round trips through redis-py, doing nothing
            client = Redis(connection_pool=BlockingConnectionPool.from_url(url, max_connections=64))
            rows.append(("PING×2", n, *await run(partial(two_pings, client), n, num_requests)))
            await client.aclose()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--redis-url", default=None, help="use this Redis instead of starting one on a free port")
    args = ap.parse_args()

    server: AbstractContextManager[RedisServer | None] = nullcontext() if args.redis_url else RedisServer()
    with server as s:
        url = args.redis_url or (s.url if s else None)
        rows = asyncio.run(bench(None, args.tasks, args.requests))
        rows += asyncio.run(bench(url, args.tasks, args.requests))

    print(f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs, {platform.node()}")
    print(f"{'store':<11} {'tasks':>5} {'decisions/s':>12} {'p50 µs':>9} {'p99 µs':>9}   (admit + settle)")
    for store, n, rate, p50, p99 in rows:
        print(f"{store:<11} {n:>5} {rate:>12,.0f} {p50:>9.0f} {p99:>9.0f}")


if __name__ == "__main__":
    main()
