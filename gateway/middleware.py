"""Pure ASGI middleware: request context + audit hand-off, body-size limit, JWT authentication."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth_guard import FailedAuthLimiter
from gateway.errors import APIError, error_response
from gateway.state import RequestState
from security.ids import new_id
from security.jwks import JWKSError
from security.jwt import AuthError, TokenVerifier

log = logging.getLogger("tianmen.gateway")

PUBLIC_PATHS = frozenset({"/health", "/ready", "/openapi.json"})
StateHook = Callable[[Scope, RequestState], Awaitable[None]]


class RequestContext:
    """Gives each request an id and a `RequestState` (scope["request_state"]), times it, captures its status, and
    hands the finished record to `on_complete` exactly once, whatever the outcome. `precheck` runs first
    and `on_response_start` before the first response byte: if either raises, the answer is a 503
    (no request is served that cannot be audited). Health probes (PUBLIC_PATHS) are not audited."""

    def __init__(
        self,
        app: ASGIApp,
        on_complete: StateHook | None = None,
        precheck: Callable[[], None] | None = None,
        on_response_start: StateHook | None = None,
    ) -> None:
        self.app, self.on_complete, self.precheck = app, on_complete, precheck
        self.on_response_start = on_response_start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_id(12)
        state = RequestState(request_id)
        scope["request_id"], scope["request_state"] = request_id, state
        audited = scope["path"] not in PUBLIC_PATHS
        started = time.monotonic()
        refused = False  # the hook refused the response: the app's later messages go nowhere

        async def send_wrapper(message: Message) -> None:
            nonlocal refused
            if refused:
                raise _ResponseRefused  # stops the app's stream; RequestContext swallows it
            if message["type"] == "http.response.start":
                state.status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                if self.on_response_start is not None and audited:
                    state.streaming = any(
                        k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"]
                    )
                    try:
                        await self.on_response_start(scope, state)  # the record is durable before the first byte
                    except Exception as e:
                        refused = True
                        log.error("refusing the response to %s: no audit record (%s)", request_id, type(e).__name__)
                        await _audit_unavailable(state)(scope, receive, _with_request_id(send, request_id))
                        return
            await send(message)

        try:
            if self.precheck is not None and audited:
                try:
                    self.precheck()
                except Exception as e:
                    log.error("refusing request %s: the audit trail cannot be written (%s)", request_id, e)
                    await _audit_unavailable(state)(scope, receive, _with_request_id(send, request_id))
                    return
            await self.app(scope, receive, send_wrapper)
        except _ResponseRefused:
            pass
        except BaseException as e:
            if state.error is None:
                state.error = "unhandled"
            if state.status is None and isinstance(e, Exception):  # Starlette answers 500 past send_wrapper
                state.status = 500
            raise
        finally:
            state.duration_s = time.monotonic() - started
            if self.on_complete is not None and audited:
                await self.on_complete(scope, state)


class _ResponseRefused(Exception):
    """Raised into the app when it sends after `on_response_start` refused its response."""


def _audit_unavailable(state: RequestState) -> Response:
    state.error, state.status = "audit_unavailable", 503
    return error_response(
        503,
        "the audit trail cannot be written, so no request is served; retry later",
        code="audit_unavailable",
        headers={"Retry-After": "5"},
    )


def _with_request_id(send: Send, request_id: str) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
        await send(message)

    return wrapped


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
        scope["request_state"].error = "request_too_large"
        await error_response(413, self._message(), code="request_too_large")(scope, receive, send)


class Auth:
    """Bearer JWT → scope["principal"]; 401 (with WWW-Authenticate) or 403 short-circuit the request.

    With a `guard`, a source IP past its budget of failed authentications gets 429 instead of 401."""

    def __init__(
        self,
        app: ASGIApp,
        verifier: TokenVerifier,
        required_scope: str | None = None,
        guard: FailedAuthLimiter | None = None,
    ) -> None:
        self.app, self.verifier, self.required_scope, self.guard = app, verifier, required_scope, guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        token = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, rest = value.decode("latin-1").partition(" ")
                token = rest.strip() if scheme.lower() == "bearer" else None
        state: RequestState = scope["request_state"]
        try:
            if not token:
                raise AuthError("missing", "no bearer token: send 'Authorization: Bearer <JWT>'")
            principal = await self.verifier.verify(token)
        except AuthError as e:
            state.auth_failure = e.reason
            await self._refuse(scope, receive, send, e)
            return
        except JWKSError:
            log.warning("cannot load the JWT key set; refusing requests until it loads")
            state.auth_failure = "jwks_unavailable"
            await error_response(
                503,
                "the identity provider's keys cannot be loaded; retry shortly",
                code="auth_unavailable",
                headers={"Retry-After": "5"},
            )(scope, receive, send)
            return
        state.user, state.tenant = principal.subject, principal.tenant
        if self.required_scope and not principal.has_scope(self.required_scope):
            state.auth_failure = "missing_scope"
            await error_response(403, f"this token lacks the scope {self.required_scope!r}", code="insufficient_scope")(
                scope, receive, send
            )
            return
        scope["principal"] = principal
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, e: AuthError) -> None:
        client = scope.get("client")
        wait = self.guard.failed(client[0] if client else "") if self.guard is not None else None
        if wait is not None:
            scope["request_state"].error = "auth_rate_limited"
            retry = str(max(1, math.ceil(wait)))
            message = f"too many failed authentications from this address; retry in {retry} s"
            response = error_response(429, message, code="too_many_auth_failures", headers={"Retry-After": retry})
        else:
            headers = {"WWW-Authenticate": f'Bearer error="invalid_token", error_description="{e.reason}"'}
            response = error_response(401, str(e), code="invalid_token", headers=headers)
        await response(scope, receive, send)
