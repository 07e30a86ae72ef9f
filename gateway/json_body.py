"""Strict JSON for request bodies: UTF-8 only, bounded nesting, finite numbers, no lone surrogates.

Python's json recurses once per nesting level (100,000 `[` is a RecursionError), accepts NaN and
Infinity, turns 1e999 into inf and lets `"\\ud800"` through as a lone surrogate that later breaks
UTF-8 encoding. Each of these is a 400 here, naming the field where there is one.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gateway.errors import APIError

MAX_DEPTH = 32  # objects and arrays; a chat request needs 5
# a JSON string (escapes included) or one bracket: strings are skipped whole, so brackets inside them do not count
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_SURROGATE = re.compile("[\ud800-\udfff]")
# valid UTF-8 holds no surrogate, so one can only come from an escape; a body without any skips the walk
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode(body: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The decoded body, or APIError(400) saying what is wrong with it."""
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_json") from None
    if body.count(b"[") + body.count(b"{") > max_depth:  # fewer brackets than that cannot nest too deep
        _check_depth(body, max_depth)
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except APIError:
        raise
    except ValueError as e:  # JSONDecodeError, and ints past Python's digit limit
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(body) is not None:
        _check_strings(value)
    return value


def _check_depth(body: bytes, max_depth: int) -> None:
    depth = 0
    for m in _TOKENS.finditer(body):
        c = m.group()[0]
        if c in b"[{":
            depth += 1
            if depth > max_depth:
                raise APIError(
                    400, f"the request body nests deeper than {max_depth} levels of arrays and objects", code="too_deep"
                )
        elif c in b"]}":
            depth -= 1


def _no_constant(name: str) -> float:
    raise APIError(
        400, f"the request body contains {name}, which is not JSON; send a finite number", code="invalid_json"
    )


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise APIError(400, f"the number {literal[:40]} is out of range", code="invalid_json")
    return value


def _check_strings(value: Any) -> None:
    """Refuse lone surrogates in keys and values (the depth check bounds this walk)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                _surrogate(path)
        elif isinstance(v, dict):
            for k, item in v.items():
                if _SURROGATE.search(k):
                    _surrogate(_join(path, _SURROGATE.sub("?", k)))
                if isinstance(item, (str, dict, list)):
                    stack.append((_join(path, k), item))
        elif isinstance(v, list):
            stack.extend((_join(path, str(i)), x) for i, x in enumerate(v) if isinstance(x, (str, dict, list)))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _surrogate(path: str) -> None:
    raise APIError(
        400,
        f"{path or 'the body'}: a string contains a lone UTF-16 surrogate escape (such as \\ud800), "
        "which is not a character",
        param=path or None,
        code="invalid_json",
    )
