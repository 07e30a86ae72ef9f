from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest

from security.ratelimit import (
    Admission,
    InProcessStore,
    RateLimitConfig,
    RateLimiter,
    RateLimitTier,
    RateLimitUnavailable,
    format_duration,
)
from security.ratelimit_store import Bucket, Verdict


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FlakyStore:
    """An InProcessStore that can be switched off, like Redis going away."""

    def __init__(self, inner: InProcessStore) -> None:
        self.inner = inner
        self.down = False
        self.calls = 0

    async def admit(self, buckets: Sequence[Bucket], cost: int, lease_id: str, lease_ttl_s: float) -> Verdict:
        self.calls += 1
        if self.down:
            raise RateLimitUnavailable("rate-limit store unreachable (ConnectionError)")
        return await self.inner.admit(buckets, cost, lease_id, lease_ttl_s)

    async def settle(
        self, buckets: Sequence[Bucket], token_delta: int, lease_id: str, release: bool, lease_ttl_s: float
    ) -> None:
        self.calls += 1
        if self.down:
            raise RateLimitUnavailable("rate-limit store unreachable (ConnectionError)")
        await self.inner.settle(buckets, token_delta, lease_id, release, lease_ttl_s)


def limiter(clock: Clock, tier: RateLimitTier, **config: Any) -> RateLimiter:
    tiers = {"default": tier, **config.pop("tiers", {})}
    return RateLimiter(RateLimitConfig(tiers=tiers, **config), store=InProcessStore(clock))


async def admit_n(
    rl: RateLimiter, n: int, subject: str = "alice", tenant: str = "acme", est: int = 0
) -> list[Admission]:
    return [await rl.admit(tenant, subject, None, est) for _ in range(n)]


# --- formatting and config


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (-1, "0s"), (0.12, "120ms"), (0.0001, "1ms"), (1, "1s"), (8.64, "8.64s"), (1.2, "1.2s")]
    + [(59.9991, "1m0s"), (360, "6m0s"), (90.5, "1m30.5s"), (3723, "1h2m3s"), (0.9999, "1s")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"default_tier": "gold"}, "default_tier"),
        ({"tenant_tiers": {"acme": "gold"}}, "tenant_tiers"),
        ({"default_tenant_tier": "gold"}, "default_tenant_tier"),
        ({"on_redis_error": "ignore"}, "on_redis_error"),
        ({"redis_url": "localhost:6379"}, "redis_url"),
        ({"key_prefix": ""}, "key_prefix"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"redis_timeout_s": -1}, "redis_timeout_s"),
        ({"redis_retry_s": -1}, "redis_retry_s"),
        ({"redis_max_connections": 0}, "redis_max_connections"),
        ({"tiers": {}}, "tiers"),
    ],
)
def test_config_errors_name_the_setting(kwargs: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        RateLimitConfig(**kwargs)


@pytest.mark.parametrize("value", [0, -5, 1.5, True, "10"])
def test_tier_rejects_non_positive_integers(value: Any) -> None:
    with pytest.raises(ValueError, match="tokens_per_minute"):
        RateLimitTier(tokens_per_minute=value)


def test_config_repr_hides_redis_url() -> None:
    cfg = RateLimitConfig(redis_url="redis://:hunter2@db:6379/0")
    assert "hunter2" not in repr(cfg)


# --- requests per minute (GCRA)


async def test_requests_burst_then_one_per_interval() -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(requests_per_minute=60))
    first = await admit_n(rl, 60)
    assert all(a.allowed for a in first)
    assert first[0].headers["x-ratelimit-remaining-requests"] == "59"
    assert first[-1].headers["x-ratelimit-remaining-requests"] == "0"
    assert first[-1].headers["x-ratelimit-reset-requests"] == "1m0s"
    refused = await rl.admit("acme", "alice", None, 0)
    assert (refused.allowed, refused.limit, refused.scope) == (False, "requests", "subject")
    assert refused.retry_after_s == pytest.approx(1.0)
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["retry-after-ms"] == "1000"
    assert refused.headers["x-ratelimit-limit-requests"] == "60"
    assert "requests per minute" in refused.message and "1s" in refused.message
    clock.advance(0.5)
    again = await rl.admit("acme", "alice", None, 0)
    assert not again.allowed and again.retry_after_s == pytest.approx(0.5)
    clock.advance(0.5)
    assert [a.allowed for a in await admit_n(rl, 2)] == [True, False]


async def test_no_burst_at_window_edges() -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(requests_per_minute=60))
    assert sum(a.allowed for a in await admit_n(rl, 100)) == 60
    clock.advance(30)  # a fixed window would hand out a fresh 60 at its edge; GCRA refills smoothly
    assert sum(a.allowed for a in await admit_n(rl, 100)) == 30


