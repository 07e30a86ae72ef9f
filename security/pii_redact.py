"""Hits + a direction's policy → the rewritten text, what fired (never what matched), and a block.

Overlapping hits are settled so that no character a policy hides shows: hits on the same span keep the
strongest action (then the earlier detector: an 18-digit ID that also passes Luhn is an ID); overlapping
`mask`/`tokenize` hits merge into one span that is hidden whole. `audit` hits change nothing.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from security.pii_policy import STRENGTH, DirectionPolicy, MaskRule
from security.pii_scan import Hit

PLACEHOLDER = re.compile(r"\[[A-Z]{1,16}_[0-9]{1,9}\]")


class Vault:
    """One request's placeholders: the same value gets the same placeholder; only this request sees them."""

    def __init__(self) -> None:
        self.originals: dict[str, str] = {}  # placeholder → original text
        self._by_value: dict[tuple[str, str], str] = {}
        self._next: Counter[str] = Counter()
        self.longest = 0

    def placeholder(self, label: str, original: str, text: str) -> str:
        key = (label, original)
        if key in self._by_value:
            return self._by_value[key]
        while True:  # never one the client's own text already contains: it would be "restored" wrongly
            self._next[label] += 1
            p = f"[{label}_{self._next[label]}]"
            if p not in text:
                break
        self._by_value[key] = p
        self.originals[p] = original
        self.longest = max(self.longest, len(p))
        return p

    def restore(self, text: str) -> str:
        if not self.originals or "[" not in text:
            return text
        return PLACEHOLDER.sub(lambda m: self.originals.get(m.group(), m.group()), text)

    def begins_placeholder(self, tail: str) -> bool:
        """Is `tail` (from a "[") a proper beginning of one of the placeholders?"""
        return any(p.startswith(tail) and p != tail for p in self.originals)


@dataclass
class Redaction:
    text: str
    fired: Counter[tuple[str, str]] = field(default_factory=Counter)  # (policy, action taken) → count
    blocked: str | None = None  # the policy that blocked
    cut: int | None = None  # with `blocked`: where the text stops (original offsets; before any hidden span)


def redact(text: str, hits: Sequence[Hit], policy: DirectionPolicy, vault: Vault | None) -> Redaction:
    actions = policy.actions
    best: dict[tuple[int, int], Hit] = {}
    for h in hits:  # one hit per span: the strongest action, then the earliest detector
        other = best.get((h.start, h.end))
        key = (-STRENGTH[actions[h.policy]], h.rank)
        if other is None or key < (-STRENGTH[actions[other.policy]], other.rank):
            best[(h.start, h.end)] = h
    kept = sorted(best.values(), key=lambda h: (h.start, -h.end, h.rank))
    out = Redaction(text)
    blocks = [h for h in kept if actions[h.policy] == "block"]
    limit = len(text)
    if blocks:
        first = min(blocks, key=lambda h: (h.start, h.rank))
        out.blocked, limit = first.policy, first.start
        out.fired[(first.policy, "block")] += 1
    spans = _merge([h for h in kept if actions[h.policy] in ("mask", "tokenize")])
    limit = min([limit, *(s for s, e, _ in spans if s < limit < e)])  # never half of a hidden span
    parts: list[str] = []
    pos = 0
    for start, end, members in spans:
        if start >= limit:
            break
        action = "tokenize" if any(actions[m.policy] == "tokenize" for m in members) else "mask"
        lead = min((m for m in members if actions[m.policy] == action), key=lambda m: m.rank)
        original = text[start:end]
        if action == "tokenize" and vault is not None:
            replacement = vault.placeholder(lead.label, original, text)
        else:
            action = "mask"
            replacement = mask(original, policy.mask.get(lead.policy, MaskRule(0, 0)))
        parts += [text[pos:start], replacement]
        pos = end
        for m in members:
            out.fired[(m.policy, action)] += 1
    parts.append(text[pos:limit])
    for h in kept:
        if actions[h.policy] == "audit" and h.start < limit:
            out.fired[(h.policy, "audit")] += 1
    out.text = "".join(parts)
    if out.blocked is not None:
        out.cut = limit
    return out


def _merge(hits: list[Hit]) -> list[tuple[int, int, list[Hit]]]:
    spans: list[tuple[int, int, list[Hit]]] = []
    for h in sorted(hits, key=lambda h: h.start):
        if spans and h.start < spans[-1][1]:
            s, e, members = spans[-1]
            spans[-1] = (s, max(e, h.end), [*members, h])
        else:
            spans.append((h.start, h.end, [h]))
    return spans


def mask(original: str, rule: MaskRule) -> str:
    """Star every letter and digit but the first `keep_first` and last `keep_last` (separators stay); if those
    would leave nothing hidden, star them all."""
    positions = [i for i, ch in enumerate(original) if ch.isalnum()]
    keep = rule.keep_first + rule.keep_last
    shown = set() if keep >= len(positions) else {*positions[: rule.keep_first]}
    if keep < len(positions) and rule.keep_last:
        shown |= set(positions[-rule.keep_last :])
    return "".join(ch if (i in shown or not ch.isalnum()) else "*" for i, ch in enumerate(original))
