"""Request → audit event: the one place the gateway turns a finished call into an ECS record."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from audit import AuditConfig, AuditEvent, Auditor, AuditUnavailable, generate_keypair
from gateway.settings import Settings, SettingsError
from gateway.state import RequestState

log = logging.getLogger("tianmen.audit")

ACTIONS = {"/v1/chat/completions": "chat-completion", "/v1/completions": "completion", "/v1/models": "list-models"}


def audit_config(settings: Settings) -> AuditConfig:
    a, home = settings.audit, settings.home
    private, public = a.sm2_private_key, a.sm2_public_key
    if private is None:  # dev default: a key pair under home, made once
        keys = home / "audit" / "keys"
        private, public = keys / "sm2.key", keys / "sm2.pub"
        if not private.exists():
            keys.mkdir(mode=0o700, parents=True, exist_ok=True)
            generate_keypair(private, public)
    try:
        return AuditConfig(
            spool_dir=a.spool_dir or home / "audit" / "spool",
            content_policy=a.content_policy,  # type: ignore[arg-type]
            elasticsearch_url=a.elasticsearch_url,
            es_username=a.es_username,
            es_password=_secret(a.es_password_file),
            es_api_key=_secret(a.es_api_key_file),
            es_ca_certs=a.es_ca_certs,
            index_prefix=a.index_prefix,
            retention_days=a.retention_days,
            checkpoint_every=a.checkpoint_every,
            checkpoint_interval_s=a.checkpoint_interval_s,
            sm2_private_key_path=private,
            sm2_public_key_path=public,
            fsync_interval_ms=a.fsync_interval_ms,
            max_spool_bytes=a.max_spool_bytes,
            segment_bytes=max(4096, min(16 << 20, a.max_spool_bytes // 8)),
            writer_id=a.writer_id,
        )
    except (AssertionError, OSError, ValueError) as e:
        raise SettingsError(f"audit: {e}") from None


def _secret(path: Path | None) -> str | None:
    return path.read_text().strip() if path is not None else None


class AuditHook:
    """RequestContext's `on_complete`: one event per request, whatever its outcome."""

    def __init__(self, auditor: Auditor) -> None:
        self.auditor = auditor

    def check(self) -> None:
        self.auditor.check_writable()  # raises AuditUnavailable: refuse before serving

    async def __call__(self, scope: dict[str, Any], state: RequestState) -> None:
        headers = dict(scope.get("headers") or [])
        tls = (scope.get("extensions") or {}).get("tls") or {}
        client = scope.get("client")
        event = AuditEvent(
            request_id=scope["request_id"],
            action=ACTIONS.get(scope["path"], "http-request"),
            status_code=state.status,
            timestamp=datetime.fromtimestamp(state.start, timezone.utc),
            duration_ns=int(state.duration_s * 1e9),
            user_id=state.user,
            tenant=state.tenant,
            source_ip=client[0] if client else None,
            tls_version=tls.get("version"),
            tls_client_subject=tls.get("client_subject"),
            http_method=scope.get("method"),
            url_path=scope.get("path"),
            user_agent=headers.get(b"user-agent", b"").decode("latin-1") or None,
            model=state.model,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens,
            cached_tokens=state.cached_tokens,
            ttft_ms=state.ttft_ms,
            finish_reason=state.finish_reason,
            stream=state.stream,
            ratelimit_decision=state.ratelimit,
            error_type=state.error or state.auth_failure,
            content=self.auditor.content_fields(state.prompt_text, state.response_text)
            if state.prompt_text is not None
            else {},
        )
        try:
            await self.auditor.emit(event.to_dict())
        except AuditUnavailable:
            log.error("audit event for request %s could not be written", scope["request_id"])
