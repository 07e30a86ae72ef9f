"""Settings: one TOML file plus TIANMEN_* environment overrides, read once and validated.

`TIANMEN_<SECTION>_<KEY>` overrides `[section] key` (e.g. TIANMEN_SERVER_PORT=9443); `TIANMEN_HOME`
overrides `home`. `[[models]]` tables (several served models) and `[aliases]` have no variables of their own:
TIANMEN_ENGINE_* set the `[engine]` defaults they inherit. This is the only module that reads os.environ.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


HTTP_CHOICES = ("auto", "h11", "httptools")  # uvicorn.config.HTTP_PROTOCOLS, less what the gate does not handle
LOOP_CHOICES = ("auto", "asyncio", "uvloop")  # uvicorn.config.LOOP_FACTORIES, likewise


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names it."""


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8443
    insecure_http: bool = False  # dev only: plain HTTP, logged loudly at every start
    tls_cert: Path | None = None  # None: the dev certificate under home/pki
    tls_key: Path | None = None
    client_ca: Path | None = None  # set: mTLS
    max_body_bytes: int = 1 << 20
    max_concurrent_streams: int = 256
    log_level: str = "info"
    # failed authentications per source IP (in process, per replica); beyond them 429 instead of 401; None: off
    auth_failures_per_minute: int | None = 60
    auth_failure_burst: int = 20
    auth_failure_sources: int = 65536  # source IPs remembered (LRU): bounds the memory a flood can take
    prefix_cache_per_subject: bool = False  # True: only the same user shares cached prompt prefixes (else tenant)
    report_cached_tokens: bool = True  # False: omit usage.prompt_tokens_details.cached_tokens
    header_timeout_s: float = 10.0  # accept (or a keep-alive request's first byte) to complete headers, TLS included
    keepalive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1000  # open connections, handshaking ones included; beyond it new ones are closed at once
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long, then they are cut
    # uvicorn's parts: auto picks httptools (C HTTP parser) and uvloop when installed (they are dependencies),
    # else h11 and asyncio's own loop, which cost several times the CPU per request
    http: str = "auto"  # auto | h11 | httptools
    loop: str = "auto"  # auto | asyncio | uvloop
    # the models' planned weights + KV caches may take at most this much of a device; None: what it has free
    max_model_memory_bytes: int | None = None


@dataclass
class AuthSettings:
    jwks_file: Path | None = None  # None (and no jwks_url): the dev key set under home/pki
    jwks_url: str | None = None
    hs256_secret_file: Path | None = None
    issuer: str | None = None
    audience: str | None = None
    leeway_s: int = 30
    tenant_claim: str = "tenant"
    scope_claim: str = "scope"
    models_claim: str = "models"
    tier_claim: str = "tier"
    default_tenant: str | None = None
    required_scope: str | None = None  # e.g. "inference": a token without it gets 403
    admin_scope: str = "admin"
    # external mode needs issuer and audience (a token of another IdP or app is refused); only an IdP that
    # issues tokens without them may switch the check off, explicitly
    allow_missing_issuer: bool = False
    allow_missing_audience: bool = False

    @property
    def external(self) -> bool:
        return self.jwks_file is not None or self.jwks_url is not None or self.hs256_secret_file is not None


