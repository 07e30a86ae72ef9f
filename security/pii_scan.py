"""Every detector and term list over one text: the hits, in original offsets, and what is still undecided.

`scan(text, start, final)` looks at `text[start:]` (what comes before is context for the boundaries only). With
`final` the text is complete and every candidate is decided. Without it (a stream's tail) a candidate that
more text could still change is not reported: a partial match running to the end, a complete one that could
still grow (a 16-digit card that a 17th digit would turn into another number), a tail that begins a term.
`hold` is where the earliest of them starts: text before it is decided and can be released.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from security.pii_detectors import Detector
from security.pii_terms import TermMatcher
from security.pii_text import Normalized, normalize


@dataclass(frozen=True, slots=True)
class Hit:
    start: int  # original offsets
    end: int
    policy: str  # a detector's name or a term list's name
    rank: int  # the scanner's order of policies: ties between detectors go to the lower rank
    label: str  # the placeholder's stem under tokenize


class Scanner:
    """The detectors and term matchers one request uses (a term list's version is fixed for the request)."""

    def __init__(self, detectors: Sequence[Detector], terms: Sequence[tuple[str, TermMatcher]] = ()) -> None:
        self.detectors = tuple(detectors)
        self.terms = tuple(terms)

    @property
    def empty(self) -> bool:
        return not self.detectors and not any(m.count for _, m in self.terms)

    def scan(self, text: str, start: int = 0, final: bool = True) -> tuple[list[Hit], int]:
        norm = normalize(text)
        nstart = _to_normalized(norm, start)
        hits: list[Hit] = []
        nhold = len(norm.text)
        for rank, det in enumerate(self.detectors):
            if final and not det.may_occur(norm.text, nstart):  # (a tail may hold the start of what it needs)
                continue
            found, h = _detect(det, norm.text, nstart, final)
            nhold = min(nhold, h)
            hits.extend(Hit(*norm.span(s, e), det.name, rank, det.label) for s, e in found)
        base = len(self.detectors)
        for i, (name, matcher) in enumerate(self.terms):
            found_terms, h = matcher.find(norm, nstart, final)
            nhold = min(nhold, h)
            hits.extend(Hit(*norm.span(t.start, t.end), name, base + i, "TERM") for t in found_terms)
        hold = len(text) if nhold >= len(norm.text) else norm.span(nhold, nhold)[0]
        return hits, hold


def _to_normalized(norm: Normalized, start: int) -> int:
    """The first normalised index whose character comes from original index >= start."""
    if norm.origin is None or start == 0:
        return start
    return bisect.bisect_left(norm.origin, start, 0, len(norm.text))


def _detect(det: Detector, text: str, start: int, final: bool) -> tuple[list[tuple[int, int]], int]:
    """Validated matches of one detector in text[start:], and where its undecided tail begins."""
    found: list[tuple[int, int]] = []
    core = "id" if "id" in det.pattern.groupindex else 0  # a pattern may match more than the identifier
    if final:
        for m in det.pattern.finditer(text, start):
            if det.validate(m.group(core)):
                found.append(m.span(core))
        return found, len(text)
    for m in det.partial.finditer(text, start, partial=True):
        s = m.start()
        if m.partial:  # the pattern runs into the end of the text: more could complete it
            return found, s if s < len(text) else len(text)
        if det.partial.fullmatch(text, s, partial=True) is not None:  # a complete match more text could extend
            return found, s
        if det.validate(m.group(core)):
            found.append(m.span(core))
    return found, len(text)
