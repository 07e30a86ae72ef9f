"""create_app(deps) → Starlette: the routes, the middleware stack and the lifespan that owns resources."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from gateway import prompt, routes
from gateway.auth_guard import FailedAuthLimiter
from gateway.errors import APIError, api_error_handler, http_exception_handler, unhandled_error_handler
from gateway.metrics import Metrics
from gateway.middleware import Auth, BodyLimit, RequestContext, StateHook
from gateway.models import ModelRegistry
from gateway.privacy import Privacy
from security.jwt import TokenVerifier
from security.ratelimit import RateLimiter


@dataclass
class Deps:
    """Everything the app needs, built by gateway.server (or a test) and passed in."""

    engine: Any  # engine.AsyncEngine, or a test double with the same surface: the first (or only) model's
    verifier: TokenVerifier
    models: ModelRegistry | None = None  # every served model; None: `engine` alone, under its model_name
    max_body_bytes: int = 1 << 20
    required_scope: str | None = None
    limiter: RateLimiter | None = None
    metrics: Metrics | None = None
    admin_scope: str = "admin"
    profile_dir: Path = Path(".tianmen/profiles")
    on_complete: StateHook | None = None
    on_response_start: StateHook | None = None  # awaited before the first response byte; raising → 503
    audit_precheck: Callable[[], None] | None = None
    auth_guard: FailedAuthLimiter | None = None  # failed authentications per source IP → 429
    cache_salt_per_subject: bool = False  # prefix cache shared by a tenant (False) or by one subject only
    report_cached_tokens: bool = True  # usage.prompt_tokens_details.cached_tokens in responses
    privacy: Privacy | None = None  # personal-information detectors, term lists and their per-tenant actions
    startup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    started: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.models is None:
            self.models = ModelRegistry.single(self.engine)


def create_app(deps: Deps) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for start in deps.startup:
            await start()
        for model in deps.models:  # type: ignore[union-attr]
            await prompt.bounds(model.engine.tokenizer)  # one pass over the vocabulary, before the first request
        try:
            yield
        finally:
            for stop in reversed(deps.shutdown):
                await stop()

    # NOTE: routes read deps from app.state (scope["state"] is Starlette's lifespan state; a request's own is
    # scope["request_state"])
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/ready", routes.ready, methods=["GET"]),
            Route("/openapi.json", routes.openapi, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/admin/profile", routes.profile, methods=["POST"]),
        ],
        middleware=[
            Middleware(
                RequestContext,
                on_complete=deps.on_complete,
                precheck=deps.audit_precheck,
                on_response_start=deps.on_response_start,
            ),
            Middleware(BodyLimit, max_bytes=deps.max_body_bytes),
            Middleware(Auth, verifier=deps.verifier, required_scope=deps.required_scope, guard=deps.auth_guard),
        ],
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_exception_handler,
            Exception: unhandled_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.deps = deps
    return app
