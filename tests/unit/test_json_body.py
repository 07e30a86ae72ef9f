"""The strict JSON decoder: depth without recursion, finite numbers, UTF-8 only, no lone surrogates."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.json_body import MAX_DEPTH, decode


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"[" * 1_000_000, None),
        (b'{"a":' * 100_000, None),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), None),
        (b'{"t": NaN}', None),
        (b'{"t": Infinity}', None),
        (b'{"t": -Infinity}', None),
        (b'{"t": -1e400}', None),
        (b'{"n": 1' + b"0" * 10_000 + b"}", None),
        (b'{"s": "\xed\xa0\x80"}', None),  # a surrogate encoded as UTF-8 is not UTF-8
        (b'{"m": [{"c": "ok"}, {"c": "x\\ud800"}]}', "m.1.c"),
        (b'{"m": {"\\udfff": 1}}', "m.?"),
        (b"", None),
        (b"{", None),
    ],
)
def test_refused(raw: bytes, param: str | None) -> None:
    with pytest.raises(APIError) as e:
        decode(raw)
    assert e.value.status == 400 and e.value.param == param and e.value.message


def test_accepted() -> None:
    nested = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert decode(nested) is not None
    many = b'{"s": "' + b"[{" * MAX_DEPTH + b'", "t": ["\\\\ud800"]}'  # brackets in a string; an escaped backslash
    assert decode(many) == {"s": "[{" * MAX_DEPTH, "t": ["\\ud800"]}
    assert decode(b'{"s": "[[[[\\"{{{{", "e": "\\ud83d\\ude00", "f": 1.5e300}') == {
        "s": '[[[["{{{{',
        "e": "\U0001f600",
        "f": 1.5e300,
    }
