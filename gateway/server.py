"""The composition root: settings → engine, verifier, TLS, app → uvicorn."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import uvicorn

from audit import Auditor
from engine import AsyncEngine, DirectoryFiles, EngineConfig, EngineError, ModelFiles
from engine.memory import MemoryPlan, available_bytes, format_bytes, plan_memory, resident_bytes
from engine.parallel.launch import torchrun_rank
from engine.step_thread import StepThread
from gateway.app import Deps, create_app
from gateway.audit_hook import AuditHook, audit_config
from gateway.auth_guard import FailedAuthLimiter
from gateway.connections import ConnectionLimits, guarded_protocol_class
from gateway.demo import dev_key_spec, ensure_demo_model
from gateway.lifecycle import Server, note_shutdown
from gateway.metrics import Metrics
from gateway.models import ModelRegistry, ServedModel
from gateway.privacy import build_privacy
from gateway.settings import ModelSettings, Settings, SettingsError
from gateway.state import RequestState
from gateway.warmup import WarmupError, warm_up
from security.devpki import DevPKI, ensure_dev_pki
from security.jwt import JWTConfig, JWTVerifier
from security.keys import KeyProviderError
from security.manifest import SealError
from security.ratelimit import RateLimitConfig, RateLimiter, RateLimitTier
from security.sealed import SealedFiles, is_sealed
from security.tls import TLSConfig, uvicorn_ssl_kwargs

log = logging.getLogger("tianmen.gateway")

DEV_ISSUER, DEV_AUDIENCE = "tianmen-dev", "tianmen"


class StartupError(RuntimeError):
    """The server cannot start (a bad or tampered model, a wrong key); the message says what to fix."""


@dataclass
class _Opened:
    """A model whose files are open and whose config is checked, not yet loaded."""

    spec: ModelSettings
    config: EngineConfig
    files: ModelFiles | None

    @property
    def name(self) -> str:
        return str(self.config.served_model_name)


def _open(settings: Settings, spec: ModelSettings) -> _Opened:
    fields = asdict(spec.engine)
    key, threads = fields.pop("key_provider"), fields.pop("decrypt_threads")
    fields.pop("tool_call_parser")  # the gateway's (gateway.tools.select), not the engine's
    model = fields.pop("model")
    if model is None:
        model = ensure_demo_model(settings.home)
        key = key or dev_key_spec(settings.home)
    name = spec.name or Path(model).name
    try:
        files = None
        if is_sealed(model):
            if key is None:
                raise SettingsError(f"model {name!r}: {model} is sealed: set key_provider to the key that opens it")
            # from a spec, so tensor-parallel workers it spawns can reopen it themselves
            files = SealedFiles.from_spec(model, key, settings.environ, threads=threads, progress=True)
            log.info("model %s is sealed: key %s, manifest sm3 %s", name, files.manifest.key_id, files.digest)
        return _Opened(spec, EngineConfig(model=model, **fields), files)
    except (SealError, KeyProviderError) as e:
        raise StartupError(f"model {name!r}: cannot open the sealed model: {e}") from None
    except (EngineError, ValueError) as e:
        raise StartupError(f"model {name!r}: cannot load the model: {e}") from None


def check_memory(plans: dict[str, MemoryPlan], limit: int | None) -> None:
    """Refuse to start when the models' planned weights + KV caches exceed what their device has."""
    by_device: dict[str, dict[str, MemoryPlan]] = {}
    for name, plan in plans.items():
        by_device.setdefault(plan.device, {})[name] = plan
    for device, group in by_device.items():
        total = sum(p.total_bytes for p in group.values())
        have = limit if limit is not None else available_bytes(device)
        if have is None or total <= have:
            continue
        sizes = "; ".join(
            f"{name}: {format_bytes(p.weights_bytes)} weights + {format_bytes(p.kv_bytes)} KV cache"
            for name, p in group.items()
        )
        source = "server.max_model_memory_bytes" if limit is not None else "free"
        raise StartupError(
            f"the models do not fit in {device} memory: {sizes}; {format_bytes(total)} in all, but "
            f"{format_bytes(have)} is {source}. Lower kv_cache_bytes (or max_num_seqs, max_model_len), quantize, "
            "or serve fewer models"
        )


