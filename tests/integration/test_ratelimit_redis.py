"""Every limiter behaviour against a real redis-server (started on a free port unless TIANMEN_TEST_REDIS_URL is set)."""

from __future__ import annotations

import asyncio
import logging
import math
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from security.ratelimit import Admission, RateLimitConfig, RateLimiter, RateLimitTier, RateLimitUnavailable
from tests.redis_server import RedisServer, redis_url

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with redis_url() as u:
        yield u


@pytest.fixture
def prefix() -> str:
    return f"tianmen:test:{uuid.uuid4().hex[:12]}:"  # tests never see each other's keys, even on a shared Redis


@pytest.fixture
async def redis(url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(url)
    yield client
    await client.aclose()


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:  # always our own: these tests kill it
        yield s


def config(url: str, prefix: str, tier: RateLimitTier, **kwargs: Any) -> RateLimitConfig:
    kwargs.setdefault("redis_timeout_s", 10.0)  # a loaded CI box must not look like a Redis outage
    return RateLimitConfig(
        redis_url=url, key_prefix=prefix, tiers={"default": tier, **kwargs.pop("tiers", {})}, **kwargs
    )


SLACK = 6  # tokens/min buckets refill in real time: at 1000/min, 6 tokens is 360 ms of a slow CI box


def tokens_left(adm: Admission) -> int:
    return int(adm.headers["x-ratelimit-remaining-tokens"])


Make = Callable[[RateLimitConfig], RateLimiter]


@pytest.fixture
async def make() -> AsyncIterator[Make]:
    made: list[RateLimiter] = []

    def build(cfg: RateLimitConfig) -> RateLimiter:
        made.append(RateLimiter(cfg))
        return made[-1]

    yield build
    for rl in made:
        await rl.aclose()


async def test_exact_counting_under_concurrency(make: Make, url: str, prefix: str) -> None:
    rl = make(config(url, prefix, RateLimitTier(requests_per_minute=50)))
    results = await asyncio.gather(*(rl.admit("acme", "alice", None, 0) for _ in range(200)))
    assert sum(a.allowed for a in results) == 50
    assert {a.limit for a in results if not a.allowed} == {"requests"}


async def test_exact_concurrency_under_concurrency(make: Make, url: str, prefix: str) -> None:
    rl = make(config(url, prefix, RateLimitTier(max_concurrent=50)))
    results = await asyncio.gather(*(rl.admit("acme", "alice", None, 0) for _ in range(200)))
    assert sum(a.allowed for a in results) == 50
    await asyncio.gather(*(rl.settle(a, 0) for a in results[:100]))
    again = await asyncio.gather(*(rl.admit("acme", "alice", None, 0) for _ in range(100)))
    assert sum(a.allowed for a in again) == sum(a.allowed for a in results[:100])


async def test_two_limiters_share_one_limit(make: Make, url: str, prefix: str) -> None:
    tiers = {"team": RateLimitTier(requests_per_minute=40)}
    cfg = config(url, prefix, RateLimitTier(tokens_per_minute=10_000), tiers=tiers, tenant_tiers={"acme": "team"})
    a, b = make(cfg), make(cfg)  # two gateway replicas
    results = await asyncio.gather(*(rl.admit("acme", f"u{i % 7}", None, 10) for i in range(100) for rl in (a, b)))
    assert sum(r.allowed for r in results) == 40
    assert {(r.limit, r.scope) for r in results if not r.allowed} == {("requests", "tenant")}


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from security.ratelimit import Admission, RateLimitConfig, RateLimiter, RateLimitTier

    async def main(url, prefix):
        rl = RateLimiter(RateLimitConfig(redis_url=url, key_prefix=prefix, redis_timeout_s=10,
                                         tiers={"default": RateLimitTier(requests_per_minute=50)}))
        print("ready", flush=True)
        sys.stdin.readline()
        results = await asyncio.gather(*(rl.admit("acme", "alice", None, 0) for _ in range(100)))
        print(sum(a.allowed for a in results), flush=True)
        await rl.aclose()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_two_os_processes_share_one_limit(make: Make, url: str, prefix: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, prefix], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        rl = make(config(url, prefix, RateLimitTier(requests_per_minute=50)))
        child.stdin.write("go\n")
        child.stdin.flush()
        ours = await asyncio.gather(*(rl.admit("acme", "alice", None, 0) for _ in range(100)))
        theirs = int(await asyncio.to_thread(child.stdout.readline))
        assert sum(a.allowed for a in ours) + theirs == 50
    finally:
        child.stdin.close()
        child.stdout.close()
        assert child.wait(timeout=10) == 0


async def test_token_reservation_refund_and_overrun(make: Make, url: str, prefix: str) -> None:
    rl = make(config(url, prefix, RateLimitTier(tokens_per_minute=1000)))
    first = await rl.admit("acme", "alice", None, 600)
    assert first.allowed and tokens_left(first) in range(400, 400 + SLACK)
    refused = await rl.admit("acme", "alice", None, 600)
    assert (refused.allowed, refused.limit, refused.scope) == (False, "tokens", "subject")
    assert 11.5 < refused.retry_after_s <= 12.0  # 200 tokens short at 60 ms per token
    await rl.settle(first, 100)  # short completion: 500 come back
    second = await rl.admit("acme", "alice", None, 600)
    assert second.allowed and tokens_left(second) in range(300, 300 + SLACK)
    await rl.settle(second, 800)  # overrun: 200 more are charged
    probe = await rl.admit("acme", "alice", None, 200)
    assert not probe.allowed and tokens_left(probe) in range(100, 100 + SLACK)


async def test_stream_cut_by_client_still_settles(make: Make, url: str, prefix: str) -> None:
    rl = make(config(url, prefix, RateLimitTier(tokens_per_minute=1000, max_concurrent=1)))
    admitted = asyncio.Event()

    async def stream() -> None:
        adm = await rl.admit("acme", "alice", None, 900)
        try:
            admitted.set()
            await asyncio.sleep(3600)  # generating; the client disconnects
        finally:
            await rl.settle(adm, 50)  # 50 tokens were produced before the cut

    task = asyncio.ensure_future(stream())
    await admitted.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    nxt = await rl.admit("acme", "alice", None, 900)
    assert nxt.allowed, nxt.message  # the slot is free and 850 tokens came back
    assert tokens_left(nxt) in range(50, 50 + SLACK)


async def test_lease_expires_after_a_crash(make: Make, url: str, prefix: str) -> None:
    cfg = config(url, prefix, RateLimitTier(max_concurrent=2), lease_ttl_s=0.8)
    crashed = make(cfg)
    assert (await crashed.admit("acme", "a", None, 0)).allowed
    await crashed.aclose()  # the replica dies without settling
    survivor = make(cfg)
    await asyncio.sleep(0.3)
    live = await survivor.admit("acme", "a", None, 0)  # keeps the lease set alive past the dead lease's expiry
    assert live.allowed
    assert not (await survivor.admit("acme", "a", None, 0)).allowed
    await asyncio.sleep(0.55)  # the dead lease has expired; the live one has not
    results = await asyncio.gather(*(survivor.admit("acme", "a", None, 0) for _ in range(3)))
    assert sum(a.allowed for a in results) == 1
    await survivor.renew(live)
    await asyncio.sleep(0.35)  # past the live lease's first expiry, inside the renewed one
    results = await asyncio.gather(*(survivor.admit("acme", "a", None, 0) for _ in range(2)))
    assert sum(a.allowed for a in results) == 0


async def test_every_key_has_a_ttl(make: Make, url: str, prefix: str, redis: Redis) -> None:
    rl = make(
        config(url, prefix, RateLimitTier(10, 1000, 2), tiers={"t": RateLimitTier(100)}, tenant_tiers={"acme": "t"})
    )
    adm = await rl.admit("acme", "alice", None, 100)
    await rl.settle(adm, 300)
    await rl.admit("acme", "alice", None, 100)
    keys = sorted([k.decode() async for k in redis.scan_iter(match=prefix + "*")])
    assert keys == [
        prefix + k for k in ("{acme}:s:alice:conc", "{acme}:s:alice:req", "{acme}:s:alice:tok", "{acme}:t:req")
    ]
    for key in keys:
        assert 0 < await redis.pttl(key) <= 120_001


async def test_headers_and_retry_after(make: Make, url: str, prefix: str) -> None:
    rl = make(config(url, prefix, RateLimitTier(requests_per_minute=60, tokens_per_minute=6000)))
    start = time.monotonic()
    results = [await rl.admit("acme", "alice", None, 10) for _ in range(61)]
    elapsed = time.monotonic() - start
    first = results[0]
    assert first.headers["x-ratelimit-limit-requests"] == "60"
    assert first.headers["x-ratelimit-remaining-requests"] == "59"
    assert first.headers["x-ratelimit-reset-requests"] == "1s"
    assert first.headers["x-ratelimit-limit-tokens"] == "6000"
    assert first.headers["x-ratelimit-remaining-tokens"] == "5990"
    assert first.headers["x-ratelimit-reset-tokens"] == "100ms"
    assert [a.allowed for a in results] == [True] * 60 + [False]
    r = results[-1]
    assert r.limit == "requests"
    assert 1.0 - elapsed - 0.01 <= r.retry_after_s <= 1.0  # one GCRA emission interval, less the time spent
    assert r.headers["retry-after"] == "1"
    assert int(r.headers["retry-after-ms"]) == math.ceil(r.retry_after_s * 1000)
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    reset = r.headers["x-ratelimit-reset-requests"]
    assert reset == "1m0s" or reset.startswith("59."), reset
    assert 5400 <= int(r.headers["x-ratelimit-remaining-tokens"]) <= 5401 + elapsed * 100  # 600 reserved, 100/s back


async def test_script_flush_mid_run(make: Make, url: str, prefix: str, server: RedisServer) -> None:
    rl = make(config(server.url, prefix, RateLimitTier(requests_per_minute=5)))
    assert all(a.allowed for a in await asyncio.gather(*(rl.admit("acme", "a", None, 0) for _ in range(3))))
    admin = Redis.from_url(server.url)
    await admin.script_flush()
    await admin.aclose()
    results = await asyncio.gather(*(rl.admit("acme", "a", None, 0) for _ in range(5)))
    assert sum(a.allowed for a in results) == 2


async def test_redis_killed_fail_closed_then_back(make: Make, server: RedisServer, prefix: str) -> None:
    rl = make(config(server.url, prefix, RateLimitTier(requests_per_minute=3, max_concurrent=5), redis_retry_s=0))
    held = await rl.admit("acme", "a", None, 0)
    assert held.allowed
    server.kill()
    for _ in range(2):
        with pytest.raises(RateLimitUnavailable) as err:
            await rl.admit("acme", "a", None, 0)
        assert "on_redis_error" in str(err.value) and err.value.retry_after_s >= 1
    await rl.settle(held, 0)  # swallowed: the lease would expire by itself
    server.start()
    results = [await rl.admit("acme", "a", None, 0) for _ in range(4)]  # same limiter, no restart
    assert [a.allowed for a in results] == [True, True, True, False]  # the restarted Redis is empty


async def test_redis_killed_fail_open_then_back(
    make: Make, server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(server.url, prefix, RateLimitTier(requests_per_minute=2), on_redis_error="open", redis_retry_s=0)
    rl = make(cfg)
    assert (await rl.admit("acme", "a", None, 0)).allowed
    server.kill()
    with caplog.at_level(logging.WARNING, logger="security.ratelimit"):
        local = [await rl.admit("acme", "a", None, 0) for _ in range(4)]
        assert [a.allowed for a in local] == [True, True, False, False]  # the per-replica limiter
        server.start()
        back = [await rl.admit("acme", "b", None, 0) for _ in range(3)]
        assert [a.allowed for a in back] == [True, True, False]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("per-replica in-process limits" in m for m in messages) == 1  # once per outage, not per request
    assert sum("Redis is back" in m for m in messages) == 1
    client = Redis.from_url(server.url)
    assert await client.exists(f"{prefix}{{acme}}:s:b:req") == 1  # decided by Redis again
    await client.aclose()


async def test_first_calls_after_a_restart_succeed_on_a_pool_of_dead_connections(
    make: Make, server: RedisServer
) -> None:
    # every pooled connection (16 opened by concurrent calls) is dead after the restart; none may fail a call
    rl = make(config(server.url, "p:", RateLimitTier(requests_per_minute=10_000, max_concurrent=None), redis_retry_s=0))
    assert all(a.allowed for a in await asyncio.gather(*(rl.admit("acme", f"s{i}", None, 0) for i in range(16))))
    server.kill()
    server.start()
    for _ in range(3):  # idle connections (PINGed) and just-used ones (retried once) alike
        results = await asyncio.gather(*(rl.admit("acme", f"s{i}", None, 0) for i in range(16)))
        assert all(a.allowed for a in results)
    await asyncio.sleep(1.2)  # past the health-check interval: the next use PINGs first
    server.kill()
    server.start()
    assert all(a.allowed for a in await asyncio.gather(*(rl.admit("acme", f"s{i}", None, 0) for i in range(16))))
