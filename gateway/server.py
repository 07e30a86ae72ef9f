"""The composition root: settings → engine, verifier, TLS, app → uvicorn."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import uvicorn

from audit import Auditor
from engine import AsyncEngine, EngineConfig, EngineError
from engine.parallel.launch import torchrun_rank
from gateway.app import Deps, create_app
from gateway.audit_hook import AuditHook, audit_config
from gateway.auth_guard import FailedAuthLimiter
from gateway.connections import ConnectionLimits, guarded_protocol_class
from gateway.demo import dev_key_spec, ensure_demo_model
from gateway.lifecycle import Server, note_shutdown
from gateway.metrics import Metrics
from gateway.settings import Settings, SettingsError
from gateway.state import RequestState
from security.devpki import DevPKI, ensure_dev_pki
from security.jwt import JWTConfig, JWTVerifier
from security.keys import KeyProviderError, provider_from_spec
from security.manifest import SealError
from security.ratelimit import RateLimitConfig, RateLimiter, RateLimitTier
from security.sealed import SealedFiles, is_sealed
from security.tls import TLSConfig, uvicorn_ssl_kwargs

log = logging.getLogger("tianmen.gateway")

DEV_ISSUER, DEV_AUDIENCE = "tianmen-dev", "tianmen"


class StartupError(RuntimeError):
    """The server cannot start (a bad or tampered model, a wrong key); the message says what to fix."""


def build_engine(settings: Settings) -> AsyncEngine:
    fields = asdict(settings.engine)
    spec, threads = fields.pop("key_provider"), fields.pop("decrypt_threads")
    model = fields.pop("model")
    if model is None:
        model = ensure_demo_model(settings.home)
        spec = spec or dev_key_spec(settings.home)
    try:
        files = None
        if is_sealed(model):
            if spec is None:
                raise SettingsError(f"the model at {model} is sealed: set engine.key_provider to the key that opens it")
            files = SealedFiles(model, provider_from_spec(spec, settings.environ), threads=threads, progress=True)
            log.info("sealed model %s: key %s, manifest sm3 %s", model, files.manifest.key_id, files.digest)
        return AsyncEngine.from_config(EngineConfig(model=model, **fields), files)
    except (SealError, KeyProviderError) as e:
        raise StartupError(f"cannot open the sealed model: {e}") from None
    except (EngineError, ValueError) as e:
        raise StartupError(f"cannot load the model: {e}") from None


def build_verifier(settings: Settings, pki: DevPKI | None) -> JWTVerifier:
    a = settings.auth
    common = dict(
        leeway_s=a.leeway_s,
        tenant_claim=a.tenant_claim,
        scope_claim=a.scope_claim,
        models_claim=a.models_claim,
        tier_claim=a.tier_claim,
        default_tenant=a.default_tenant,
    )
    try:
        if a.external:
            secret = a.hs256_secret_file.read_bytes().strip() if a.hs256_secret_file else None
            return JWTVerifier(
                JWTConfig(
                    jwks_file=a.jwks_file,
                    jwks_url=a.jwks_url,
                    hs256_secret=secret,
                    issuer=a.issuer,
                    audience=a.audience,
                    **common,
                )
            )  # type: ignore[arg-type]
        assert pki is not None
        return JWTVerifier(
            JWTConfig(jwks_file=pki.jwks, issuer=a.issuer or DEV_ISSUER, audience=a.audience or DEV_AUDIENCE, **common)
        )  # type: ignore[arg-type]
    except (OSError, ValueError) as e:
        raise SettingsError(f"auth: {e}") from None


def build_limiter(settings: Settings) -> RateLimiter:
    r = settings.ratelimit
    url = r.redis_url_file.read_text().strip() if r.redis_url_file else r.redis_url
    try:
        tiers = {"default": RateLimitTier(r.requests_per_minute, r.tokens_per_minute, r.max_concurrent)}
        for name, t in (r.tiers or {}).items():
            if not isinstance(t, dict):
                raise ValueError(f"tiers.{name} must be a table")
            tiers[name] = RateLimitTier(**t)
        return RateLimiter(
            RateLimitConfig(
                redis_url=url,
                tiers=tiers,
                tenant_tiers=dict(r.tenant_tiers or {}),
                on_redis_error=r.on_redis_error,  # type: ignore[arg-type]
                lease_ttl_s=r.lease_ttl_s,
            )
        )
    except (OSError, TypeError, ValueError) as e:
        raise SettingsError(f"ratelimit: {e}") from None


def tls_config(settings: Settings, pki: DevPKI | None) -> TLSConfig:
    s = settings.server
    if s.tls_cert is not None and s.tls_key is not None:
        cert, key = s.tls_cert, s.tls_key
    else:
        assert pki is not None
        cert, key = pki.server_cert, pki.server_key
    try:
        return TLSConfig(certfile=Path(cert), keyfile=Path(key), client_ca=s.client_ca)
    except ValueError as e:
        raise SettingsError(f"server: {e}") from None


def needs_dev_pki(settings: Settings) -> bool:
    return not settings.auth.external or settings.server.tls_cert is None


def connection_limits(settings: Settings) -> ConnectionLimits:
    s = settings.server
    return ConnectionLimits(
        max_connections=s.max_connections, header_timeout_s=s.header_timeout_s, shutdown_grace_s=s.shutdown_grace_s
    )


def build_app_and_config(settings: Settings) -> tuple[uvicorn.Config, AsyncEngine]:
    if torchrun_rank() not in (None, 0):  # torchrun: a rank other than 0 only runs its part of the model
        build_engine(settings)  # serves as that rank until rank 0 stops, then exits (SystemExit)
    pki = ensure_dev_pki(settings.home) if needs_dev_pki(settings) else None
    verifier = build_verifier(settings, pki)
    ssl_kwargs = {} if settings.server.insecure_http else uvicorn_ssl_kwargs(tls_config(settings, pki))
    limiter = build_limiter(settings)
    auditor = Auditor(audit_config(settings))
    hook = AuditHook(auditor)
    engine = build_engine(settings)
    metrics = Metrics(engine.model_name, engine.stats, auditor.stats)

    async def on_response_start(scope: dict, state: RequestState) -> None:
        note_shutdown(scope, state)  # a complete record is written here, before the response's first byte
        await hook.opened(scope, state)

    async def on_complete(scope: dict, state: RequestState) -> None:
        note_shutdown(scope, state)
        metrics.observe_request(state)
        await hook(scope, state)

    srv = settings.server
    guard = None
    if srv.auth_failures_per_minute is not None:
        guard = FailedAuthLimiter(srv.auth_failures_per_minute, srv.auth_failure_burst, srv.auth_failure_sources)

    deps = Deps(
        engine=engine,
        verifier=verifier,
        max_body_bytes=settings.server.max_body_bytes,
        required_scope=settings.auth.required_scope,
        limiter=limiter,
        on_complete=on_complete,
        auth_guard=guard,
        cache_salt_per_subject=srv.prefix_cache_per_subject,
        report_cached_tokens=srv.report_cached_tokens,
        on_response_start=on_response_start,
        metrics=metrics,
        admin_scope=settings.auth.admin_scope,
        profile_dir=settings.home / "profiles",
        audit_precheck=hook.check,
        startup=[auditor.start],
        shutdown=[auditor.stop, engine.shutdown, limiter.aclose],
    )
    config = uvicorn.Config(
        create_app(deps),
        host=settings.server.host,
        port=settings.server.port,
        http=guarded_protocol_class(),
        timeout_keep_alive=settings.server.keepalive_timeout_s,  # type: ignore[arg-type]
        ws="none",
        lifespan="on",
        log_level=settings.server.log_level,
        server_header=False,
        **ssl_kwargs,
    )
    return config, engine


def serve(settings: Settings, on_ready: Callable[[], None] | None = None) -> None:
    logging.basicConfig(
        level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.server.insecure_http:
        log.warning(
            "SERVING PLAIN HTTP (--insecure-http): tokens and prompts cross the network unencrypted; "
            "never use this outside a development machine"
        )
    config, _ = build_app_and_config(settings)
    Server(config, on_ready, connection_limits(settings)).run()
