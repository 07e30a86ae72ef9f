"""What happens when a detector or term list fires: one action per policy, per direction, per tenant.

Actions: `off` (not run), `audit` (pass, record: the default for everything), `mask` (keep a few characters,
star the rest), `tokenize` (prompts only: a placeholder before the model, the original back in the answer),
`block` (a prompt: refused; a completion: ended with finish_reason content_filter). A tenant's table is laid
over the default table; in each, "*" sets every policy of a direction and named entries override it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["off", "audit", "mask", "tokenize", "block"]
ACTIONS: tuple[Action, ...] = ("off", "audit", "mask", "tokenize", "block")
DIRECTIONS = ("prompt", "completion")
STRENGTH = {"off": 0, "audit": 1, "mask": 2, "tokenize": 3, "block": 4}  # which wins when two hits coincide
MAX_KEEP = 32


@dataclass(frozen=True, slots=True)
class MaskRule:
    keep_first: int
    keep_last: int


@dataclass(frozen=True)
class DirectionPolicy:
    actions: Mapping[str, Action]  # every known policy → its action
    mask: Mapping[str, MaskRule]

    def active(self) -> frozenset[str]:
        return frozenset(name for name, a in self.actions.items() if a != "off")

    @property
    def transforms(self) -> bool:
        """Does any policy change the text (mask, tokenize, block)?"""
        return any(a in ("mask", "tokenize", "block") for a in self.actions.values())


@dataclass(frozen=True)
class TenantPolicy:
    prompt: DirectionPolicy
    completion: DirectionPolicy


class PolicyBook:
    """Every tenant's resolved policy, built once from the config (a ValueError names the bad entry)."""

    def __init__(
        self,
        names: Sequence[str],
        default: Mapping[str, Any] | None = None,
        tenants: Mapping[str, Any] | None = None,
        mask: Mapping[str, Any] | None = None,
        default_keep: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        self.names = tuple(names)
        rules = {n: MaskRule(*(default_keep or {}).get(n, (0, 0))) for n in self.names}
        for name, keep in (mask or {}).items():
            rules[self._known(name, "mask")] = _rule(name, keep)
        self.rules = rules
        base = _table(self.names, "default", default or {}, {d: {n: "audit" for n in self.names} for d in DIRECTIONS})
        self.default = self._policy(base)
        self.tenants: dict[str, TenantPolicy] = {}
        for tenant, table in (tenants or {}).items():
            self.tenants[tenant] = self._policy(_table(self.names, f"tenants.{tenant}", table, base))

    def _known(self, name: str, where: str) -> str:
        if name not in self.names:
            raise ValueError(f"{where}.{name}: no such detector or term list; known: {', '.join(self.names)}")
        return name

    def _policy(self, table: dict[str, dict[str, Action]]) -> TenantPolicy:
        return TenantPolicy(*(DirectionPolicy(table[d], self.rules) for d in DIRECTIONS))

    def for_tenant(self, tenant: str | None) -> TenantPolicy:
        return self.tenants.get(tenant or "", self.default)


def _rule(name: str, keep: Any) -> MaskRule:
    ok = isinstance(keep, list) and len(keep) == 2 and all(type(k) is int and 0 <= k <= MAX_KEEP for k in keep)
    if not ok:
        raise ValueError(f"mask.{name}: expected [keep_first, keep_last], integers in 0..{MAX_KEEP}, got {keep!r}")
    return MaskRule(*keep)


def _table(
    names: Sequence[str], where: str, table: Any, base: Mapping[str, Mapping[str, Action]]
) -> dict[str, dict[str, Action]]:
    """`table` ({prompt: {name: action}, completion: {...}}) laid over `base`."""
    if not isinstance(table, Mapping):
        raise ValueError(f"{where} must be a table with prompt and/or completion")
    out = {d: dict(base[d]) for d in DIRECTIONS}
    for direction, entries in table.items():
        if direction not in DIRECTIONS:
            raise ValueError(f"{where}.{direction}: expected prompt or completion")
        if not isinstance(entries, Mapping):
            raise ValueError(f"{where}.{direction} must be a table of name = action")
        ordered = sorted(entries.items(), key=lambda kv: kv[0] != "*")  # "*" first, named entries over it
        for name, action in ordered:
            at = f"{where}.{direction}.{name}"
            if action not in ACTIONS:
                raise ValueError(f"{at}: expected one of {', '.join(ACTIONS)}, got {action!r}")
            if action == "tokenize" and direction == "completion":
                raise ValueError(f"{at}: tokenize applies to prompts (an answer gets the prompt's originals back)")
            if name == "*":
                out[direction] = dict.fromkeys(names, action)
            elif name in names:
                out[direction][name] = action
            else:
                raise ValueError(f"{at}: no such detector or term list; known: {', '.join(names)}")
    return out
