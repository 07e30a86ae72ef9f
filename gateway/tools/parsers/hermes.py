"""Hermes-style calls, one JSON object per <tool_call>...</tool_call> block: Qwen2.5, Qwen3, Hermes 2/3, and
the fallback prompt for chat templates that do not render tools (gateway.tools.render)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.tools.parsers.base import (
    CallPiece,
    FunctionSpec,
    Literal,
    Piece,
    ToolParser,
    alternatives,
    call_schema,
    hold_back,
    json_rule,
    skip_ws,
)
from gateway.tools.parsers.json_call import call_object

START, END = "<tool_call>", "</tool_call>"


class Hermes(ToolParser):
    name = "hermes"
    markers = (START, END)

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while True:
            i = text.find(START, pos)
            if i < 0:
                pieces.append(text[pos:] if final else hold_back(text[pos:], START))
                return pieces
            pieces.append(text[pos:i])
            body = i + len(START)
            j = text.find(END, body)
            closed = j >= 0
            end = j if closed else len(text)
            block = text[:end]
            k = skip_ws(block, body)
            if k < end and block[k] == "{":
                piece, obj_end = call_object(block, k, final=closed or final)
                if obj_end is not None and block[obj_end:].strip():  # text after the object, inside the block
                    piece.valid = False
            else:
                piece = CallPiece("", complete=closed or final)
            piece.raw = text[i : j + len(END)] if closed else text[i:]
            piece.complete = closed or final
            pieces.append(piece)
            if not closed:
                return pieces
            pos = j + len(END)

    def grammar(self, functions: Sequence[FunctionSpec], parallel: bool, lit: Literal) -> str:
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        block = f'block: {lit(START)} "\\n" call "\\n" {lit(END)}'
        return "\n".join([start, block, alternatives(functions, lambda f: json_rule(call_schema(f)))])
