"""NFKC normalisation that remembers where each normalised character came from.

Detectors match on the normalised text (full-width ２０２４ and ＡＢＣ become 2024 and ABC, the ideographic
space a space); masking and tokenizing rewrite the original text, so every normalised span maps back to an
original one. The common case costs two C-level passes: the full-width block and U+3000 map one character to
one character (offsets unchanged) through str.translate, and unicodedata.is_normalized confirms nothing else
changes. Only text with other compatibility characters (ligatures, circled digits, …) takes the per-character
path, which NFKC-normalises each character on its own: a combining sequence split over two characters is
normalised separately (a detector never matches one, so nothing it finds moves).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

# U+FF01..U+FF5E are NFKC-equivalent to U+0021..U+007E, one to one; U+3000 to U+0020
_FULLWIDTH = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F)} | {0x3000: 0x20}


@dataclass(slots=True, frozen=True)
class Normalized:
    """`text` is NFKC(original); `origin[j]` is the original index of normalised character j (None: the same)."""

    original: str
    text: str
    origin: list[int] | None  # len(text) + 1 entries, the last len(original); None when offsets are unchanged

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span that normalised [start, end) came from (a character that expanded maps whole)."""
        if self.origin is None:
            return start, end
        if end <= start:
            return self.origin[start], self.origin[start]
        return self.origin[start], self.origin[end - 1] + 1


def normalize(text: str) -> Normalized:
    fast = text.translate(_FULLWIDTH) if not text.isascii() else text
    if fast is text or unicodedata.is_normalized("NFKC", fast):
        return Normalized(text, fast, None)
    out: list[str] = []
    origin: list[int] = []
    for i, ch in enumerate(fast):
        n = unicodedata.normalize("NFKC", ch) if not ch.isascii() else ch
        out.append(n)
        origin.extend([i] * len(n))  # a character NFKC deletes (none in practice) leaves no entry
    origin.append(len(text))
    return Normalized(text, "".join(out), origin)
