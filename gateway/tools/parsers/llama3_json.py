"""Llama 3.1+ JSON tool calls: the whole answer is {"name": ..., "parameters": {...}} (several joined by `;`),
optionally after <|python_tag|>. An answer that does not start so is text."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.tools.parsers.base import (
    FunctionSpec,
    Literal,
    Markup,
    Piece,
    ToolParser,
    alternatives,
    call_schema,
    json_rule,
    skip_ws,
)
from gateway.tools.parsers.json_call import call_object

TAG = "<|python_tag|>"


class Llama3Json(ToolParser):
    name = "llama3_json"
    show_special_tokens = True  # <|python_tag|>
    markers = (TAG,)

    def scan(self, text: str, final: bool) -> list[Piece]:
        k = skip_ws(text, 0)
        if text.startswith(TAG, k):
            k = skip_ws(text, k + len(TAG))
        elif not final and k < len(text) and TAG.startswith(text[k:]):
            return []  # the tag may be on its way
        if k >= len(text):
            return [text] if final else []
        if text[k] != "{":
            return [text]
        pieces: list[Piece] = [Markup(text[:k])]
        pos = k
        while True:
            piece, end = call_object(text, pos, final)
            pieces.append(piece)
            if end is None:
                return pieces
            q = skip_ws(text, end)
            if q < len(text) and text[q] == ";":
                nxt = skip_ws(text, q + 1)
                if nxt < len(text) and text[nxt] == "{":
                    pieces.append(Markup(text[end:nxt]))
                    pos = nxt
                    continue
            rest = text[end:]
            if not final and not rest.replace(";", "").strip():
                pieces.append(Markup(rest))  # a separator, or nothing yet: the next call may follow
            elif rest:
                pieces.append(rest)  # text after the calls
            return pieces

    def grammar(self, functions: Sequence[FunctionSpec], parallel: bool, lit: Literal) -> str:
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return "\n".join([start, alternatives(functions, lambda f: json_rule(call_schema(f, "parameters")))])
