"""Pure ASGI middleware: request context + audit hand-off, body-size limit, JWT authentication."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from audit import AuditUnavailable
from gateway.errors import APIError, error_response
from gateway.state import RequestState
from security.jwks import JWKSError
from security.jwt import AuthError, TokenVerifier

log = logging.getLogger("tianmen.gateway")

PUBLIC_PATHS = frozenset({"/health", "/ready", "/openapi.json"})
AuditHook = Callable[[Scope, dict[str, Any]], Awaitable[None]]
StateHook = Callable[[Scope, RequestState], Awaitable[None]]
_STATE_FIELDS = frozenset(f.name for f in dataclasses.fields(RequestState))


class RequestContext:
    """Gives each request an id and an `audit` dict, times it, captures its status, and hands the
    finished record to `on_complete` — exactly once, whatever the outcome. `precheck` runs first:
    if it raises, the request is refused with 503 (no request is served that cannot be audited).
    Health probes (PUBLIC_PATHS) are not audited."""

    def __init__(
        self,
        app: ASGIApp,
        on_complete: AuditHook | None = None,
        precheck: Callable[[], None] | None = None,
        on_response_start: StateHook | None = None,
    ) -> None:
        self.app, self.on_complete, self.precheck = app, on_complete, precheck
        self.on_response_start = on_response_start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = secrets.token_hex(12)
        audit: dict[str, Any] = {"start": time.time(), "status": 500}
        state = RequestState(request_id, start=audit["start"])
        scope["request_id"], scope["audit"] = request_id, audit
        scope["request_state"] = state  # NOTE: not scope["state"]: Starlette keeps the lifespan state there
        started = time.monotonic()
        audited = scope["path"] not in PUBLIC_PATHS
        refused = False  # the 503 below went out instead of the app's response

        async def refuse(reason: object) -> None:
            nonlocal refused
            refused = True
            audit["error"] = "audit_unavailable"
            log.error("refusing request %s: the audit trail cannot be written (%s)", request_id, reason)
            response = error_response(
                503,
                "the audit trail cannot be written, so no request is served; retry later",
                code="audit_unavailable",
                headers={"Retry-After": "5", "x-request-id": request_id},
            )
            audit["status"] = 503
            await response(scope, receive, send)

        async def send_wrapper(message: Message) -> None:
            if refused:
                raise _Refused
            if message["type"] == "http.response.start":
                audit["status"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
                if self.on_response_start is not None and audited:
                    state.streaming = any(
                        k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"]
                    )
                    _sync(audit, state)
                    try:
                        await self.on_response_start(scope, state)  # the record is durable before the first byte
                    except Exception as e:  # AuditUnavailable, or a bug: either way the record is not there
                        await refuse(e if isinstance(e, AuditUnavailable) else f"{type(e).__name__}: {e}")
                        raise _Refused from None
            await send(message)

        try:
            if self.precheck is not None and audited:
                try:
                    self.precheck()
                except Exception as e:
                    await refuse(e)
                    return
            await self.app(scope, receive, send_wrapper)
        except Exception:
            if not refused:  # after a refusal, what the app raises is only the aborted response
                audit.setdefault("error", "unhandled")
                raise
        except BaseException:
            audit.setdefault("error", "unhandled")
            raise
        finally:
            audit["duration_s"] = time.monotonic() - started
            _sync(audit, state)
            if self.on_complete is not None and audited:
                await self.on_complete(scope, audit)


class _Refused(Exception):
    """Aborts the app's response after the audit 503 went out in its place."""


def _sync(audit: dict[str, Any], state: RequestState) -> None:
    # NOTE: a bridge until every layer writes RequestState itself (the gateway-edge change)
    for key, value in audit.items():
        if key in _STATE_FIELDS:
            setattr(state, key, value)


class BodyLimit:
    """413 for a body over `max_bytes`: declared (content-length) or counted as it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and (not value.isdigit() or int(value) > self.max_bytes):
                await self._too_large(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, self._message(), code="request_too_large")
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"the request body is larger than the limit of {self.max_bytes} bytes"

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["audit"]["error"] = "request_too_large"
        await error_response(413, self._message(), code="request_too_large")(scope, receive, send)


class Auth:
    """Bearer JWT → scope["principal"]; 401 (with WWW-Authenticate) or 403 short-circuit the request."""

    def __init__(self, app: ASGIApp, verifier: TokenVerifier, required_scope: str | None = None) -> None:
        self.app, self.verifier, self.required_scope = app, verifier, required_scope

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        token = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, rest = value.decode("latin-1").partition(" ")
                token = rest.strip() if scheme.lower() == "bearer" else None
        audit = scope["audit"]
        try:
            if not token:
                raise AuthError("missing", "no bearer token: send 'Authorization: Bearer <JWT>'")
            principal = await self.verifier.verify(token)
        except AuthError as e:
            audit["auth_failure"] = e.reason
            headers = {"WWW-Authenticate": f'Bearer error="invalid_token", error_description="{e.reason}"'}
            await error_response(401, str(e), code="invalid_token", headers=headers)(scope, receive, send)
            return
        except JWKSError:
            log.warning("cannot load the JWT key set; refusing requests until it loads")
            audit["auth_failure"] = "jwks_unavailable"
            await error_response(
                503,
                "the identity provider's keys cannot be loaded; retry shortly",
                code="auth_unavailable",
                headers={"Retry-After": "5"},
            )(scope, receive, send)
            return
        audit["user"], audit["tenant"] = principal.subject, principal.tenant
        if self.required_scope and not principal.has_scope(self.required_scope):
            audit["auth_failure"] = "missing_scope"
            await error_response(403, f"this token lacks the scope {self.required_scope!r}", code="insufficient_scope")(
                scope, receive, send
            )
            return
        scope["principal"] = principal
        await self.app(scope, receive, send)
