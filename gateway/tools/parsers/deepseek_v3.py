"""DeepSeek-V3's tool-call tokens: <｜tool▁calls▁begin｜>, then per call
<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME and the arguments in a ```json fence, <｜tool▁call▁end｜>;
V3.1 writes NAME<｜tool▁sep｜>{...} instead."""

from __future__ import annotations

import json
from collections.abc import Sequence

from gateway.tools.parsers.base import (
    CallPiece,
    FunctionSpec,
    Literal,
    Markup,
    Piece,
    ToolParser,
    hold_back,
    json_rule,
    parameters,
)
from gateway.tools.parsers.json_call import json_value_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE, FENCE_END = "```json\n", "\n```"


class DeepSeekV3(ToolParser):
    name = "deepseek_v3"
    show_special_tokens = True
    markers = (CALLS_BEGIN, CALL_BEGIN, SEP)

    def scan(self, text: str, final: bool) -> list[Piece]:
        i = text.find(CALLS_BEGIN)
        if i < 0:
            return [text if final else hold_back(text, CALLS_BEGIN)]
        pieces: list[Piece] = [text[:i]]
        mark = i  # where the markup not yet in a piece starts
        pos = i + len(CALLS_BEGIN)
        while True:
            b = text.find(CALL_BEGIN, pos)
            close = text.find(CALLS_END, pos)
            if b < 0 or (0 <= close < b):
                if close >= 0:
                    end = close + len(CALLS_END)
                    pieces += [Markup(text[mark:end]), text[end:]]
                elif final:
                    pieces.append(Markup(text[mark:]))
                return pieces
            pieces.append(Markup(text[mark:b]))
            e = text.find(CALL_END, b)
            closed = e >= 0
            body = text[b + len(CALL_BEGIN) : e if closed else len(text)]
            piece = _call(body, closed or final)
            piece.raw = text[b : e + len(CALL_END) if closed else len(text)]
            pieces.append(piece)
            if not closed:
                return pieces
            pos = mark = e + len(CALL_END)

    def grammar(self, functions: Sequence[FunctionSpec], parallel: bool, lit: Literal) -> str:
        calls = 'call ("\\n" call)*' if parallel else "call"
        lines = [f"start: {lit(CALLS_BEGIN)} {calls} {lit(CALLS_END)}"]
        lines.append("call: " + " | ".join(f"c{i}" for i in range(len(functions))))
        for i, f in enumerate(functions):
            head = f'{lit(CALL_BEGIN)} "function" {lit(SEP)} ' + _quote(f"{f.name}\n{FENCE}")
            lines.append(f"c{i}: {head} {json_rule(parameters(f))} {_quote(FENCE_END)} {lit(CALL_END)}")
        return "\n".join(lines)


def _quote(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _call(body: str, complete: bool) -> CallPiece:
    piece = CallPiece("", complete=complete)
    s = body.find(SEP)
    if s < 0:
        return piece
    kind, rest = body[:s].strip(), body[s + len(SEP) :]
    if kind == "function":  # V3: the name on its line, then the fenced arguments
        nl = rest.find("\n")
        if nl < 0:
            return piece
        name, args_at = rest[:nl].strip(), rest.find("{", nl)
    else:  # V3.1: the name before the separator
        name, args_at = kind, rest.find("{")
    piece.name = name or None
    if args_at < 0:
        return piece
    end = json_value_end(rest, args_at)
    if end is None:
        piece.arguments = "" if complete else rest[args_at:]
        return piece
    piece.arguments = rest[args_at:end]
    tail = rest[end:].strip()
    piece.valid = bool(name) and complete and tail in ("", "```")
    return piece
