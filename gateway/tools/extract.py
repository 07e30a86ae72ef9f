"""A model's text → (content, tool calls), the same way for a whole answer and for a stream's prefix.

Only calls of declared functions count; any other call, and any call that is not well-formed, stays in the
content as the model wrote it (never a 500, nothing lost). With parallel_tool_calls false the first call counts."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from gateway.tools.parsers.base import CallPiece, ToolParser


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
    parser: ToolParser, text: str, final: bool, declared: frozenset[str], parallel: bool
) -> tuple[str, list[CallPiece]]:
    """(the content's text so far, unstripped; the calls so far). Not final: a call still being written is among
    the calls once its declared name is known; one whose name is not known yet is in neither, for now."""
    content: list[str] = []
    calls: list[CallPiece] = []
    for piece in parser.scan(text, final):
        if isinstance(piece, str):
            content.append(piece)
        elif piece.complete:
            if piece.valid and piece.name in declared:
                if parallel or not calls:
                    calls.append(piece)
            else:
                content.append(piece.raw)
        elif piece.name in declared and (parallel or not calls):
            calls.append(piece)
    return "".join(content), calls


def parse(parser: ToolParser, text: str, declared: frozenset[str], parallel: bool) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: its content (None when only calls remain) and its calls."""
    content, calls = split(parser, text, True, declared, parallel)
    return content.strip() or None, [ToolCall(call_id(), c.name or "", c.arguments) for c in calls]
