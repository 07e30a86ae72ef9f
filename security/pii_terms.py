"""Sensitive-term lists: a UTF-8 file, one term per line, matched with Aho-Corasick (pyahocorasick).

Terms and text are compared after NFKC, case folding, and deleting spaces, punctuation and invisible format
characters (Unicode categories Z*, P*, Cc, Cf), so 「Ｆ.ａ-ｌ ｕ｝n」 matches the term "falun": a user cannot
slip a term past by spacing or punctuating it. A term that is empty after that is skipped at load. One pass of
the automaton over the folded text finds every term; the folded text is built with str.translate and
str.casefold (C loops), and the map from folded back to original offsets only when something matched.

`TermList` watches its file: `refresh()` (called by the gateway every few seconds, off the event loop)
rebuilds the automaton when the file's size, mtime or inode changed and swaps it in whole; a request keeps the
`TermMatcher` it started with. A file that cannot be read or decoded keeps the previous list (and says so).
"""

from __future__ import annotations

import functools
import logging
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import ahocorasick
import numpy as np

from security.pii_text import Normalized, codes, normalize

log = logging.getLogger(__name__)

MAX_TERMS = 1_000_000
MAX_TERM_CHARS = 64  # after folding: bounds what a stream holds back; LIMITS.md
MAX_FILE_BYTES = 64 << 20


@functools.cache
def ignored() -> np.ndarray:
    """table[cp]: deleted before matching (categories Z*, P*, Cc, Cf); built once, when the first list loads.
    Planes 0-1 and 14 (the tag characters) hold every such code point."""
    table = np.zeros(0x110000, dtype=bool)
    for cp in (*range(0x20000), *range(0xE0000, 0xE0080)):
        cat = unicodedata.category(chr(cp))
        if cat[0] in "ZP" or cat in ("Cc", "Cf"):
            table[cp] = True
    return table


def fold(normalized: str) -> str:
    """NFKC text → what terms are matched on: ignored characters deleted, case folded."""
    cps = codes(normalized)
    return cps[~ignored()[cps]].tobytes().decode("utf-32-le", "surrogatepass").casefold()


@dataclass(frozen=True)
class TermHit:
    start: int  # offsets in the normalised text
    end: int


class TermMatcher:
    """An immutable automaton over the folded terms of one version of a list."""

    def __init__(self, terms: list[str]) -> None:
        self.automaton = ahocorasick.Automaton(ahocorasick.STORE_INTS)
        self.count = 0
        self.longest = 0
        for term in terms:
            key = fold(normalize(term).text)
            if not key or len(key) > MAX_TERM_CHARS:
                continue
            if self.automaton.add_word(key, len(key)):
                self.count += 1
                self.longest = max(self.longest, len(key))
        if self.count:
            self.automaton.make_automaton()

    def find(self, norm: Normalized, start: int = 0, final: bool = True) -> tuple[list[TermHit], int]:
        """Terms in norm.text at or after `start` (normalised offsets), and where undecided text begins: the
        longest tail that is still the beginning of a term (len(text) when `final`)."""
        text = norm.text
        hold = len(text)
        if not self.count or start >= len(text):
            return [], hold
        cps = norm.cps[start:]
        kept = np.flatnonzero(~ignored()[cps])
        stripped = cps[kept].tobytes().decode("utf-32-le", "surrogatepass")
        folded = stripped.casefold()
        found = list(self.automaton.iter(folded)) if folded else []
        tail = 0
        if not final:
            for k in range(min(self.longest, len(folded)), 0, -1):  # the longest suffix that begins a term
                if self.automaton.match(folded[-k:]):
                    tail = k
                    break
        if not found and not tail:
            return [], hold
        where = (kept + start).tolist() if len(folded) == len(stripped) else _positions(stripped, kept, start)
        hits = [TermHit(where[s], where[e] + 1) for s, e in _union(found)]
        if tail:
            hold = where[len(folded) - tail]
        return hits, hold


def _union(found: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping occurrences as one span (folded offsets, end inclusive): a text can hold a term at every
    position ("aaaa…" and the term "aaaa"); the spans stay few, one per region to hide. The automaton reports
    by end position, so a stack merges them in one pass."""
    spans: list[list[int]] = []
    for end, n in found:
        s = end - n + 1
        if spans and s <= spans[-1][1]:
            last = spans[-1]
            last[1] = end  # ends only grow
            if s < last[0]:  # a longer term reaching back over earlier spans
                while len(spans) > 1 and s <= spans[-2][1]:
                    spans.pop()
                    spans[-1][1] = end
                spans[-1][0] = min(s, spans[-1][0])
        else:
            spans.append([s, end])
    return [(a, b) for a, b in spans]


def _positions(stripped: str, kept: np.ndarray, start: int) -> list[int]:
    """Where each folded character came from when case folding changed lengths (ß → ss): a Python loop."""
    out: list[int] = []
    for ch, i in zip(stripped, kept.tolist()):
        out.extend([i + start] * len(ch.casefold()))
    return out


class TermListError(ValueError):
    """The file cannot be used; the message names it, never a term."""


class TermList:
    """One named list from one file, reloaded when the file changes."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._bad: tuple[int, int, int] | None = None  # a version that failed to load: not retried
        self._warned: str | None = None  # one warning per distinct problem, not one per poll
        self.reloads = 0
        self.matcher = self._load(self._stat_or_raise())  # a bad file at start is fatal: TermListError

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _stat_or_raise(self) -> tuple[int, int, int]:
        try:
            return self._stat()
        except OSError as e:
            raise TermListError(f"term list {self.name!r}: cannot read {self.path}: {e.strerror}") from None

    def _load(self, stamp: tuple[int, int, int]) -> TermMatcher:
        if stamp[1] > MAX_FILE_BYTES:
            raise TermListError(f"term list {self.name!r} ({self.path}) is over {MAX_FILE_BYTES} bytes")
        try:
            text = self.path.read_bytes().decode("utf-8-sig")
        except OSError as e:
            raise TermListError(f"term list {self.name!r}: cannot read {self.path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise TermListError(f"term list {self.name!r}: {self.path} is not UTF-8 (byte {e.start})") from None
        terms = [t for t in (line.strip() for line in text.splitlines()) if t and not t.startswith("#")]
        if len(terms) > MAX_TERMS:
            raise TermListError(f"term list {self.name!r}: over {MAX_TERMS} terms")
        matcher = TermMatcher(terms)
        self._stamp = stamp
        return matcher

    def refresh(self) -> bool:
        """Reload if the file changed; True if a new version is in use. Blocking: run it off the event loop."""
        try:
            stamp = self._stat_or_raise()
            if stamp in (self._stamp, self._bad):
                return False
            try:
                self.matcher = self._load(stamp)
            except TermListError:
                self._bad = stamp
                raise
        except TermListError as e:
            if str(e) != self._warned:
                log.warning("%s; the previous version stays in use", e)
                self._warned = str(e)
            return False
        self.reloads += 1
        self._warned = None
        log.info("term list %r reloaded: %d terms", self.name, self.matcher.count)
        return True
