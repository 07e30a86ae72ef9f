"""Generated Chinese identifiers with valid (or deliberately wrong) check characters, for the privacy tests."""

from __future__ import annotations

import datetime
import random

from security.pii_checks import USCC_ALPHABET, id_check_char, luhn_check_digit, luhn_ok, uscc_check_char

AREAS = ["110105", "310104", "440305", "330106", "510107", "420102"]  # real county codes: Beijing, Shanghai, …


def id18(rng: random.Random) -> str:
    born = datetime.date(1950, 1, 1) + datetime.timedelta(days=rng.randrange(365 * 55))
    first17 = rng.choice(AREAS) + born.strftime("%Y%m%d") + f"{rng.randrange(1000):03d}"
    return first17 + id_check_char(first17)


def id15(rng: random.Random) -> str:
    born = datetime.date(1930, 1, 1) + datetime.timedelta(days=rng.randrange(365 * 60))
    return rng.choice(AREAS) + born.strftime("%y%m%d") + f"{rng.randrange(1000):03d}"


def card(rng: random.Random, length: int = 16) -> str:
    payload = rng.choice(["622202", "621700", "436742", "622848", "625807"])
    payload += "".join(rng.choice("0123456789") for _ in range(length - 7))
    return payload + luhn_check_digit(payload)


def uscc(rng: random.Random) -> str:
    body = rng.choice("159") + rng.choice("123") + rng.choice(AREAS)
    body += "".join(rng.choice(USCC_ALPHABET) for _ in range(9))
    check = uscc_check_char(body)
    assert check is not None
    return body + check


def mobile(rng: random.Random) -> str:
    return "1" + rng.choice("3456789") + "".join(rng.choice("0123456789") for _ in range(9))


def wrong_last(number: str, alphabet: str = "0123456789") -> str:
    """The same number with a different last character (for an ID, never X: it stays digit-shaped)."""
    return number[:-1] + next(c for c in alphabet if c != number[-1].upper())


def luhn_invalid(rng: random.Random, length: int) -> str:
    """A random digit run of `length` that fails Luhn (first digit non-zero)."""
    while True:
        digits = rng.choice("123456789") + "".join(rng.choice("0123456789") for _ in range(length - 1))
        if not luhn_ok(digits):
            return digits


def grouped(number: str, sep: str) -> str:
    return sep.join(number[i : i + 4] for i in range(0, len(number), 4))


def fullwidth(text: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)
