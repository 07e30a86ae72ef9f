"""NFKC normalisation that remembers where each normalised character came from.

Detectors match on the normalised text (full-width ２０２４ and ＡＢＣ become 2024 and ABC, the ideographic
space a space, ① a 1); masking and tokenizing rewrite the original text, so every normalised span maps back to
an original one. Each character is normalised on its own (NFKC of a character; no composition across
characters: no identifier has a combining mark). The cost is in C and numpy: the text as UTF-32 code points, a
table lookup for the characters NFKC changes, the full-width block shifted in one vectorised step; only other
compatibility characters (…, ℃, ﬁ) are normalised one by one, and only they can move offsets.
"""

from __future__ import annotations

import bisect
import functools
import unicodedata
from dataclasses import dataclass

import numpy as np

# every code point NFKC can change lies below this or in the CJK compatibility supplement (U+2F800-U+2FA1F)
_PLANES = 0x20000
_CJK_COMPAT_SUPPLEMENT = range(0x2F800, 0x2FA20)


@functools.cache
def unstable() -> np.ndarray:
    """table[cp]: NFKC changes code point cp (built once, ~0.1 s, at the first non-ASCII text)."""
    table = np.zeros(0x110000, dtype=bool)
    for cp in (*range(_PLANES), *_CJK_COMPAT_SUPPLEMENT):
        ch = chr(cp)
        if not (0xD800 <= cp <= 0xDFFF) and unicodedata.normalize("NFKC", ch) != ch:
            table[cp] = True
    return table


@dataclass(slots=True)
class Normalized:
    """`text` is `original` normalised; `origin[j]` is the original index of normalised character j."""

    original: str
    text: str
    origin: list[int] | None  # None: offsets unchanged (every change was one character for one)
    _cps: np.ndarray | None = None

    @property
    def cps(self) -> np.ndarray:
        """`text` as UTF-32 code points, computed once for the detectors' zones and the term lists."""
        if self._cps is None:
            self._cps = codes(self.text)
        return self._cps

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span that normalised [start, end) came from (a character that expanded maps whole)."""
        if self.origin is None:
            return start, end
        if end <= start:
            return (self.origin[start], self.origin[start]) if start < len(self.text) else (len(self.original),) * 2
        return self.origin[start], self.origin[end - 1] + 1

    def to_normalized(self, start: int) -> int:
        """The first normalised index that comes from original index >= start."""
        if self.origin is None:
            return start
        return bisect.bisect_left(self.origin, start)


def codes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def normalize(text: str) -> Normalized:
    if text.isascii():
        return Normalized(text, text, None)
    cps = codes(text)
    changed = unstable()[cps]
    if not changed.any():
        return Normalized(text, text, None, cps)
    cps = cps.copy()
    wide = (cps >= 0xFF01) & (cps <= 0xFF5E)  # NFKC maps these to ASCII one for one
    ideographic_space = cps == 0x3000
    cps[wide] -= 0xFEE0
    cps[ideographic_space] = 0x20
    rest = np.flatnonzero(changed & ~wide & ~ideographic_space)
    if not len(rest):
        return Normalized(text, cps.tobytes().decode("utf-32-le", "surrogatepass"), None, cps)
    fast = cps.tobytes().decode("utf-32-le", "surrogatepass")
    parts: list[str] = []
    origin: list[int] | None = None
    pos = 0
    for p in rest.tolist():
        rep = unicodedata.normalize("NFKC", fast[p])
        parts += [fast[pos:p], rep]
        pos = p + 1
        if len(rep) != 1 and origin is None:
            origin = []  # built below, once: offsets move
    parts.append(fast[pos:])
    out = "".join(parts)
    if origin is None:
        return Normalized(text, out, None)
    origin = []
    pos = 0
    for p in rest.tolist():
        origin.extend(range(pos, p))
        origin.extend([p] * len(unicodedata.normalize("NFKC", fast[p])))
        pos = p + 1
    origin.extend(range(pos, len(fast)))
    return Normalized(text, out, origin)