async def test_subjects_and_tenants_are_separate_buckets() -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(requests_per_minute=2))
    assert sum(a.allowed for a in await admit_n(rl, 5, subject="alice")) == 2
    assert sum(a.allowed for a in await admit_n(rl, 5, subject="bob")) == 2
    assert sum(a.allowed for a in await admit_n(rl, 5, subject="alice", tenant="other")) == 2
    # ':' in ids cannot make two (tenant, subject) pairs share a key
    assert sum(a.allowed for a in await admit_n(rl, 5, tenant="a:b", subject="c")) == 2
    assert sum(a.allowed for a in await admit_n(rl, 5, tenant="a", subject="b:c")) == 2


async def test_tenant_tier_limits_all_subjects_together() -> None:
    clock = Clock()
    rl = limiter(
        clock,
        RateLimitTier(requests_per_minute=100),
        tiers={"team": RateLimitTier(requests_per_minute=3)},
        tenant_tiers={"acme": "team"},
    )
    results = [await rl.admit("acme", s, None, 0) for s in ("a", "b", "c", "d")]
    assert [a.allowed for a in results] == [True, True, True, False]
    assert (results[-1].limit, results[-1].scope) == ("requests", "tenant")
    assert "tenant" in results[-1].message
    # the header shows whichever scope has less left: the tenant's 3, not the subject's 100
    assert results[1].headers["x-ratelimit-limit-requests"] == "3"
    assert results[1].headers["x-ratelimit-remaining-requests"] == "1"
    assert (await rl.admit("other", "a", None, 0)).allowed


async def test_model_tiers_count_per_model_and_follow_the_claimed_tier() -> None:
    clock = Clock()
    rl = limiter(
        clock,
        RateLimitTier(requests_per_minute=100),
        model_tiers={
            "big": {"default": RateLimitTier(requests_per_minute=2), "gold": RateLimitTier(requests_per_minute=4)}
        },
    )
    big = [await rl.admit("acme", "a", None, 0, "big") for _ in range(3)]
    assert [a.allowed for a in big] == [True, True, False]
    assert (big[-1].limit, big[-1].scope) == ("requests", "model") and "on this model" in big[-1].message
    assert all([(await rl.admit("acme", "a", None, 0, "small")).allowed for _ in range(5)])  # no limit of its own
    assert sum([(await rl.admit("acme", "b", "gold", 0, "big")).allowed for _ in range(6)]) == 4
    assert sum([(await rl.admit("acme", "c", None, 0, "big")).allowed for _ in range(3)]) == 2  # per subject
    # the general per-subject limit still counts every model: a's 2 + 5 calls above and this one (a refusal
    # charges nothing), of 100
    assert (await rl.admit("acme", "a", None, 0, "small")).headers["x-ratelimit-remaining-requests"] == "92"


async def test_claimed_tier_and_unknown_tier(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(requests_per_minute=1), tiers={"gold": RateLimitTier(requests_per_minute=5)})
    assert sum([(await rl.admit("acme", "g", "gold", 0)).allowed for _ in range(10)]) == 5
    with caplog.at_level(logging.WARNING, logger="security.ratelimit"):
        assert sum([(await rl.admit("acme", "x", "platinum", 0)).allowed for _ in range(10)]) == 1
    assert [r.getMessage() for r in caplog.records].count(
        "rate limiter: unknown tier 'platinum', using default tier 'default'"
    ) == 1


async def test_unlimited_tier_admits_without_headers_or_store() -> None:
    rl = RateLimiter(RateLimitConfig(on_redis_error="closed"), store=FlakyStore(InProcessStore()))
    rl._store.down = True  # type: ignore[attr-defined]
    adm = await rl.admit("acme", "alice", None, 10**9)
    assert adm.allowed and adm.headers == {} and adm.ticket is None
    await rl.settle(adm, 5)


# --- tokens per minute


async def test_tokens_reserved_then_refunded_on_short_completion() -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(tokens_per_minute=1000))
    first = await rl.admit("acme", "alice", None, 600)
    assert first.allowed and first.reserved_tokens == 600
    assert first.headers["x-ratelimit-remaining-tokens"] == "400"
    assert first.headers["x-ratelimit-reset-tokens"] == "36s"
    second = await rl.admit("acme", "alice", None, 600)
    assert (second.allowed, second.limit) == (False, "tokens")
    assert second.retry_after_s == pytest.approx(12.0)  # 200 tokens short at 60 ms per token
    assert second.headers["x-ratelimit-remaining-tokens"] == "400"  # the refusal consumed nothing
    await rl.settle(first, 100)
    third = await rl.admit("acme", "alice", None, 600)
    assert third.allowed and third.headers["x-ratelimit-remaining-tokens"] == "300"


