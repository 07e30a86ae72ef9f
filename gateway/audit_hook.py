"""Request → audit records: the one place the gateway turns a call into ECS records, durable before its first byte."""

from __future__ import annotations

import logging
import time
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
            ship_batch_bytes=a.ship_batch_bytes,
            quarantine_max_bytes=a.quarantine_max_bytes,
            recover_scan_bytes=a.recover_scan_bytes,
        )
    except (AssertionError, OSError, ValueError) as e:
        raise SettingsError(f"audit: {e}") from None


def _secret(path: Path | None) -> str | None:
    return path.read_text().strip() if path is not None else None


class AuditHook:
    """No served request without a durable record. `opened` runs at response start, before the first
    byte: a non-streamed response's complete event is known then and written; a streamed one gets an
    opening record, and `__call__` (the end of the request) writes its closing record. A request that
    never started a response (the client left first) is written at the end."""

    def __init__(self, auditor: Auditor) -> None:
        self.auditor = auditor

    def check(self) -> None:
        self.auditor.check_writable()  # raises AuditUnavailable: refuse before serving

    async def opened(self, scope: dict[str, Any], state: RequestState) -> None:
        """Returns once the record is fsynced in the spool; raises AuditUnavailable (answer 503)."""
        phase = "open" if state.streaming else "complete"
        if phase == "complete":
            state.duration_s = time.time() - state.start
        await self.auditor.emit(self.event(scope, state, phase).to_dict())
        state.audit_record = phase

    async def __call__(self, scope: dict[str, Any], state: RequestState) -> None:
        if state.audit_record == "complete":
            return
        phase = "close" if state.audit_record == "open" else "complete"
        try:
            await self.auditor.emit(self.event(scope, state, phase).to_dict())
        except AuditUnavailable:
            log.error("audit %s record for request %s could not be written", phase, state.request_id)

    def event(self, scope: dict[str, Any], state: RequestState, phase: str) -> AuditEvent:
        headers = dict(scope.get("headers") or [])
        tls = (scope.get("extensions") or {}).get("tls") or {}
        client = scope.get("client")
        return AuditEvent(
            request_id=state.request_id,
            action=ACTIONS.get(scope["path"], "http-request"),
            status_code=state.status,
            outcome="unknown" if phase == "open" else None,  # a stream's outcome is known at its end
            timestamp=datetime.fromtimestamp(state.start, timezone.utc),
            duration_ns=None if phase == "open" else int(state.duration_s * 1e9),
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
            phase=phase,
            policy_hits=[
                {"direction": d, "policy": p, "action": a, "count": n} for (d, p, a), n in state.policy_hits.items()
            ],
            schema_constrained=state.constrained,
            tool_calls=None if phase == "open" else state.tool_calls,
            content=self.auditor.content_fields(state.prompt_text, None if phase == "open" else state.response_text)
            if state.prompt_text is not None
            else {},
        )
