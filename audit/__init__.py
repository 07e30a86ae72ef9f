"""Tamper-evident audit trail: ECS events → SM3 hash chain → fsynced spool → Elasticsearch."""

from __future__ import annotations

from audit.auditor import Auditor, AuditSink
from audit.config import AuditConfig, ContentPolicy
from audit.errors import AuditUnavailable
from audit.events import AuditEvent, content_fields
from audit.search import format_table, parse_since, search
from audit.signer import generate_keypair
from audit.source import AuditSource, ElasticsearchSource, SpoolSource, open_source
from audit.verify import VerifyReport, format_report, verify

__all__ = [
    "AuditConfig",
    "AuditEvent",
    "AuditSink",
    "AuditSource",
    "AuditUnavailable",
    "Auditor",
    "ContentPolicy",
    "ElasticsearchSource",
    "SpoolSource",
    "VerifyReport",
    "content_fields",
    "format_report",
    "format_table",
    "generate_keypair",
    "open_source",
    "parse_since",
    "search",
    "verify",
]
