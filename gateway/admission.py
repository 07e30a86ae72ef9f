"""Rate-limit admission for one call: 429 / 503 as OpenAI-shaped errors, settlement with real counts."""

from __future__ import annotations

import math
from typing import Any

from gateway.errors import APIError
from security.principal import Principal
from security.ratelimit import Admission, RateLimiter, RateLimitUnavailable


async def admit(
    limiter: RateLimiter | None, principal: Principal, est_tokens: int, audit: dict[str, Any]
) -> Admission | None:
    if limiter is None:
        return None
    try:
        adm = await limiter.admit(principal.tenant, principal.subject, principal.tier, est_tokens)
    except RateLimitUnavailable as e:
        audit["ratelimit"] = "unavailable"
        raise APIError(
            503,
            "rate limiting is temporarily unavailable; retry shortly",
            code="ratelimit_unavailable",
            headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))},
        ) from None
    audit["ratelimit"] = "allowed" if adm.allowed else f"refused:{adm.limit}:{adm.scope}"
    if not adm.allowed:
        kind = "tokens" if adm.limit == "tokens" else "requests"  # OpenAI's error types for 429
        raise APIError(429, adm.message, code="rate_limit_exceeded", headers=adm.headers, error_type=kind)
    return adm


async def settle(limiter: RateLimiter | None, adm: Admission | None, tokens: int) -> None:
    if limiter is not None and adm is not None:
        await limiter.settle(adm, tokens)
