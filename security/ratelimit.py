from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import quote

from security.ids import new_id
from security.ratelimit_store import (
    EPS_US,
    WINDOW_US,
    Bucket,
    InProcessStore,
    RateLimitStore,
    RateLimitUnavailable,
    RedisStore,
    Verdict,
)

__all__ = [
    "Admission",
    "InProcessStore",
    "RateLimitConfig",
    "RateLimitStore",
    "RateLimitTier",
    "RateLimitUnavailable",
    "RateLimiter",
    "RedisStore",
    "format_duration",
]

log = logging.getLogger(__name__)

Limit = Literal["requests", "tokens", "concurrency"]
Scope = Literal["subject", "tenant", "model"]
CONCURRENCY_RETRY_S = 1.0  # a slot frees when some call ends, which no clock predicts
SCOPE_CACHE_SIZE = 4096  # callers whose limits are remembered (a dict; cleared when full)
T = TypeVar("T")
_DIMS: tuple[Limit, ...] = ("requests", "tokens", "concurrency")


@dataclass(slots=True, frozen=True)
class RateLimitTier:
    requests_per_minute: int | None = None  # None: unlimited
    tokens_per_minute: int | None = None  # prompt + completion
    max_concurrent: int | None = None  # calls in flight

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"rate-limit tier: {name} must be a positive integer or None (unlimited), got {value!r}"
                )

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute is None and self.tokens_per_minute is None and self.max_concurrent is None


