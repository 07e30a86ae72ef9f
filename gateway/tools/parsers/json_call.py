"""A tool call written as a JSON object {"name": ..., "arguments" | "parameters": {...}} (Hermes, Llama 3,
Mistral's array form), finished or still being written.

The arguments are the model's own JSON text (not re-encoded), so the fragments a stream sends join to exactly the
arguments a non-streamed response returns. A call is streamed while it is written only in the usual order, name
first; any other order is sent whole once the object is complete."""

from __future__ import annotations

import json
import re

from gateway.tools.parsers.base import CallPiece

_DECODER = json.JSONDecoder()
HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def arguments_text(value: object) -> str | None:
    """The JSON text for an arguments value: an object, or a string that holds one (some models quote it)."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            if isinstance(json.loads(value), dict):
                return value
        except ValueError:
            return None
    return None


def json_value_end(text: str, pos: int) -> int | None:
    """Where the JSON value at text[pos] ends, or None if it is unfinished (or not JSON)."""
    try:
        return _DECODER.raw_decode(text, pos)[1]
    except ValueError:
        return None


def call_object(text: str, pos: int, final: bool) -> tuple[CallPiece, int | None]:
    """The call whose object starts at text[pos], and the index just past it (None: unfinished or malformed)."""
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        obj, end = None, None
    head = HEAD.match(text, pos)
    if end is not None:
        piece = CallPiece(text[pos:end], complete=True)
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            key = "arguments" if "arguments" in obj else "parameters"
            value = obj.get(key, {} if key not in obj else None)
            args: str | None = None
            if head is not None and isinstance(value, dict):  # the model's own text for the object
                args_end = json_value_end(text, head.end())
                args = text[head.end() : args_end] if args_end is not None else None
            args = args if args is not None else arguments_text(value)
            if args is not None:
                piece.name, piece.arguments, piece.valid = obj["name"], args, True
        return piece, end
    piece = CallPiece(text[pos:], complete=final)
    if not final and head is not None:
        piece.name = json.loads(head.group(1))
        start = head.end()
        if start < len(text) and text[start] == "{":  # an object: stream it as it comes
            args_end = json_value_end(text, start)
            piece.arguments = text[start:args_end] if args_end is not None else text[start:]
    return piece, None