async def test_tokens_overrun_is_charged() -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(tokens_per_minute=1000))
    adm = await rl.admit("acme", "alice", None, 100)
    await rl.settle(adm, 900)
    probe = await rl.admit("acme", "alice", None, 200)
    assert not probe.allowed and probe.headers["x-ratelimit-remaining-tokens"] == "100"
    assert probe.retry_after_s == pytest.approx(6.0)


async def test_request_larger_than_the_token_limit_is_oversize() -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(tokens_per_minute=1000, requests_per_minute=10))
    adm = await rl.admit("acme", "alice", None, 1001)
    assert (adm.allowed, adm.limit, adm.oversize) == (False, "tokens", True)
    assert "retry-after" not in adm.headers and "max_tokens" in adm.message
    assert adm.headers["x-ratelimit-remaining-requests"] == "10"
    assert (await rl.admit("acme", "alice", None, 1000)).allowed


async def test_settle_is_idempotent_and_validates() -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(tokens_per_minute=1000, max_concurrent=2))
    a, b = await admit_n(rl, 2, est=100)
    await rl.settle(a, 0)
    await rl.settle(a, 0)  # a second refund and a second release would free b's slot and 100 more tokens
    c = await rl.admit("acme", "alice", None, 100)
    assert c.allowed and c.headers["x-ratelimit-remaining-tokens"] == "800"
    assert (await rl.admit("acme", "alice", None, 100)).limit == "concurrency"
    with pytest.raises(ValueError, match="actual_tokens"):
        await rl.settle(b, -1)
    with pytest.raises(ValueError, match="est_tokens"):
        await rl.admit("acme", "alice", None, -1)


# --- concurrency


async def test_concurrency_slots_and_all_or_nothing() -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=1))
    held = await rl.admit("acme", "alice", None, 100)
    refused = await rl.admit("acme", "alice", None, 100)
    assert (refused.allowed, refused.limit, refused.retry_after_s) == (False, "concurrency", 1.0)
    assert refused.ticket is None and refused.reserved_tokens == 0
    await rl.settle(refused, 0)  # a refusal holds nothing to settle
    await rl.settle(held, 100)
    after = await rl.admit("acme", "alice", None, 100)
    # the refused call consumed neither a request nor tokens
    assert after.headers["x-ratelimit-remaining-requests"] == "8"
    assert after.headers["x-ratelimit-remaining-tokens"] == "800"


async def test_lease_expires_after_a_crash_and_renew_extends_it() -> None:
    clock = Clock()
    rl = limiter(clock, RateLimitTier(max_concurrent=1), lease_ttl_s=10)
    crashed = await rl.admit("acme", "alice", None, 0)
    assert crashed.allowed
    clock.advance(9.9)
    assert not (await rl.admit("acme", "alice", None, 0)).allowed
    clock.advance(0.2)
    streaming = await rl.admit("acme", "alice", None, 0)
    assert streaming.allowed
    clock.advance(8)
    await rl.renew(streaming)
    clock.advance(8)
    assert not (await rl.admit("acme", "alice", None, 0)).allowed
    clock.advance(2.1)
    assert (await rl.admit("acme", "alice", None, 0)).allowed


async def test_in_process_store_forgets_full_buckets() -> None:
    clock = Clock()
    store = InProcessStore(clock)
    rl = RateLimiter(RateLimitConfig(tiers={"default": RateLimitTier(1000, 1000, 5)}, lease_ttl_s=5), store=store)
    for s in range(50):
        await rl.admit("acme", f"user{s}", None, 10)
    assert len(store._tats) == 100 and len(store._leases) == 50
    clock.advance(61)
    await rl.admit("acme", "last", None, 10)
    assert set(store._tats) == {"tianmen:rl:{acme}:s:last:req", "tianmen:rl:{acme}:s:last:tok"}
    assert list(store._leases) == ["tianmen:rl:{acme}:s:last:conc"]


async def test_settle_survives_cancellation_of_the_caller() -> None:
    class SlowSettle(FlakyStore):
        async def settle(self, *args: Any) -> None:
            await asyncio.sleep(0.01)
            await super().settle(*args)

    store = SlowSettle(InProcessStore())
    rl = RateLimiter(RateLimitConfig(tiers={"default": RateLimitTier(max_concurrent=1)}), store=store)
    adm = await rl.admit("acme", "alice", None, 0)
    task = asyncio.ensure_future(rl.settle(adm, 0))
    await asyncio.sleep(0)
    task.cancel()  # the client went away while the stream was being cleaned up
    with pytest.raises(asyncio.CancelledError):
        await task
    await rl.aclose()  # waits for the shielded settle
    assert (await rl.admit("acme", "alice", None, 0)).allowed