@dataclass
class EngineSettings:
    model: Path | None = None  # None: the demo model, imported into home/models on first run
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 4096
    long_prefill_token_threshold: int = 512  # while others run or wait, a prompt's prefill chunk per step (0: off)
    # while others run or wait, all prefill chunks of a step (0: off); measured on a busy Zen 4 with 16 streams:
    # TTFT p50 2,851 -> 1,403 ms; the engine's own default (offline batches) is off
    max_prefill_tokens_per_step: int = 1024
    max_model_len: int = 2048
    block_size: int = 16
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    max_waiting: int = 1024
    num_threads: int | None = None
    keep_freed_memory: bool = True
    huge_pages: bool = True  # a model larger than half the last-level cache moves to 2 MiB pages once loaded
    warm_start: bool = True  # the largest step once at start, on placeholders: the first requests do not pay for it
    compact_weights: bool = True
    cpu_kernels: bool = True
    gemm_path: str = "auto"  # auto: measured per weight shape on this CPU; onednn|torch|bf16mm|amxmm|wbf16 forces one
    gemm_layouts: int = 2  # at most this many packed copies of one weight
    decode_program: str = "auto"  # auto: a decode step as one C call where measured faster | program | layers
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks the model is split over (local worker processes, or torchrun's ranks)
    enable_expert_parallel: bool = False  # DeepSeek MoE: routed experts spread over the ranks
    data_parallel_size: int = 1  # engine replicas behind one front
    distributed_timeout_s: float = 120.0  # a collective waiting longer fails the engine
    # sealed models: file:PATH | env:VAR | pkcs11:module=...;token=...;key=...;pin-file=...
    key_provider: str | None = None
    decrypt_threads: int | None = None
    # the model's tool-call format: auto (from its vocabulary and chat template) | hermes | llama3_json | mistral |
    # deepseek_v3 (gateway.tools.parsers)
    tool_call_parser: str = "auto"


@dataclass
class RateLimitSettings:
    redis_url: str | None = None  # None: an in-process limiter (one replica)
    redis_url_file: Path | None = None  # the URL (with its password) from a secret file instead
    on_redis_error: str = "closed"  # closed: 503 while Redis is down; open: local limits, logged
    # the default tier, per subject; [ratelimit.tiers.NAME] tables add tiers a token's tier claim may name
    requests_per_minute: int | None = 1200
    tokens_per_minute: int | None = 1_000_000
    max_concurrent: int | None = 64
    lease_ttl_s: float = 600.0
    tiers: dict | None = None  # {name: {requests_per_minute, tokens_per_minute, max_concurrent}}
    tenant_tiers: dict | None = None  # {tenant: tier name}: limits shared by the whole tenant


@dataclass
class AuditSettings:
    spool_dir: Path | None = None  # None: home/audit/spool; one directory per gateway process
    content_policy: str = "sm3"  # none | sm3 (digests of prompt and response) | full (content in the event)
    elasticsearch_url: str | None = None  # None: the spool alone is the trail
    es_username: str | None = None
    es_password_file: Path | None = None
    es_api_key_file: Path | None = None
    es_ca_certs: Path | None = None
    index_prefix: str = "tianmen-audit"
    retention_days: int = 180  # China's minimum for network logs is six months
    checkpoint_every: int = 1000
    checkpoint_interval_s: float = 60.0
    sm2_private_key: Path | None = None  # None: a dev key pair generated under home/audit/keys
    sm2_public_key: Path | None = None
    fsync_interval_ms: float = 50.0
    max_spool_bytes: int = 1 << 30
    writer_id: str | None = None
    ship_batch_bytes: int = 8 << 20  # one bulk request's body at most; larger batches are split
    quarantine_max_bytes: int = 64 << 20  # events Elasticsearch refuses for good (spool_dir/quarantine*.jsonl)
    recover_scan_bytes: int = 64 << 20  # at start, the spool tail searched for streams a crash left open


@dataclass
class PrivacySettings:
    """Personal-information detectors and term lists, and what each does per tenant (see gateway.privacy)."""

    passport_pattern: str | None = None  # None: the PRC ordinary passport (security.pii_detectors)
    term_lists: dict | None = None  # {name: path}: UTF-8, one term per line, reloaded when the file changes
    terms_check_interval_s: float = 2.0  # how often the term files are looked at
    default: dict | None = None  # {prompt: {policy: action}, completion: {...}}; "*" names every policy
    tenants: dict | None = None  # {tenant: {prompt: {...}, completion: {...}}} laid over default
    mask: dict | None = None  # {policy: [keep_first, keep_last]}


@dataclass
class WarmupPrompt:
    """A prefix every call of an application repeats, prefilled at start and pinned in its tenants' prefix cache."""

    tenants: list[str]
    system: str | None = None  # a system prompt, as the chat template renders it ahead of the conversation
    messages: list[dict[str, str]] | None = None  # leading chat messages (system prompt, few-shot examples)
    prompt: str | None = None  # a /v1/completions prompt's leading text


@dataclass
class ModelSettings:
    """One served model: a `[[models]]` table, or the one-model case built from [engine]."""

    name: str | None  # what clients send as `model`; None (one-model case only): the directory's name
    engine: EngineSettings  # the table's knobs over [engine]'s; engine.model is the path (None: the demo model)
    warmup_prompts: list[WarmupPrompt] = field(default_factory=list)
    ratelimit: dict | None = None  # {requests_per_minute, ..., tiers: {name: {...}}}: per subject, on this model


MODEL_KEYS = ("name", "path", "warmup_prompts", "warmup_tenants", "ratelimit")  # besides [engine]'s knobs


@dataclass
class Settings:
    home: Path = Path(".tianmen")
    server: ServerSettings = field(default_factory=ServerSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    ratelimit: RateLimitSettings = field(default_factory=RateLimitSettings)
    audit: AuditSettings = field(default_factory=AuditSettings)
    models: list[ModelSettings] = field(default_factory=list)  # [[models]]; empty: the one model of [engine]
    aliases: dict[str, str] = field(default_factory=dict)  # [aliases]: a name clients may send -> a served model
    privacy: PrivacySettings = field(default_factory=PrivacySettings)
    environ: dict[str, str] = field(default_factory=dict, repr=False)  # for env: key providers

    @property
    def pki_dir(self) -> Path:
        return self.home / "pki"

    def served_models(self) -> list[ModelSettings]:
        """Every model to serve, in order; without [[models]] tables, the one model of [engine]."""
        if self.models:
            return self.models
        return [ModelSettings(self.engine.served_model_name, self.engine)]


SECTIONS = {
    f.name: f.type for f in dataclasses.fields(Settings) if f.name not in ("home", "environ", "models", "aliases")
}


def load_settings(config_file: Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    if config_file is not None:
        try:
            raw = tomllib.loads(Path(config_file).read_text())
        except FileNotFoundError:
            raise SettingsError(f"config file {config_file} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"config file {config_file}: {e}") from None
    hints = typing.get_type_hints(Settings)
    settings = Settings(environ=dict(environ))
    for key in raw:
        if key not in ("home", "models", "aliases") and key not in SECTIONS:
            raise SettingsError(
                f"unknown setting {key!r} in {config_file}; known: home, {', '.join(SECTIONS)}, models, aliases"
            )
    home = environ.get("TIANMEN_HOME", raw.get("home"))
    if home is not None:
        settings.home = _cast("home", home, Path)
    for section in SECTIONS:
        values = raw.get(section, {})
        if not isinstance(values, dict):
            raise SettingsError(f"[{section}] must be a table")
        target = getattr(settings, section)
        fields = typing.get_type_hints(hints[section])
        for key, value in values.items():
            if key not in fields:
                raise SettingsError(f"unknown setting {section}.{key}; known: {', '.join(fields)}")
            setattr(target, key, _cast(f"{section}.{key}", value, fields[key]))
        prefix = f"TIANMEN_{section.upper()}_"
        for env_key, value in environ.items():
            if env_key.startswith(prefix):
                key = env_key[len(prefix) :].lower()
                if key not in fields:
                    raise SettingsError(f"unknown setting {env_key} (no {section}.{key}); known: {', '.join(fields)}")
                setattr(target, key, _cast(env_key, value, fields[key]))
    settings.models = _models(raw.get("models", []), settings.engine)
    settings.aliases = _cast("aliases", raw.get("aliases", {}), dict)
    _validate(settings)
    _validate_models(settings)
    return settings


def _models(tables: Any, defaults: EngineSettings) -> list[ModelSettings]:
    """[[models]] tables: each one's engine knobs over [engine]'s (TIANMEN_ENGINE_* included)."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise SettingsError("models must be an array of tables: [[models]]")
    if tables and (defaults.model is not None or defaults.served_model_name is not None):
        raise SettingsError(
            "engine.model / engine.served_model_name (or TIANMEN_ENGINE_MODEL) name the one model of a single-model "
            "config; with [[models]] tables give each its path and name there"
        )
    knobs = typing.get_type_hints(EngineSettings)
    out = []
    for i, table in enumerate(tables):
        where = f"models[{i}]"
        if not isinstance(table.get("name"), str) or not table["name"]:
            raise SettingsError(f"{where}.name: every [[models]] table needs a name (what clients send as `model`)")
        name = table["name"]
        where = f"models[{name!r}]"
        engine = dataclasses.replace(defaults, served_model_name=name, model=None)
        for key, value in table.items():
            if key == "path":
                engine.model = _cast(f"{where}.path", value, Path)
            elif key in knobs and key not in ("model", "served_model_name"):
                setattr(engine, key, _cast(f"{where}.{key}", value, knobs[key]))
            elif key not in MODEL_KEYS:
                known = ", ".join([*MODEL_KEYS, *(k for k in knobs if k not in ("model", "served_model_name"))])
                raise SettingsError(f"unknown setting {where}.{key}; known: {known}")
        tenants = _strings(f"{where}.warmup_tenants", table.get("warmup_tenants", []))
        warmup = table.get("warmup_prompts", [])
        if not isinstance(warmup, list):
            raise SettingsError(f"{where}.warmup_prompts must be a list")
        ratelimit = table.get("ratelimit")
        if ratelimit is not None and not isinstance(ratelimit, dict):
            raise SettingsError(f"{where}.ratelimit must be a table: [models.ratelimit]")
        prompts = [_warmup(f"{where}.warmup_prompts[{j}]", w, tenants) for j, w in enumerate(warmup)]
        out.append(ModelSettings(name, engine, prompts, ratelimit))
    return out


def _strings(name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SettingsError(f"{name} must be a list of non-empty strings")
    return list(value)


def _warmup(name: str, value: Any, default_tenants: list[str]) -> WarmupPrompt:
    """A string is a system prompt for the model's warmup_tenants; a table says what it is and may name tenants."""
    if isinstance(value, str):
        value = {"system": value}
    if not isinstance(value, dict):
        raise SettingsError(f"{name} must be a string (a system prompt) or a table")
    unknown = set(value) - {"system", "messages", "prompt", "tenants"}
    if unknown:
        raise SettingsError(f"unknown setting {name}.{sorted(unknown)[0]}; known: system, messages, prompt, tenants")
    kinds = [k for k in ("system", "messages", "prompt") if k in value]
    if len(kinds) != 1:
        raise SettingsError(f"{name} needs exactly one of system, messages, prompt")
    tenants = _strings(f"{name}.tenants", value["tenants"]) if "tenants" in value else default_tenants
    if not tenants:
        raise SettingsError(
            f"{name}: name the tenants it is for (tenants = [...], or the model's warmup_tenants): the prefix cache "
            "is partitioned per tenant, so a warmed prefix serves only the tenants it was prefilled for"
        )
    w = WarmupPrompt(tenants)
    if "messages" in value:
        messages = value["messages"]
        ok = isinstance(messages, list) and messages
        ok = ok and all(
            isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
            for m in messages
        )
        if not ok:
            raise SettingsError(f"{name}.messages must be a non-empty list of {{role = ..., content = ...}} tables")
        w.messages = [dict(m) for m in messages]
    elif not isinstance(value[kinds[0]], str) or not value[kinds[0]]:
        raise SettingsError(f"{name}.{kinds[0]} must be a non-empty string")
    else:
        setattr(w, kinds[0], value[kinds[0]])
    return w


def _validate_models(s: Settings) -> None:
    names = [m.name for m in s.models]
    for name in names:
        if len(name) > 256:
            raise SettingsError(f"models: a name has {len(name)} characters; at most 256 (what a request may send)")
        if names.count(name) > 1:
            raise SettingsError(f"models: two [[models]] tables are named {name!r}; names must be unique")
    for alias, target in s.aliases.items():
        if not isinstance(target, str):
            raise SettingsError(f"aliases.{alias}: expected the name of a served model, got {target!r}")
        if alias in names:
            raise SettingsError(f"aliases.{alias}: {alias!r} is already a served model's name")
        if names and target not in names:  # one-model case: its name is known once its path is (at start)
            raise SettingsError(f"aliases.{alias}: no served model is named {target!r}; served: {', '.join(names)}")
        if len(alias) > 256:
            raise SettingsError(f"aliases: an alias has {len(alias)} characters; at most 256")
    for m in s.models:
        if m.warmup_prompts and s.server.prefix_cache_per_subject:
            raise SettingsError(
                f"models[{m.name!r}].warmup_prompts cannot serve anyone with server.prefix_cache_per_subject = true: "
                "the cache is then partitioned per user, and a warm-up is prefilled per tenant"
            )
        if m.warmup_prompts and not m.engine.enable_prefix_caching:
            raise SettingsError(f"models[{m.name!r}].warmup_prompts need enable_prefix_caching = true")


def _cast(name: str, value: Any, typ: Any) -> Any:
    """Cast a TOML value or an environment string to the field's type, or fail naming the setting."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _cast(name, value, next(a for a in args if a is not type(None)))
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            return float(value)
        if typ is Path:
            return Path(str(value)).expanduser()
        if typ is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
        if typ is dict:
            if not isinstance(value, dict):
                raise ValueError
            return value
    except (TypeError, ValueError):
        raise SettingsError(f"{name}: expected {getattr(typ, '__name__', typ)}, got {value!r}") from None
    raise SettingsError(f"{name}: unsupported setting type {typ}")


def _validate(s: Settings) -> None:
    if not 0 < s.server.port < 65536:
        raise SettingsError(f"server.port must be in 1..65535, got {s.server.port}")
    if (s.server.tls_cert is None) != (s.server.tls_key is None):
        raise SettingsError("server.tls_cert and server.tls_key go together: set both or neither")
    if s.server.max_body_bytes < 1024:
        raise SettingsError(f"server.max_body_bytes must be >= 1024, got {s.server.max_body_bytes}")
    if s.server.auth_failures_per_minute is not None and s.server.auth_failures_per_minute < 1:
        raise SettingsError("server.auth_failures_per_minute must be >= 1, or none to turn the limit off")
    if s.server.auth_failure_burst < 1 or s.server.auth_failure_sources < 1:
        raise SettingsError("server.auth_failure_burst and server.auth_failure_sources must be >= 1")
    for name in ("header_timeout_s", "keepalive_timeout_s"):
        if not getattr(s.server, name) > 0:
            raise SettingsError(f"server.{name} must be > 0, got {getattr(s.server, name)}")
    if s.server.max_connections < 1:
        raise SettingsError(f"server.max_connections must be >= 1, got {s.server.max_connections}")
    if s.server.max_model_memory_bytes is not None and s.server.max_model_memory_bytes < 1:
        raise SettingsError("server.max_model_memory_bytes must be >= 1, or none: what the device has free")
    for name, choices in (("http", HTTP_CHOICES), ("loop", LOOP_CHOICES)):
        if getattr(s.server, name) not in choices:
            raise SettingsError(f"server.{name} must be one of {', '.join(choices)}, got {getattr(s.server, name)!r}")
    if s.server.shutdown_grace_s < 0:
        raise SettingsError(f"server.shutdown_grace_s must be >= 0, got {s.server.shutdown_grace_s}")
    if s.auth.jwks_file is not None and s.auth.jwks_url is not None:
        raise SettingsError("auth.jwks_file and auth.jwks_url are exclusive: set one")
    if s.auth.external:
        for name in ("issuer", "audience"):
            if getattr(s.auth, name) is None and not getattr(s.auth, f"allow_missing_{name}"):
                raise SettingsError(
                    f"auth.{name} is required with an external key set (auth.jwks_file / auth.jwks_url / "
                    f"auth.hs256_secret_file): set it to your identity provider's {name}, or set "
                    f"auth.allow_missing_{name} = true if it issues tokens without one"
                )
    if s.audit.content_policy not in ("none", "sm3", "full"):
        raise SettingsError(f"audit.content_policy must be none, sm3 or full, got {s.audit.content_policy!r}")
    if s.ratelimit.on_redis_error not in ("closed", "open"):
        raise SettingsError(f"ratelimit.on_redis_error must be closed or open, got {s.ratelimit.on_redis_error!r}")
    if not s.privacy.terms_check_interval_s > 0:
        raise SettingsError(f"privacy.terms_check_interval_s must be > 0, got {s.privacy.terms_check_interval_s}")
    parsers = ("auto", "hermes", "llama3_json", "mistral", "deepseek_v3")  # gateway.tools.select.CHOICES
    for engine in [s.engine, *(m.engine for m in s.models)]:
        if engine.tool_call_parser not in parsers:
            raise SettingsError(
                f"engine.tool_call_parser must be one of {', '.join(parsers)}, got {engine.tool_call_parser!r}"
            )
    if s.server.log_level not in ("critical", "error", "warning", "info", "debug"):
        raise SettingsError(f"server.log_level must be critical|error|warning|info|debug, got {s.server.log_level!r}")