@dataclass(slots=True)
class RateLimitConfig:
    redis_url: str | None = field(default=None, repr=False)  # None: in-process store (one replica); may hold a password
    tiers: dict[str, RateLimitTier] = field(default_factory=lambda: {"default": RateLimitTier()})
    default_tier: str = "default"  # per subject, when the token names no tier
    tenant_tiers: dict[str, str] = field(default_factory=dict)  # tenant id -> tier shared by the whole tenant
    default_tenant_tier: str | None = None  # tenant-wide tier for tenants not in tenant_tiers; None: none
    # model -> {tier name: tier}: per subject on that model, counted apart and on top of the rest; "default" for
    # tokens whose tier the model does not name
    model_tiers: dict[str, dict[str, RateLimitTier]] = field(default_factory=dict)
    on_redis_error: Literal["closed", "open"] = "closed"
    key_prefix: str = "tianmen:rl:"
    lease_ttl_s: float = 120.0  # a crashed replica's concurrency slots come back after this
    redis_timeout_s: float = 2.0  # connect, command and pool wait; generous: a busy event loop delays reads too
    redis_retry_s: float = 0.25  # while Redis is down, probe it at most this often (a refused connect is cheap)
    redis_max_connections: int = 64

    def __post_init__(self) -> None:
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("rate-limit redis_url must start with redis://, rediss:// or unix://")
        if not self.tiers or not all(isinstance(t, RateLimitTier) for t in self.tiers.values()):
            raise ValueError("rate-limit tiers must map at least one tier name to a RateLimitTier")
        if self.default_tier not in self.tiers:
            raise ValueError(f"rate-limit default_tier {self.default_tier!r} is not one of tiers {sorted(self.tiers)}")
        for tenant, name in self.tenant_tiers.items():
            if name not in self.tiers:
                raise ValueError(f"rate-limit tenant_tiers[{tenant!r}] names unknown tier {name!r}")
        if self.default_tenant_tier is not None and self.default_tenant_tier not in self.tiers:
            raise ValueError(f"rate-limit default_tenant_tier {self.default_tenant_tier!r} is not one of tiers")
        for model, tiers in self.model_tiers.items():
            if not all(isinstance(t, RateLimitTier) for t in tiers.values()):
                raise ValueError(f"rate-limit model_tiers[{model!r}] must map tier names to RateLimitTier")
        if self.on_redis_error not in ("closed", "open"):
            raise ValueError(f"rate-limit on_redis_error must be 'closed' or 'open', got {self.on_redis_error!r}")
        if not self.key_prefix:
            raise ValueError("rate-limit key_prefix must not be empty")
        for name in ("lease_ttl_s", "redis_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"rate-limit {name} must be a positive number of seconds")
        if not 0 <= self.redis_retry_s < math.inf:
            raise ValueError("rate-limit redis_retry_s must be >= 0 seconds")
        if self.redis_max_connections < 1:
            raise ValueError("rate-limit redis_max_connections must be >= 1")


@dataclass(slots=True, frozen=True)
class Ticket:
    store: RateLimitStore  # the store that admitted: settle goes back to it
    buckets: tuple[Bucket, ...]
    lease_id: str


@dataclass(slots=True)
class Admission:
    """One admit() decision. Refused: `limit`/`scope` name what refused, `message` is for the 429 body."""

    allowed: bool
    limit: Limit | None = None
    scope: Scope | None = None
    retry_after_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-*; retry-after(-ms) when refused
    message: str = ""
    oversize: bool = False  # this request alone exceeds a tokens-per-minute limit: retrying cannot help
    reserved_tokens: int = 0
    ticket: Ticket | None = field(default=None, repr=False)
    settled: bool = False


class RateLimiter:
    """Per-subject and per-tenant requests/min, tokens/min and concurrency over one RateLimitStore.

    admit() once per request; settle() when the call ends, whatever the outcome; renew() for streams that may
    outlive lease_ttl_s. admit() raises RateLimitUnavailable only with Redis down and on_redis_error="closed";
    settle() and renew() never raise for store errors.
    """

    def __init__(
        self, config: RateLimitConfig, store: RateLimitStore | None = None, fallback: RateLimitStore | None = None
    ) -> None:
        self.config = config
        self._owned: RedisStore | None = None
        if store is None and config.redis_url is not None:
            store = self._owned = RedisStore.from_url(
                config.redis_url, max_connections=config.redis_max_connections, timeout_s=config.redis_timeout_s
            )
        self._store: RateLimitStore = store if store is not None else InProcessStore()
        if fallback is None and config.on_redis_error == "open":
            fallback = InProcessStore()
        self._fallback = fallback
        self._down_since: float | None = None
        self._next_probe = 0.0
        self._warned_tiers: set[str] = set()
        self._pending: set[asyncio.Task[Any]] = set()
        # WHY: the in-process store never suspends (its calls are atomic on the loop), so a cancelled caller
        # cannot leave a call half done and it needs no task of its own: ~2 tasks less per request
        self._atomic = type(self._store) is InProcessStore  # a subclass might await
        self._scope_cache: dict[tuple[str, str, str | None, str | None], list[tuple[Scope, RateLimitTier, Bucket]]] = {}

    async def admit(
        self, tenant: str, subject: str, tier: str | None, est_tokens: int, model: str | None = None
    ) -> Admission:
        if est_tokens < 0:
            raise ValueError("est_tokens must be >= 0")
        scopes = self._scopes(tenant, subject, tier, model)
        if not scopes:
            return Admission(True)
        buckets = tuple(b for _, _, b in scopes)
        lease_id = new_id(12)
        if self._atomic:
            store, verdict = await self._decide(buckets, est_tokens, lease_id)
        else:
            decision = self._spawn(self._decide(buckets, est_tokens, lease_id))
            try:
                store, verdict = await asyncio.shield(decision)
            except asyncio.CancelledError:  # the client left mid-admit: give back whatever the script took
                decision.add_done_callback(lambda d: self._undo(d, buckets, lease_id, est_tokens))
                raise
        admission = _admission(scopes, verdict, est_tokens)
        if admission.allowed:
            admission.ticket = Ticket(store, buckets, lease_id)
        return admission

    async def settle(self, admission: Admission, actual_tokens: int) -> None:
        """Charge or refund the difference to the real token count and release the lease; once per admission."""
        if actual_tokens < 0:
            raise ValueError("actual_tokens must be >= 0")
        if admission.settled or admission.ticket is None:
            return
        admission.settled = True
        if self._atomic:
            await self._update(admission.ticket, actual_tokens - admission.reserved_tokens, True)
            return
        # NOTE: shielded so that a client disconnect cancelling the caller still refunds and frees the slot
        await asyncio.shield(
            self._spawn(self._update(admission.ticket, actual_tokens - admission.reserved_tokens, True))
        )

    async def renew(self, admission: Admission) -> None:
        """Extend the concurrency lease by lease_ttl_s; call every ~lease_ttl_s/3 while a long stream runs."""
        if not admission.settled and admission.ticket is not None:
            await self._update(admission.ticket, 0, False)

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._owned is not None:
            await self._owned.aclose()

    def _undo(
        self,
        decision: asyncio.Future[tuple[RateLimitStore, Verdict]],
        buckets: tuple[Bucket, ...],
        lease_id: str,
        cost: int,
    ) -> None:
        if decision.cancelled() or decision.exception() is not None or not decision.result()[1].allowed:
            return
        self._spawn(self._update(Ticket(decision.result()[0], buckets, lease_id), -cost, True))

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)  # kept in _pending: the loop holds tasks only weakly
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    def _scopes(
        self, tenant: str, subject: str, tier: str | None, model: str | None = None
    ) -> list[tuple[Scope, RateLimitTier, Bucket]]:
        """The limits that apply to a call, remembered per caller (its keys are quoted and formatted once)."""
        key = (tenant, subject, tier, model)
        scopes = self._scope_cache.get(key)
        if scopes is None:
            if len(self._scope_cache) >= SCOPE_CACHE_SIZE:  # many callers: start over rather than grow
                self._scope_cache.clear()
            scopes = self._scope_cache[key] = self._build_scopes(tenant, subject, tier, model)
        return scopes

    def _build_scopes(
        self, tenant: str, subject: str, tier: str | None, model: str | None
    ) -> list[tuple[Scope, RateLimitTier, Bucket]]:
        cfg = self.config
        known = tier is None or tier in cfg.tiers or any(tier in t for t in cfg.model_tiers.values())
        if not known and tier not in self._warned_tiers:
            self._warned_tiers.add(tier)
            log.warning("rate limiter: unknown tier %r, using default tier %r", tier, cfg.default_tier)
        tenant_key = f"{cfg.key_prefix}{{{quote(tenant, safe='')}}}"  # {hash tag}: one cluster slot per tenant
        subject_tier = cfg.tiers[tier if tier in cfg.tiers else cfg.default_tier]
        scopes: list[tuple[Scope, RateLimitTier, Bucket]] = [
            ("subject", subject_tier, _bucket(f"{tenant_key}:s:{quote(subject, safe='')}", subject_tier))
        ]
        tenant_tier_name = cfg.tenant_tiers.get(tenant, cfg.default_tenant_tier)
        if tenant_tier_name is not None:
            tenant_tier = cfg.tiers[tenant_tier_name]
            scopes.append(("tenant", tenant_tier, _bucket(f"{tenant_key}:t", tenant_tier)))
        per_model = cfg.model_tiers.get(model) if model is not None else None
        if per_model:
            model_tier = per_model.get(tier) if tier in per_model else per_model.get("default")
            if model_tier is not None:
                key = f"{tenant_key}:m:{quote(model, safe='')}:s:{quote(subject, safe='')}"  # type: ignore[arg-type]
                scopes.append(("model", model_tier, _bucket(key, model_tier)))
        return [s for s in scopes if not s[1].unlimited]

    async def _decide(self, buckets: tuple[Bucket, ...], cost: int, lease_id: str) -> tuple[RateLimitStore, Verdict]:
        ttl = self.config.lease_ttl_s
        now = time.monotonic()
        if self._down_since is None or now >= self._next_probe:
            self._next_probe = now + self.config.redis_retry_s  # one probe at a time while down
            try:
                verdict = await self._store.admit(buckets, cost, lease_id, ttl)
            except RateLimitUnavailable as exc:
                self._mark_down(exc)
            else:
                self._mark_up()
                return self._store, verdict
        if self._fallback is None:
            raise RateLimitUnavailable(
                "rate limiting is unavailable: Redis cannot be reached, so requests are refused "
                "(on_redis_error='closed'); restore Redis, or set on_redis_error='open' to serve with "
                "per-replica in-process limits during outages",
                retry_after_s=max(self.config.redis_retry_s, 1.0),
            )
        return self._fallback, await self._fallback.admit(buckets, cost, lease_id, ttl)

    async def _update(self, ticket: Ticket, token_delta: int, release: bool) -> None:
        if ticket.store is self._store and self._down_since is not None and time.monotonic() < self._next_probe:
            return  # Redis down: the lease expires by itself and the reservation stands
        try:
            await ticket.store.settle(ticket.buckets, token_delta, ticket.lease_id, release, self.config.lease_ttl_s)
        except RateLimitUnavailable as exc:
            self._mark_down(exc)

    def _mark_down(self, exc: RateLimitUnavailable) -> None:
        now = time.monotonic()
        self._next_probe = now + self.config.redis_retry_s
        if self._down_since is None:
            self._down_since = now
            then = "serving with per-replica in-process limits" if self._fallback else "refusing requests (503)"
            log.warning("rate limiter: %s; %s until it is back", exc, then)

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.warning(
                "rate limiter: Redis is back after %.1f s; shared limits restored", time.monotonic() - self._down_since
            )
            self._down_since = None


