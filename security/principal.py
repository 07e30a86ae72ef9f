from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling: the verified claims of one token, as plain data."""

    subject: str
    tenant: str
    scopes: frozenset[str]
    models: frozenset[str] | None  # None: every model
    tier: str | None  # rate-limit tier named by a claim

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes
