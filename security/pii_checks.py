"""Check digits and dates of Chinese identifiers: what turns a pattern match into a detection.

GB 11643-1999 (居民身份证号码): ISO 7064 MOD 11-2 over the first 17 digits, 10 written X; digits 7-14 a real
date of birth. GB 32100-2015 (统一社会信用代码): weights 3^i mod 31 over an alphabet of 31 characters (no I, O,
S, V, Z). ISO/IEC 7812 (bank cards): Luhn.
"""

from __future__ import annotations

import datetime

_ID_WEIGHTS = [pow(2, 17 - i, 11) for i in range(17)]  # 7 9 10 5 8 4 2 1 6 3 7 9 10 5 8 4 2
USCC_ALPHABET = "0123456789ABCDEFGHJKLMNPQRTUWXY"
_USCC_VALUE = {c: i for i, c in enumerate(USCC_ALPHABET)}
_USCC_WEIGHTS = [pow(3, i, 31) for i in range(17)]  # 1 3 9 27 19 26 16 17 20 29 25 13 8 24 10 30 28
EARLIEST_BIRTH = datetime.date(1880, 1, 1)


def id_check_char(first17: str) -> str:
    """The 18th character of a resident identity card number: MOD 11-2 of the first 17 digits."""
    total = sum(int(d) * w for d, w in zip(first17, _ID_WEIGHTS))
    value = (12 - total % 11) % 11
    return "X" if value == 10 else str(value)


def birth_date_ok(yyyymmdd: str, today: datetime.date | None = None) -> bool:
    """A real calendar date between 1880 and today (a future birth date is a typo or a made-up number)."""
    try:
        born = datetime.date(int(yyyymmdd[:4]), int(yyyymmdd[4:6]), int(yyyymmdd[6:8]))
    except ValueError:
        return False
    return EARLIEST_BIRTH <= born <= (today or datetime.date.today())


def valid_id18(number: str) -> bool:
    """18 characters, digits and a final digit or X (either case), a real birth date, the right check character."""
    if len(number) != 18 or not number[:17].isdigit() or not number[:17].isascii():
        return False
    return birth_date_ok(number[6:14]) and number[17].upper() == id_check_char(number[:17])


def valid_id15(number: str) -> bool:
    """The first-generation card (before 1999): 15 digits, a two-digit year of the 1900s, no check digit."""
    return len(number) == 15 and number.isdigit() and number.isascii() and birth_date_ok("19" + number[6:12])


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def luhn_check_digit(payload: str) -> str:
    """The digit that makes `payload + digit` pass Luhn."""
    for d in "0123456789":
        if luhn_ok(payload + d):
            return d
    raise AssertionError("unreachable: one of ten digits always completes a Luhn sum")  # pragma: no cover


def uscc_check_char(first17: str) -> str | None:
    """The 18th character of a unified social credit code; None if a character is outside the alphabet."""
    try:
        total = sum(_USCC_VALUE[c] * w for c, w in zip(first17, _USCC_WEIGHTS))
    except KeyError:
        return None
    return USCC_ALPHABET[(31 - total % 31) % 31]


def valid_uscc(code: str) -> bool:
    return len(code) == 18 and uscc_check_char(code[:17]) == code[17]
