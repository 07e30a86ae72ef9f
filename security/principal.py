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

    def may_use_any(self, names: tuple[str, ...] | list[str]) -> bool:
        """A model known by several names (its served name, its aliases): the token naming any one of them."""
        return self.models is None or any(n in self.models for n in names)

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes
