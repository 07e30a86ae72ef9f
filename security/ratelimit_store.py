from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from security.ratelimit_lua import ADMIT_LUA, SETTLE_LUA

WINDOW_US = 60_000_000.0  # every limit is "per minute": a full bucket is one minute of emissions
EPS_US = 1.0  # float slack so that exactly `limit` emissions fit in one window
SWEEP_INTERVAL_S = 10.0


class RateLimitUnavailable(Exception):
    """The shared rate-limit store (Redis) cannot be reached; with on_redis_error="closed" requests are refused."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True, frozen=True)
class Bucket:
    """One scope's limits (a subject, or a whole tenant): intervals in microseconds, 0 = unlimited."""

    key: str
    request_interval_us: float
    token_interval_us: float
    max_concurrent: int
    keys: tuple[str, str, str] = field(init=False, compare=False, repr=False)  # requests, tokens, leases

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", (f"{self.key}:req", f"{self.key}:tok", f"{self.key}:conc"))


@dataclass(slots=True, frozen=True)
class BucketState:
    request_reset_us: float  # time until the requests bucket is full again (TAT - now, >= 0)
    token_reset_us: float


@dataclass(slots=True, frozen=True)
class Verdict:
    allowed: bool
    failed: int  # bit 3*i + d for bucket i and dimension d (0 requests, 1 tokens, 2 concurrency)
    buckets: tuple[BucketState, ...]


class RateLimitStore(Protocol):
    async def admit(self, buckets: Sequence[Bucket], cost: int, lease_id: str, lease_ttl_s: float) -> Verdict:
        """Atomically check every limit; consume all of them (cost tokens, one request, one lease) or none."""
        ...

    async def settle(
        self, buckets: Sequence[Bucket], token_delta: int, lease_id: str, release: bool, lease_ttl_s: float
    ) -> None:
        """Charge (delta > 0) or refund (delta < 0) tokens, then release the lease or extend it by lease_ttl_s."""
        ...


class InProcessStore:
    """The same GCRA + lease semantics over dicts, for one process (embedded mode, fail-open fallback, tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tats: dict[str, float] = {}  # key -> theoretical arrival time, µs on `clock`
        self._leases: dict[str, dict[str, float]] = {}  # key -> lease id -> expiry, µs
        self._next_sweep = clock() + SWEEP_INTERVAL_S

    # NOTE: no awaits below, so each call is atomic on the event loop
    async def admit(self, buckets: Sequence[Bucket], cost: int, lease_id: str, lease_ttl_s: float) -> Verdict:
        now = self._now()
        failed, tats = 0, []
        for i, b in enumerate(buckets):
            for d, (key, interval, inc) in enumerate(
                ((b.keys[0], b.request_interval_us, 1), (b.keys[1], b.token_interval_us, cost))
            ):
                tat = max(self._tats.get(key, now), now) if interval > 0 else now
                if interval > 0 and tat + inc * interval - WINDOW_US - now > EPS_US:
                    failed |= 1 << (3 * i + d)
                tats.append(tat)
            # expired leases matter only to a full bucket: purging every call scanned every lease (O(concurrent))
            leases = self._leases.get(b.keys[2])
            full = b.max_concurrent and leases and len(leases) >= b.max_concurrent
            if full and len(self._purge(b.keys[2], now)) >= b.max_concurrent:
                failed |= 1 << (3 * i + 2)
        if not failed:
            for i, b in enumerate(buckets):
                for d, (interval, inc) in enumerate(((b.request_interval_us, 1), (b.token_interval_us, cost))):
                    if interval > 0 and inc > 0:
                        tats[2 * i + d] += inc * interval
                        self._tats[b.keys[d]] = tats[2 * i + d]
                if b.max_concurrent:
                    self._leases.setdefault(b.keys[2], {})[lease_id] = now + lease_ttl_s * 1e6
        states = tuple(BucketState(tats[2 * i] - now, tats[2 * i + 1] - now) for i in range(len(buckets)))
        return Verdict(not failed, failed, states)

    async def settle(
        self, buckets: Sequence[Bucket], token_delta: int, lease_id: str, release: bool, lease_ttl_s: float
    ) -> None:
        now = self._now()
        for b in buckets:
            key = b.keys[1]
            if b.token_interval_us > 0 and token_delta:
                tat = max(self._tats.get(key, now), now) + token_delta * b.token_interval_us
                if tat > now:
                    self._tats[key] = tat
                else:
                    self._tats.pop(key, None)
            if b.max_concurrent:
                leases = self._leases.setdefault(b.keys[2], {})
                if release:
                    leases.pop(lease_id, None)
                else:
                    leases[lease_id] = now + lease_ttl_s * 1e6

    def _purge(self, key: str, now: float) -> dict[str, float]:
        leases = self._leases.get(key, {})
        for lease_id in [lid for lid, exp in leases.items() if exp <= now]:
            del leases[lease_id]
        return leases

    def _now(self) -> float:
        now_s = self._clock()
        if now_s >= self._next_sweep:  # every key has a TTL here too: drop full buckets and empty lease sets
            self._next_sweep = now_s + SWEEP_INTERVAL_S
            now = now_s * 1e6
            self._tats = {k: t for k, t in self._tats.items() if t > now}
            self._leases = {k: ls for k in list(self._leases) if (ls := self._purge(k, now))}
        return now_s * 1e6


class RedisStore:
    """GCRA + leases in Redis, one Lua script per call, timed by Redis `TIME` so every replica shares one clock."""

    def __init__(self, client: Redis, where: str = "Redis") -> None:
        self._client = client
        self._where = where  # for messages: host:port, never the URL (it may hold a password)
        self._admit = client.register_script(ADMIT_LUA)  # re-sent by redis-py after NOSCRIPT
        self._settle = client.register_script(SETTLE_LUA)

    @classmethod
    def from_url(
        cls, url: str, *, max_connections: int = 64, timeout_s: float = 2.0, health_check_interval_s: int = 1
    ) -> RedisStore:
        # NOTE: after Redis restarts, every pooled connection is dead. A connection idle for longer than the
        # health-check interval is PINGed before use, and a connection error (a dead socket: the command never
        # reached the new server) is retried once on a fresh connection, so the first request after a restart
        # succeeds. Timeouts are never retried: the script may have run, and a retry could consume twice.
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=health_check_interval_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        parts = urlsplit(url)
        where = f"Redis at {parts.hostname}:{parts.port or 6379}" if parts.hostname else f"Redis at {parts.path}"
        return cls(Redis(connection_pool=pool), where)

    async def admit(self, buckets: Sequence[Bucket], cost: int, lease_id: str, lease_ttl_s: float) -> Verdict:
        args: list[Any] = [cost, lease_id, round(lease_ttl_s * 1e6)]
        for b in buckets:
            args += [repr(b.request_interval_us), repr(b.token_interval_us), b.max_concurrent]
        out = await self._call(self._admit, buckets, args)
        states = tuple(BucketState(out[2 + 2 * i] / 1e3, out[3 + 2 * i] / 1e3) for i in range(len(buckets)))
        return Verdict(out[0] == 1, int(out[1]), states)

    async def settle(
        self, buckets: Sequence[Bucket], token_delta: int, lease_id: str, release: bool, lease_ttl_s: float
    ) -> None:
        args: list[Any] = [token_delta, lease_id, int(release), round(lease_ttl_s * 1e6)]
        for b in buckets:
            args += [repr(b.token_interval_us), int(b.max_concurrent > 0)]
        await self._call(self._settle, buckets, args)

    async def _call(self, script: Any, buckets: Sequence[Bucket], args: list[Any]) -> Any:
        keys = [k for b in buckets for k in b.keys]
        try:
            return await script(keys=keys, args=args)
        # RuntimeError: a connection whose socket the dying server closed under it, met mid-write by uvloop's
        # transport ("unable to perform operation on <TCPTransport closed=True>"); redis-py drops that connection
        except (RedisError, OSError, RuntimeError) as exc:
            raise RateLimitUnavailable(f"{self._where} is unreachable ({type(exc).__name__})") from exc

    async def aclose(self) -> None:
        await self._client.aclose(close_connection_pool=True)