async def test_admit_cancelled_mid_flight_gives_back_what_it_took() -> None:
    class SlowAdmit(FlakyStore):
        async def admit(self, *args: Any) -> Verdict:
            await asyncio.sleep(0.01)
            return await super().admit(*args)

    tier = RateLimitTier(tokens_per_minute=1000, max_concurrent=1)
    rl = RateLimiter(RateLimitConfig(tiers={"default": tier}), store=SlowAdmit(InProcessStore()))
    task = asyncio.ensure_future(rl.admit("acme", "alice", None, 800))
    await asyncio.sleep(0)
    task.cancel()  # the client went away before the decision came back; the store still admits
    with pytest.raises(asyncio.CancelledError):
        await task
    await rl.aclose()
    assert (await rl.admit("acme", "alice", None, 1000)).allowed  # the slot and the 800 tokens came back


# --- store outages


async def test_fail_closed_raises_typed_error_then_recovers(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore(InProcessStore())
    rl = RateLimiter(RateLimitConfig(tiers={"default": RateLimitTier(10)}, redis_retry_s=0), store=store)
    held = await rl.admit("acme", "alice", None, 0)
    store.down = True
    with caplog.at_level(logging.WARNING, logger="security.ratelimit"):
        for _ in range(3):
            with pytest.raises(RateLimitUnavailable, match="on_redis_error='open'"):
                await rl.admit("acme", "alice", None, 0)
        await rl.settle(held, 0)  # never raises, even with the store down
        store.down = False
        assert (await rl.admit("acme", "alice", None, 0)).allowed
    messages = [r.getMessage() for r in caplog.records]
    assert sum("refusing requests" in m for m in messages) == 1
    assert sum("Redis is back" in m for m in messages) == 1
    assert not any("alice" in m or "acme" in m for m in messages)


async def test_fail_open_uses_local_limits_and_probes_at_most_every_retry_interval() -> None:
    clock = Clock()
    store = FlakyStore(InProcessStore(clock))
    cfg = RateLimitConfig(tiers={"default": RateLimitTier(2)}, on_redis_error="open", redis_retry_s=3600)
    rl = RateLimiter(cfg, store=store, fallback=InProcessStore(clock))
    store.down = True
    results = await admit_n(rl, 5)
    assert [a.allowed for a in results] == [True, True, False, False, False]  # the local limiter still limits
    assert store.calls == 1  # one failed probe, then no more until redis_retry_s has passed
    await rl.settle(results[0], 0)
    assert store.calls == 1  # settles go to the store that admitted: the local one


async def test_in_process_store_is_atomic_under_concurrency() -> None:
    rl = RateLimiter(RateLimitConfig(tiers={"default": RateLimitTier(50, max_concurrent=30)}))
    results = await asyncio.gather(*(rl.admit("acme", "alice", None, 0) for _ in range(200)))
    assert sum(a.allowed for a in results) == 30
    assert {a.limit for a in results if not a.allowed} == {"concurrency"}


@pytest.mark.parametrize(
    "fault",
    [
        ConnectionError("Connection refused"),
        # uvloop's transport, when the dying server closed the socket under a write (seen killing redis-server
        # under load: it surfaced as a 500 before)
        RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed"),
    ],
)
async def test_a_redis_call_that_fails_in_any_transport_way_is_unavailable_not_a_crash(fault: Exception) -> None:
    from redis.asyncio import Redis

    from security.ratelimit_store import RedisStore

    store = RedisStore(Redis(), where="127.0.0.1:6399")

    async def broken(**_kw: object) -> None:
        raise fault

    store._admit = store._settle = broken  # type: ignore[method-assign]
    bucket = Bucket("k", 1000.0, 10.0, 0)
    with pytest.raises(RateLimitUnavailable, match=r"127\.0\.0\.1:6399 is unreachable"):
        await store.settle([bucket], 5, "lease", True, 30.0)
    with pytest.raises(RateLimitUnavailable, match=r"unreachable \(" + type(fault).__name__):
        await store.admit([bucket], 5, "lease", 30.0)


async def test_callers_limits_are_remembered_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("security.ratelimit.SCOPE_CACHE_SIZE", 4)
    rl = limiter(Clock(), RateLimitTier(requests_per_minute=2))
    for s in range(10):  # more callers than the cache holds: it starts over instead of growing
        await admit_n(rl, 2, subject=f"user{s}")
        assert len(rl._scope_cache) <= 4
    assert not (await rl.admit("acme", "user9", None, 0)).allowed  # a remembered caller's own bucket
    assert not (await rl.admit("acme", "user0", None, 0)).allowed  # a forgotten one's, rebuilt: the same bucket
    assert (await rl.admit("acme", "user10", None, 0)).allowed
