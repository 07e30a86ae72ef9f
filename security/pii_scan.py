"""Every detector and term list over one text: the hits, in original offsets, and what is still undecided.

`scan(text, start, final)` looks at `text[start:]` (what comes before is context for the boundaries only). With
`final` the text is complete and every candidate is decided. Without it (a stream's tail) a candidate that
more text could still change is not reported: a partial match running to the end, a complete one that could
still grow (a 16-digit card that a 17th digit would turn into another number), a tail that begins a term.
`hold` is where the earliest of them starts: text before it is decided and can be released.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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
        self._zoned = all(d.zone is not None for d in self.detectors)  # every detector needs a digit or an "@"

    @property
    def empty(self) -> bool:
        return not self.detectors and not any(m.count for _, m in self.terms)

    def scan(self, text: str, start: int = 0, final: bool = True) -> tuple[list[Hit], int]:
        norm = normalize(text)
        nstart = norm.to_normalized(start)
        hits: list[Hit] = []
        nhold = len(norm.text)
        zones = _Zones(norm, nstart) if final else None
        if zones is not None and zones.bare and self._zoned and not self.terms:
            return [], len(text)  # the usual prompt: no digit and no "@", so nothing any detector could match
        for rank, det in enumerate(self.detectors):
            if zones is not None and det.zone is not None:
                found, h = [], len(norm.text)
                for a, b in zones.around(det):
                    found += _detect(det, norm.text, a, True, b)[0]
            else:  # a stream's tail is short: all of it, with partial matching
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


SHORT_TEXT = 4096  # up to this many characters the anchors are found by a regex, past it by numpy
_DIGIT_RUN = re.compile("[0-9]+")  # the normalized text: every decimal digit a detector reads is ASCII here
_AT = re.compile("@")
MANY_ZONES = 64  # beyond this many zones one pass over the whole text costs fewer calls than a pass per zone


class _Zones:
    """The runs of digits and the "@"s of one text, found once, and each zone shape's merged zones.

    Few anchors (the usual prompt): plain Python, and a short text is searched with one regex (numpy's per-call
    cost would dominate). Many (a text made of numbers, an adversary's "1 1 1 …"): vectorised, and past
    MANY_ZONES the whole text is one zone, so the cost stays linear in the text with a small constant whatever
    it holds."""

    def __init__(self, norm: Normalized, start: int) -> None:
        self.text, self.start = norm.text, start
        self._merged: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        if len(self.text) <= SHORT_TEXT:
            runs = [m.span() for m in _DIGIT_RUN.finditer(self.text)]
            self.run_start: np.ndarray | list[int] = [a for a, _ in runs]
            self.run_end: np.ndarray | list[int] = [b for _, b in runs]
            self.ats: np.ndarray | list[int] = [m.start() for m in _AT.finditer(self.text)]
            self.bare = not runs and not self.ats
            return
        cps = norm.cps
        digit = np.zeros(len(cps) + 2, dtype=np.int8)
        digit[1:-1] = (cps >= 48) & (cps <= 57)
        edges = np.diff(digit)
        self.run_start, self.run_end = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        self.ats = np.flatnonzero(cps == 64) if "@" in self.text else np.zeros(0, dtype=np.int64)
        self.bare = not len(self.run_start) and not len(self.ats)

    def _merge(self, anchors: np.ndarray | list[int], before: int, after: int) -> list[tuple[int, int]]:
        n = len(self.text)
        if len(anchors) <= MANY_ZONES:
            merged: list[tuple[int, int]] = []
            for s in anchors.tolist() if isinstance(anchors, np.ndarray) else anchors:
                lo, hi = max(self.start, s - before), min(n, s + after)
                if merged and lo <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
                else:
                    merged.append((lo, hi))
            return merged
        anchors = np.asarray(anchors, dtype=np.int64)
        lo = np.maximum(anchors - before, self.start)
        hi = np.maximum.accumulate(np.minimum(anchors + after, n))
        breaks = np.flatnonzero(lo[1:] > hi[:-1])
        if len(breaks) >= MANY_ZONES:
            return [(max(self.start, int(lo[0])), n)]
        starts = lo[np.concatenate(([0], breaks + 1))].tolist()
        ends = hi[np.concatenate((breaks, [len(hi) - 1]))].tolist()
        return list(zip(starts, ends))

    def around(self, det: Detector) -> list[tuple[int, int]]:
        zone = det.zone
        assert zone is not None
        key = (zone.min_digits, zone.before, zone.after)
        merged = self._merged.get(key)
        if merged is None:  # detectors with the same zone shape share it
            if zone.min_digits and isinstance(self.run_start, list):
                anchors = [a for a, b in zip(self.run_start, self.run_end) if b - a >= zone.min_digits]
            elif zone.min_digits:
                anchors = self.run_start[(self.run_end - self.run_start) >= zone.min_digits]  # type: ignore[operator]
            else:
                anchors = self.ats
            merged = self._merged[key] = self._merge(anchors, zone.before, zone.after)
        n = len(self.text)
        # never end a zone inside a run the pattern's lookahead looks at
        return [(a, b if b >= n else det.tail.match(self.text, b).end()) for a, b in merged]  # type: ignore[union-attr]


def _detect(
    det: Detector, text: str, start: int, final: bool, end: int | None = None
) -> tuple[list[tuple[int, int]], int]:
    """Validated matches of one detector in text[start:end], and where its undecided tail begins."""
    found: list[tuple[int, int]] = []
    core = det.core
    if final:
        for m in det.pattern.finditer(text, start, len(text) if end is None else end):
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
