"""Streaming tool calls as OpenAI sends them: per call, a first delta with its index, id, type and
function.name (arguments ""), then arguments fragments; the content around the calls as content deltas.

Each delta re-reads the text so far with the same parser a whole answer uses (gateway.tools.extract), so what a
stream sends joins to exactly what the non-streamed answer returns (content stripped the same way)."""

from __future__ import annotations

from typing import Any

from gateway.tools.extract import call_id, split
from gateway.tools.parsers.base import ToolParser


class ToolStream:
    def __init__(self, parser: ToolParser, declared: frozenset[str], parallel: bool) -> None:
        self.parser, self.declared, self.parallel = parser, declared, parallel
        self.parts: list[str] = []
        self.sent_content = ""
        self.sent: list[tuple[str, str, str]] = []  # per call started: id, name, arguments sent

    @property
    def names(self) -> list[str]:
        return [name for _, name, _ in self.sent]

    def feed(self, new_text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content delta and the tool-call deltas for `new_text` (final: the answer ended)."""
        if new_text:
            self.parts.append(new_text)
        text = "".join(self.parts)
        self.parts = [text]
        content, calls = split(self.parser, text, final, self.declared, self.parallel, len(self.sent))
        visible = content.strip() if final else content.lstrip().rstrip(" \t\r\n")
        delta = ""
        if visible.startswith(self.sent_content) and len(visible) > len(self.sent_content):
            delta = visible[len(self.sent_content) :]
            self.sent_content = visible
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if call.name is None:
                continue
            if i == len(self.sent):
                cid = call_id()
                self.sent.append((cid, call.name, ""))
                deltas.append(
                    {"index": i, "id": cid, "type": "function", "function": {"name": call.name, "arguments": ""}}
                )
            if i >= len(self.sent):
                break  # NOTE: calls start in order; one cannot begin before the one ahead of it
            cid, name, sent = self.sent[i]
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                deltas.append({"index": i, "function": {"arguments": call.arguments[len(sent) :]}})
                self.sent[i] = (cid, name, call.arguments)
        return delta, deltas
