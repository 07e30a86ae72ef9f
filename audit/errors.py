from __future__ import annotations


class AuditUnavailable(Exception):
    """The event cannot be made durable (spool full, unwritable, or the auditor is stopped).

    The gateway answers 503: no request is served without its audit event."""
