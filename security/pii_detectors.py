"""The identifier detectors: a pattern over NFKC text, then a validator (check digit, date) on what it matched.

A pattern finds candidates; only a candidate its validator accepts is a detection, so a wrong check digit or a
random digit run is not one. Every pattern is bounded at both ends (no letter or digit glued on), so a
16-digit card is not found inside a 20-digit number, and every pattern has a bounded length, which bounds
what a stream holds back (security.pii_stream). Each pattern is compiled twice from the same source: with
`re` for whole texts (faster) and with `regex`, whose partial matching tells a stream whether its tail could
still become a match.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import regex

from security.pii_checks import luhn_ok, valid_id15, valid_id18, valid_uscc

_ALNUM_BEFORE = r"(?<![0-9A-Za-z])"
_ALNUM_AFTER = r"(?![0-9A-Za-z])"
_SEPARATORS = re.compile(r"[ \-]")
MAX_PATTERN_CHARS = 512  # a configured passport pattern's source; LIMITS.md


@dataclass(frozen=True)
class Zone:
    """Where a match can lie: from `before` characters ahead of a run of at least `min_digits` ASCII digits
    (min_digits 0: of an "@") to `after` characters past its start. A whole text is searched only in its zones
    (found with numpy), which keeps a 2,000-character prompt in tens of microseconds. `before` is the most a
    match can start ahead of its first such run ("+86 " before "138…"), `after` the most it reaches past it."""

    min_digits: int
    before: int
    after: int
    tail: str = "[0-9A-Za-z]*"  # a zone never ends inside a run of these (the pattern's lookahead must see it)


@dataclass(frozen=True)
class Detector:
    name: str  # the policy key in the config: id_card, bank_card, …
    label: str  # the placeholder's stem under `tokenize`: [CARD_1]
    source: str  # the regex over NFKC text, boundaries included
    validate: Callable[[str], bool]  # on the matched NFKC text
    keep: tuple[int, int]  # default `mask`: characters left visible at the start and the end
    zone: Zone | None  # None: search the whole text (a configured pattern of unknown shape)
    pattern: re.Pattern[str] = field(init=False, repr=False)
    partial: regex.Pattern[str] = field(init=False, repr=False)
    tail: re.Pattern[str] = field(init=False, repr=False)
    core: int | str = field(init=False, repr=False)  # the group that is the identifier (a prefix may not be)

    def __post_init__(self) -> None:
        object.__setattr__(self, "core", "id" if "(?P<id>" in self.source else 0)
        object.__setattr__(self, "pattern", re.compile(self.source))
        object.__setattr__(self, "partial", regex.compile(self.source, regex.V0))
        object.__setattr__(self, "tail", re.compile(self.zone.tail if self.zone else ""))


def _always(_: str) -> bool:
    return True


def _card_ok(s: str) -> bool:
    digits = _SEPARATORS.sub("", s)
    return 16 <= len(digits) <= 19 and luhn_ok(digits)


def _id_ok(s: str) -> bool:
    digits = _SEPARATORS.sub("", s)
    return valid_id18(digits) if len(digits) == 18 else valid_id15(digits)


_DATE = r"(?:0[1-9]|1[0-2])(?:0[1-9]|[12][0-9]|3[01])"
_USCC_CHAR = "[0-9A-HJ-NPQRTUWXYa-hj-npqrtuwxy]"  # GB 32100's alphabet (no I O S V Z), either case

ID_CARD = Detector(
    "id_card",
    "ID",
    # 18 characters (6-8-4, optionally grouped by one separator) or the 15-digit first generation
    _ALNUM_BEFORE
    + rf"(?:[1-9][0-9]{{5}}(?P<s>[ \-]?)(?:18|19|20)[0-9]{{2}}{_DATE}(?P=s)[0-9]{{3}}[0-9Xx]"
    + rf"|[1-9][0-9]{{5}}[0-9]{{2}}{_DATE}[0-9]{{3}})"
    + _ALNUM_AFTER,
    _id_ok,
    (6, 4),
    Zone(4, 0, 24),
)
BANK_CARD = Detector(
    "bank_card",
    "CARD",
    _ALNUM_BEFORE
    + r"(?:[0-9]{16,19}|[0-9]{4}(?P<s>[ \-])[0-9]{4}(?P=s)[0-9]{4}(?P=s)[0-9]{4}(?:(?P=s)[0-9]{1,3})?)"
    + _ALNUM_AFTER,
    _card_ok,
    (6, 4),
    Zone(4, 0, 24),
)
MOBILE = Detector(
    "mobile",
    "MOBILE",
    # the hit is the number itself (group "id"): a +86 / 0086 / 86 in front is matched but not masked
    r"(?<![0-9A-Za-z+])(?<![0-9][ \-])(?:(?:\+|00)?86[ \-]?)?(?P<id>1[3-9][0-9](?P<s>[ \-]?)[0-9]{4}(?P=s)[0-9]{4})"
    + _ALNUM_AFTER,
    _always,
    (3, 4),
    Zone(3, 5, 24),
)
LANDLINE = Detector(
    "landline",
    "PHONE",
    # area code 010, 02x or 0[3-9]xx, bare or in parentheses, then a 7-8 digit number that does not start with 0/1;
    # not after a digit and a separator (the middle of a grouped card number)
    _ALNUM_BEFORE
    + r"(?<![0-9][ \-])"
    + r"(?:\(0(?:10|2[0-9]|[3-9][0-9]{2})\)[ \-]?|0(?:10|2[0-9]|[3-9][0-9]{2})[ \-]?)[2-9][0-9]{2,3}[ \-]?[0-9]{4}"
    + _ALNUM_AFTER,
    _always,
    (3, 2),
    Zone(3, 1, 24),
)
USCC = Detector(
    "uscc",
    "USCC",
    # registration authority, organisation type, 6-digit division code, 9-character organisation code, check
    _ALNUM_BEFORE + rf"[1-9ANYany][1-9][1-8][0-9]{{5}}{_USCC_CHAR}{{10}}" + _ALNUM_AFTER,
    lambda s: valid_uscc(s.upper()),
    (2, 4),
    Zone(6, 2, 24),
)
EMAIL = Detector(
    "email",
    "EMAIL",
    r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]{1,64}@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?\.){1,8}[A-Za-z]{2,24}(?![A-Za-z0-9\-])",
    _always,
    (1, 0),
    Zone(0, 66, 8 * 64 + 26, r"[A-Za-z0-9.\-]*"),
)
IPV4 = Detector(
    "ipv4",
    "IP",
    r"(?<![0-9.])(?:(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    r"(?![0-9]|\.[0-9])",
    _always,
    (0, 0),
    Zone(1, 0, 16, r"[0-9.]*"),
)
# the People's Republic's ordinary passport: E + 8 digits, E + a letter + 7 digits (since 2017), G + 8 digits
DEFAULT_PASSPORT = r"[EG][0-9]{8}|E[A-HJ-NP-Z][0-9]{7}"


def passport(pattern: str = DEFAULT_PASSPORT) -> Detector:
    """The passport detector for `pattern` (a regex over NFKC text; boundaries are added around it)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"passport_pattern: at most {MAX_PATTERN_CHARS} characters")
    try:
        re.compile(pattern)
        regex.compile(pattern, regex.V0)
    except (re.error, regex.error) as e:
        raise ValueError(f"passport_pattern is not a valid regular expression: {e}") from None
    if re.compile(pattern).fullmatch(""):
        raise ValueError("passport_pattern must not match the empty string")
    zone = Zone(7, 2, 12) if pattern == DEFAULT_PASSPORT else None  # 7 digits in either form
    return Detector("passport", "PASSPORT", _ALNUM_BEFORE + f"(?:{pattern})" + _ALNUM_AFTER, _always, (1, 2), zone)


# the order breaks ties: an 18-digit number that is a valid ID and passes Luhn is an ID
BUILTIN = (ID_CARD, USCC, BANK_CARD, MOBILE, LANDLINE, EMAIL, IPV4)
NAMES = (*(d.name for d in BUILTIN), "passport")


def detectors(passport_pattern: str = DEFAULT_PASSPORT) -> tuple[Detector, ...]:
    return (*BUILTIN[:3], passport(passport_pattern), *BUILTIN[3:])
