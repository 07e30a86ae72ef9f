"""Rate-limit admission for one call: 429 / 503 as OpenAI-shaped errors, lease renewal, settlement with real counts."""

from __future__ import annotations

import asyncio
import contextlib
import math

from gateway.errors import APIError
from gateway.state import RequestState
from security.principal import Principal
from security.ratelimit import Admission, RateLimiter, RateLimitUnavailable


class Lease:
    """An admitted call: its concurrency lease is renewed every lease_ttl_s/3 until `settle`, which runs once.

    The renewal is a timer, not a task that sleeps: most calls end long before the first renewal, and a timer
    costs the event loop far less to start and cancel than a task."""

    def __init__(self, limiter: RateLimiter | None, adm: Admission | None) -> None:
        self.limiter, self.adm = limiter, adm
        self._timer: asyncio.TimerHandle | None = None
        self._renewal: asyncio.Task[None] | None = None
        if limiter is not None and adm is not None and adm.ticket is not None:
            self._schedule(limiter.config.lease_ttl_s / 3)

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.adm.headers) if self.adm is not None else {}

    async def settle(self, tokens: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._renewal is not None:
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
            self._renewal = None
        if self.limiter is not None and self.adm is not None:
            await self.limiter.settle(self.adm, tokens)

    def _schedule(self, interval: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(interval, self._renew, interval)

    def _renew(self, interval: float) -> None:
        assert self.limiter is not None and self.adm is not None
        if self._renewal is None or self._renewal.done():  # never two at once against a slow store
            self._renewal = asyncio.ensure_future(self.limiter.renew(self.adm))  # never raises for store errors
        self._schedule(interval)


async def admit(
    limiter: RateLimiter | None, principal: Principal, est_tokens: int, state: RequestState, model: str | None = None
) -> Lease:
    """`model`: the served model, for the limits configured per model (counted apart)."""
    if limiter is None:
        return Lease(None, None)
    try:
        adm = await limiter.admit(principal.tenant, principal.subject, principal.tier, est_tokens, model)
    except RateLimitUnavailable as e:
        state.ratelimit = "unavailable"
        raise APIError(
            503,
            "rate limiting is temporarily unavailable; retry shortly",
            code="ratelimit_unavailable",
            headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))},
        ) from None
    state.ratelimit = "allowed" if adm.allowed else f"refused:{adm.limit}:{adm.scope}"
    if not adm.allowed:
        kind = "tokens" if adm.limit == "tokens" else "requests"  # OpenAI's error types for 429
        raise APIError(429, adm.message, code="rate_limit_exceeded", headers=adm.headers, error_type=kind)
    return Lease(limiter, adm)
