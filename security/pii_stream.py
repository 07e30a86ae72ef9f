"""A completion's text through its policy as it streams, and the prompt's placeholders put back.

`StreamFilter.feed(delta)` returns what can be sent now. It holds back only what is undecided (see
security.pii_scan: the shortest tail that could still become a match) and never the middle of a hit: what
it releases is final, rewritten exactly as `redact` rewrites the whole text, so the stream's pieces joined
equal the filtered whole answer. `finish()` decides and releases the rest. A `block` ends the filter: the text
before the blocked identifier is released (nothing of it), the rest is dropped.

`Restorer` turns the placeholders of a `tokenize`d prompt back into the originals as the answer streams; a
"[" that could still become one of this request's placeholders waits for the next delta.
"""

from __future__ import annotations

from collections import Counter

from security.pii_policy import DirectionPolicy
from security.pii_redact import Redaction, Vault, redact
from security.pii_scan import Scanner

CONTEXT_CHARS = 8  # released text kept for the boundaries of the next match (no letter or digit glued on)
MAX_HOLD_CHARS = 1024  # a tail longer than this is decided as if the text ended (only an unbounded configured
# passport pattern can make one: every built-in pattern and term is far shorter); LIMITS.md


class StreamFilter:
    def __init__(self, scanner: Scanner, policy: DirectionPolicy) -> None:
        self.scanner, self.policy = scanner, policy
        self.context = ""
        self.pending = ""
        self.fired: Counter[tuple[str, str]] = Counter()
        self.blocked: str | None = None
        self.released: list[str] = []  # everything sent, rewritten: the audit trail's copy of the answer

    @property
    def held(self) -> int:
        return len(self.pending)

    def take_fired(self) -> Counter[tuple[str, str]]:
        """What fired since the last call (the gateway counts as it goes: a cut stream keeps its counts)."""
        fired, self.fired = self.fired, Counter()
        return fired

    def feed(self, delta: str) -> str:
        if self.blocked is not None or not delta:
            return ""
        self.pending += delta
        return self._release(final=len(self.pending) > MAX_HOLD_CHARS)

    def finish(self) -> str:
        if self.blocked is not None or not self.pending:
            return ""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        buf = self.context + self.pending
        base = len(self.context)
        hits, hold = self.scanner.scan(buf, base, final)
        cut = hold
        moved = True
        while moved:  # never release part of a hit: the cut moves back to its start
            moved = False
            for h in hits:
                if h.start < cut < h.end:
                    cut, moved = h.start, True
        if cut <= base:
            return ""
        decided = [h for h in hits if h.end <= cut]
        segment = buf[base:cut]
        shifted = [type(h)(h.start - base, h.end - base, h.policy, h.rank, h.label) for h in decided]
        r: Redaction = redact(segment, shifted, self.policy, None)
        self.fired.update(r.fired)
        if r.blocked is not None:
            self.blocked = r.blocked
            self.pending = ""
            self.released.append(r.text)
            return r.text
        self.context = buf[max(0, cut - CONTEXT_CHARS) : cut]
        self.pending = buf[cut:]
        self.released.append(r.text)
        return r.text

    @property
    def text(self) -> str:
        return "".join(self.released)


class Restorer:
    """Placeholders → originals, across deltas."""

    def __init__(self, vault: Vault) -> None:
        self.vault = vault
        self.pending = ""

    def feed(self, delta: str) -> str:
        buf = self.pending + delta
        if not self.vault.originals:
            self.pending = ""
            return buf
        i = buf.rfind("[")
        if i >= 0 and len(buf) - i < self.vault.longest and self.vault.begins_placeholder(buf[i:]):
            self.pending = buf[i:]
            buf = buf[:i]
        else:
            self.pending = ""
        return self.vault.restore(buf)

    def finish(self) -> str:
        out, self.pending = self.vault.restore(self.pending), ""
        return out
