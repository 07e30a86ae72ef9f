"""Mistral's [TOOL_CALLS]: a JSON array of {"name", "arguments"} objects (tokenizers v3 to v7), or, where the
vocabulary has [ARGS] (v11+), `[TOOL_CALLS]name[ARGS]{...}` per call."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.tools.parsers.base import (
    CallPiece,
    FunctionSpec,
    Literal,
    Markup,
    Piece,
    ToolParser,
    alternatives,
    call_schema,
    hold_back,
    json_rule,
    parameters,
    skip_ws,
)
from gateway.tools.parsers.json_call import call_object, json_value_end

MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class Mistral(ToolParser):
    name = "mistral"
    show_special_tokens = True
    markers = (MARK,)

    def scan(self, text: str, final: bool) -> list[Piece]:
        i = text.find(MARK)
        if i < 0:
            return [text if final else hold_back(text, MARK)]
        pieces: list[Piece] = [text[:i]]
        k = skip_ws(text, i + len(MARK))
        if k < len(text) and text[k] == "[":
            return pieces + _array(text, i, k, final)
        if k >= len(text) and not final:
            return pieces  # the form is not known yet
        return pieces + _named(text, i, final)

    def grammar(self, functions: Sequence[FunctionSpec], parallel: bool, lit: Literal) -> str:
        if self.has_token(ARGS):
            start = "start: call+" if parallel else "start: call"
            rule = alternatives(
                functions, lambda f: f"{lit(MARK)} {lit(f.name)} {lit(ARGS)} " + json_rule(parameters(f))
            )
            return "\n".join([start, rule])
        start = f'start: {lit(MARK)} "[" call (", " call)* "]"' if parallel else f'start: {lit(MARK)} "[" call "]"'
        return "\n".join([start, alternatives(functions, lambda f: json_rule(call_schema(f)))])


def _array(text: str, i: int, k: int, final: bool) -> list[Piece]:
    """`[TOOL_CALLS][{...}, {...}]` from the marker at text[i], the bracket at text[k]."""
    pieces: list[Piece] = []
    mark = i  # where the markup not yet in a piece starts
    pos = k + 1
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text) or text[pos] != "{":
            if final and mark < len(text):
                pieces.append(text[mark:])  # not a call array after all (or junk in it)
            return pieces
        pieces.append(Markup(text[mark:pos]))
        piece, end = call_object(text, pos, final)
        pieces.append(piece)
        if end is None:
            return pieces
        q = skip_ws(text, end)
        mark = end
        if q < len(text) and text[q] == ",":
            pos = q + 1
            continue
        if q < len(text) and text[q] == "]":
            pieces += [Markup(text[end : q + 1]), text[q + 1 :]]
        elif final:
            pieces.append(text[end:])
        return pieces


def _named(text: str, i: int, final: bool) -> list[Piece]:
    """`[TOOL_CALLS]name[ARGS]{...}`, repeated."""
    pieces: list[Piece] = []
    while i >= 0:
        start = i + len(MARK)
        a = text.find(ARGS, start)
        if a < 0:
            pieces.append(CallPiece(text[i:], complete=final))
            return pieces
        name = text[start:a].split(CALL_ID)[0].strip()
        j = skip_ws(text, a + len(ARGS))
        end = json_value_end(text, j) if j < len(text) and text[j] == "{" else None
        piece = CallPiece(text[i : end if end is not None else len(text)], name=name or None)
        if end is None:
            piece.complete = final
            piece.arguments = text[j:] if j < len(text) and text[j] == "{" and not final else ""
            pieces.append(piece)
            return pieces
        piece.arguments, piece.complete, piece.valid = text[j:end], True, bool(name)
        pieces.append(piece)
        i = text.find(MARK, end)
        if i < 0:
            rest = text[end:] if final else hold_back(text[end:], MARK)
            pieces.append(rest if rest.strip() or final else Markup(rest))
        else:
            between = text[end:i]
            pieces.append(between if between.strip() else Markup(between))
    return pieces