def _bucket(key: str, tier: RateLimitTier) -> Bucket:
    rpm, tpm = tier.requests_per_minute, tier.tokens_per_minute
    return Bucket(key, WINDOW_US / rpm if rpm else 0.0, WINDOW_US / tpm if tpm else 0.0, tier.max_concurrent or 0)


def _admission(scopes: Sequence[tuple[Scope, RateLimitTier, Bucket]], verdict: Verdict, cost: int) -> Admission:
    adm = Admission(verdict.allowed, reserved_tokens=cost if verdict.allowed else 0)
    for name, limit_attr, reset_attr in (
        ("requests", "requests_per_minute", "request_reset_us"),
        ("tokens", "tokens_per_minute", "token_reset_us"),
    ):
        shown: tuple[int, int, float] | None = None  # the scope with the least left: (remaining, limit, reset µs)
        for (_, tier, _), state in zip(scopes, verdict.buckets, strict=True):
            limit: int | None = getattr(tier, limit_attr)
            if limit is not None:
                reset_us: float = getattr(state, reset_attr)
                remaining = max(0, min(limit, math.floor((WINDOW_US - reset_us + 1e-3) * limit / WINDOW_US)))
                if shown is None or remaining < shown[0]:
                    shown = (remaining, limit, reset_us)
        if shown is not None:
            adm.headers[f"x-ratelimit-limit-{name}"] = str(shown[1])
            adm.headers[f"x-ratelimit-remaining-{name}"] = str(shown[0])
            adm.headers[f"x-ratelimit-reset-{name}"] = format_duration(shown[2] / 1e6)
    if verdict.allowed:
        return adm
    worst: tuple[bool, float, int, int] | None = None  # (oversize, retry µs, bucket, dimension)
    for i, (_, _, bucket) in enumerate(scopes):
        state = verdict.buckets[i]
        for d in range(3):
            if not verdict.failed >> (3 * i + d) & 1:
                continue
            oversize = False
            if d == 0:
                retry = state.request_reset_us + bucket.request_interval_us - WINDOW_US
            elif d == 1:
                oversize = cost * bucket.token_interval_us > WINDOW_US + EPS_US
                retry = state.token_reset_us + cost * bucket.token_interval_us - WINDOW_US
            else:
                retry = CONCURRENCY_RETRY_S * 1e6
            retry = max(retry, 1e3)
            if worst is None or (oversize, retry) > worst[:2]:
                worst = (oversize, retry, i, d)
    assert worst is not None, "a refusal names at least one failed limit"
    adm.oversize, retry_us, i, d = worst
    scope, tier, _ = scopes[i]
    adm.limit, adm.scope = _DIMS[d], scope
    who = {"subject": "this user", "tenant": "this tenant", "model": "this user on this model"}[scope]
    if adm.oversize:
        adm.message = (
            f"Request too large: it needs {cost} tokens, more than the {tier.tokens_per_minute} tokens per minute "
            f"allowed for {who}; lower max_tokens or shorten the prompt."
        )
        return adm
    adm.retry_after_s = retry_us / 1e6
    wait = format_duration(adm.retry_after_s)
    if d == 0:
        adm.message = f"Rate limit reached for requests per minute for {who}: limit {tier.requests_per_minute}."
    elif d == 1:
        adm.message = (
            f"Rate limit reached for tokens per minute for {who}: limit {tier.tokens_per_minute}, requested {cost}."
        )
    else:
        adm.message = f"Too many concurrent requests for {who}: limit {tier.max_concurrent}."
    adm.message += f" Please try again in {wait}."
    adm.headers["retry-after"] = str(max(1, math.ceil(adm.retry_after_s)))
    adm.headers["retry-after-ms"] = str(math.ceil(adm.retry_after_s * 1e3))
    return adm


def format_duration(seconds: float) -> str:
    """OpenAI's reset format, rounded up to the millisecond: "0s", "120ms", "1s", "8.64s", "6m0s", "1h2m3s"."""
    ms = max(0, math.ceil(seconds * 1e3 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    secs = f"{rest // 1000}.{rest % 1000:03d}".rstrip("0").rstrip(".")
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{secs}s"