def build_models(settings: Settings) -> ModelRegistry:
    """Every configured model, loaded and warmed up, or a StartupError naming the one that failed (and none left
    running: no partial server)."""
    opened = [_open(settings, spec) for spec in settings.served_models()]
    names = [o.name for o in opened]
    if len(set(names)) != len(names):
        raise StartupError(f"two models are served as {sorted({n for n in names if names.count(n) > 1})}")
    plans: dict[str, MemoryPlan] = {}
    for o in opened:
        try:
            plans[o.name] = plan_memory(o.config, o.files or DirectoryFiles(o.config.model))
        except (EngineError, ValueError) as e:
            raise StartupError(f"model {o.name!r}: cannot load the model: {e}") from None
    check_memory(plans, settings.server.max_model_memory_bytes)
    served: list[ServedModel] = []
    # NOTE: models on the CPU share one step thread, their steps taking turns: each engine's own thread would
    # bring its own OpenMP pool, and with more OpenMP threads than CPUs every step ran ~1.5x slower, even while
    # the other models were idle (engine.step_thread)
    on_cpu = [o.name for o in opened if o.config.torch_device.type == "cpu"]
    shared = StepThread() if len(on_cpu) > 1 else None
    try:
        for o in opened:
            engine = _load(o, plans[o.name], shared if o.name in on_cpu else None)
            served.append(ServedModel(o.name, engine, tool_call_parser=o.spec.engine.tool_call_parser))
    except BaseException:
        _stop([m.engine for m in served])
        if shared is not None:
            shared.finish()
            shared.join(30)  # no partial server: the thread is gone too
        raise
    if shared is not None:
        shared.finish()  # it ends with the last of its engines
    try:
        return ModelRegistry(served, settings.aliases)
    except ValueError as e:  # an alias of the one-model case, whose model's name was known only now
        _stop([m.engine for m in served])
        raise StartupError(f"aliases: {e}") from None


def _load(o: _Opened, plan: MemoryPlan, thread: StepThread | None) -> AsyncEngine:
    before = resident_bytes()
    try:
        engine = AsyncEngine.from_config(o.config, o.files, thread=thread)
    except (SealError, KeyProviderError) as e:
        raise StartupError(f"model {o.name!r}: cannot open the sealed model: {e}") from None
    except (EngineError, ValueError) as e:
        raise StartupError(f"model {o.name!r}: cannot load the model: {e}") from None
    try:
        pinned = warm_up(engine, o.spec.warmup_prompts)
    except WarmupError as e:
        _stop([engine])
        raise StartupError(f"model {o.name!r}: {e}") from None
    after = resident_bytes()
    grew = f", resident +{format_bytes(after - before)} after loading" if before and after else ""
    log.info(
        "model %s on %s: %s weights + %s KV cache (%d blocks)%s; %d warm-up tokens pinned",
        o.name,
        plan.device,
        format_bytes(plan.weights_bytes),
        format_bytes(plan.kv_bytes),
        plan.kv_blocks,
        grew,
        pinned,
    )
    return engine


def _stop(engines: list[AsyncEngine]) -> None:
    for engine in engines:
        asyncio.run(engine.shutdown())


def build_engine(settings: Settings) -> AsyncEngine:
    """The first configured model's engine (callers that serve one model)."""
    return build_models(settings).first.engine


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
        tiers.update(_tiers(r.tiers or {}))
        model_tiers = {m.name: _model_tiers(m) for m in settings.models if m.ratelimit is not None}
        return RateLimiter(
            RateLimitConfig(
                redis_url=url,
                tiers=tiers,
                tenant_tiers=dict(r.tenant_tiers or {}),
                on_redis_error=r.on_redis_error,  # type: ignore[arg-type]
                lease_ttl_s=r.lease_ttl_s,
                model_tiers=model_tiers,  # type: ignore[arg-type]
            )
        )
    except (OSError, TypeError, ValueError) as e:
        raise SettingsError(f"ratelimit: {e}") from None


def _tiers(tables: dict, where: str = "tiers") -> dict[str, RateLimitTier]:
    out = {}
    for name, t in tables.items():
        if not isinstance(t, dict):
            raise ValueError(f"{where}.{name} must be a table")
        out[name] = RateLimitTier(**t)
    return out


def _model_tiers(m: ModelSettings) -> dict[str, RateLimitTier]:
    """[models.ratelimit]: its own keys are the model's default tier, [models.ratelimit.tiers.NAME] the others."""
    table = dict(m.ratelimit or {})
    named = table.pop("tiers", {})
    if not isinstance(named, dict):
        raise ValueError(f"models[{m.name!r}].ratelimit.tiers must be a table")
    try:
        return {"default": RateLimitTier(**table), **_tiers(named, f"models[{m.name!r}].ratelimit.tiers")}
    except TypeError as e:
        raise ValueError(f"models[{m.name!r}].ratelimit: {e}") from None


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
    privacy = build_privacy(settings.privacy)
    auditor = Auditor(audit_config(settings))
    hook = AuditHook(auditor)
    models = build_models(settings)
    engine = models.first.engine
    metrics = Metrics({m.name: m.engine.stats for m in models}, auditor.stats)

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
        models=models,
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
        privacy=privacy,
        startup=[auditor.start, privacy.start],
        shutdown=[privacy.stop, auditor.stop, *(m.engine.shutdown for m in models), limiter.aclose],
    )
    config = uvicorn.Config(
        create_app(deps),
        host=settings.server.host,
        port=settings.server.port,
        http=guarded_protocol_class(settings.server.http),  # type: ignore[arg-type]
        loop=settings.server.loop,
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
