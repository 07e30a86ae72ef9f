"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status, never a traceback."""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import EngineDeadError, EngineError, EngineOverloadedError, InvalidRequestError, RequestFailedError

log = logging.getLogger("tianmen.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere below the routes; turned into an OpenAI-shaped response by the handler."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.error_type = error_type


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None, error_type: str | None = None
) -> dict[str, Any]:
    kind = error_type or _TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    error_type: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, error_type), status_code=status, headers=headers)


# engine error → (status, code, Retry-After or None, message suffix); first match wins, so subclasses come first
ENGINE_ERRORS: tuple[tuple[type[EngineError], int, str | None, int | None, str], ...] = (
    (InvalidRequestError, 400, None, None, ""),
    (EngineOverloadedError, 503, "overloaded", 1, "; retry shortly"),
    (EngineDeadError, 503, "engine_dead", None, ""),
    (RequestFailedError, 503, "request_failed", 1, "; the request may be retried"),
    (EngineError, 503, "engine_error", None, ""),
)


def engine_error(e: EngineError) -> APIError:
    """The one mapping from an engine error to an HTTP error, used before the first byte and in-band."""
    for kind, status, code, retry_after, suffix in ENGINE_ERRORS:
        if isinstance(e, kind):
            headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
            param = e.param if isinstance(e, InvalidRequestError) else None
            return APIError(status, f"{e}{suffix}", param=param, code=code, headers=headers)
    raise AssertionError("EngineError is the last row")  # pragma: no cover


def error_payload(exc: APIError) -> dict[str, Any]:
    return error_body(exc.status, exc.message, exc.param, exc.code, exc.error_type)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, exc.error_type)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(404, f"no route {request.method} {request.url.path}", code="not_found")
    if exc.status_code == 405:
        return error_response(
            405,
            f"method {request.method} is not allowed on {request.url.path}",
            code="method_not_allowed",
            headers=dict(exc.headers or {}),
        )
    return error_response(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))


async def unhandled_error_handler(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s %s: %s", request.method, request.url.path, type(exc).__name__, exc_info=exc)
    # Starlette sends this answer outside RequestContext, which adds the header to every other one
    request_id = request.scope.get("request_id")
    return error_response(
        500,
        "internal server error; the request id in x-request-id identifies it in the logs",
        headers={"x-request-id": request_id} if request_id else None,
    )
