"""A model's text → (content, tool calls), the same way for a whole answer and for a stream's prefix.

Only calls of declared functions count; any other call, and any call that is not well-formed, stays in the
content as the model wrote it (never a 500, nothing lost). With parallel_tool_calls false the first call counts."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from gateway.tools.parsers.base import CallPiece, Markup, ToolParser


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def split(
    parser: ToolParser, text: str, final: bool, declared: frozenset[str], parallel: bool, started: int = 0
) -> tuple[str, list[CallPiece]]:
    """(the content's text so far, unstripped; the calls so far).

    Not final: a call still being written is among the calls once its declared name is known; one whose name is
    not known yet is in neither, for now. The first `started` calls are calls whatever they turn out to be: a
    stream has sent them (a call cut by max_tokens stays a call there, as OpenAI's streams do). When no call is
    found, the markup is content too, so the content is the whole text."""
    pieces = parser.scan(text, final)
    calls: list[CallPiece] = []
    kept: list[str | Markup] = []
    for piece in pieces:
        if not isinstance(piece, CallPiece):
            kept.append(piece)
        elif piece.name in declared and len(calls) < started:
            calls.append(piece)
        elif piece.complete:
            if piece.valid and piece.name in declared:
                if parallel or not calls:
                    calls.append(piece)  # (a second call without parallel_tool_calls is dropped)
            else:
                kept.append(piece.raw)
        elif piece.name in declared and (parallel or not calls):
            calls.append(piece)
    if calls:
        kept = [p for p in kept if isinstance(p, str)]
    elif not final:  # markup with no call yet: it and what follows wait for the end (or for a call)
        first = next((i for i, p in enumerate(kept) if isinstance(p, Markup)), len(kept))
        kept = kept[:first]
    return "".join(p.text if isinstance(p, Markup) else p for p in kept), calls


def parse(parser: ToolParser, text: str, declared: frozenset[str], parallel: bool) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: its content (None when only calls remain) and its calls."""
    content, calls = split(parser, text, True, declared, parallel)
    return content.strip() or None, [ToolCall(call_id(), c.name or "", c.arguments) for c in calls]
