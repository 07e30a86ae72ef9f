"""Engine deltas → OpenAI response bodies and SSE chunks (chat.completion[.chunk], text_completion)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine import Logprob, RequestOutput, Usage

if TYPE_CHECKING:
    from gateway.tools.plan import ToolPlan
    from gateway.tools.stream import ToolStream

DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # what OpenAI and vLLM report for a token of probability 0 (JSON has no -Infinity)


# The characters JSON leaves raw that Python's str.splitlines takes for line ends (the C0 ones JSON escapes itself).
# WHY: SSE ends lines at CR and LF only, but httpx's aiter_lines and requests' iter_lines split as splitlines does:
# a chunk whose text held one came to such a client as two lines, neither of them JSON ("Unterminated string": one
# request of 256 in `python -m benchmarks.serving`). Escaped, the JSON means the same and no line reader splits it.
_LINE_ENDS = re.compile("[\x85\u2028\u2029]")


def _dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse_json(obj: dict[str, Any]) -> bytes:
    """`obj` as JSON for one SSE data line: no character in it that any line reader takes for a line end."""
    text = _dumps(obj)
    if _LINE_ENDS.search(text) is not None:
        text = _LINE_ENDS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text.encode()


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _sse_json(obj) + b"\n\n"


def finish_reason(reason: str | None) -> str | None:
    """The engine's reason in OpenAI's terms; content_filter comes from the gateway's privacy policy."""
    return None if reason is None else (reason if reason in ("length", "content_filter") else "stop")


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """`cached_tokens` None: no prompt_tokens_details (a colleague could probe the prefix cache with it)."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def merge(outs: list[RequestOutput]) -> RequestOutput:
    """Deltas of one choice that are ready together, as one: one chunk, one JSON encode, one write."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    logprobs = [lp for o in outs for lp in o.logprobs or []]
    return RequestOutput(
        last.req_id,
        [t for o in outs for t in o.new_token_ids],
        "".join(o.new_text for o in outs),
        last.finish_reason,
        next((o.usage for o in reversed(outs) if o.usage is not None), None),
        logprobs or None,
        last.stop_reason,
    )


@dataclass
class Choice:
    parts: list[str] = field(default_factory=list)  # the text so far, joined once at the end: O(1) per delta
    length: int = 0  # characters so far
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[Logprob] = field(default_factory=list)
    started: bool = False
    tools: ToolStream | None = None  # a stream's tool-call parser (tool calling)
    tool_names: list[str] = field(default_factory=list)  # the functions called, for the audit trail

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ResponseBuilder:
    """Accumulates the deltas of n choices and renders chunks or the final body for one endpoint."""

    def __init__(
        self,
        chat: bool,
        req_id: str,
        model: str,
        n: int,
        token_text: Callable[[int], str],
        report_cached: bool = True,
        tools: ToolPlan | None = None,
    ) -> None:
        self.chat, self.id, self.model, self.report_cached = chat, req_id, model, report_cached
        self.created = int(time.time())
        self.tools = tools  # set: the answers are parsed for tool calls
        self.choices = [Choice(tools=tools.stream() if tools is not None else None) for _ in range(n)]
        self.token_text = token_text
        self.object = "chat.completion" if chat else "text_completion"
        self._head: bytes | None = None  # a stream's chunks' fixed fields, encoded at its first chunk

    @property
    def _chunk_head(self) -> bytes:
        if self._head is None:
            fixed = {
                "id": self.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": None,
            }
            self._head = b"data: " + _sse_json(fixed)[:-1] + b',"choices":['
        return self._head

    def add(self, index: int, out: RequestOutput) -> Choice:
        c = self.choices[index]
        if out.new_text:
            c.parts.append(out.new_text)
            c.length += len(out.new_text)
        c.logprobs.extend(out.logprobs or [])
        if out.usage is not None:
            c.usage = out.usage
        if out.finish_reason is not None:
            c.finish_reason = finish_reason(out.finish_reason)
        return c

    def usage(self) -> dict[str, Any]:
        usages = [c.usage for c in self.choices if c.usage is not None]
        cached = self.cached_tokens() if self.report_cached else None
        if not usages:
            return usage_body(0, 0, cached)
        return usage_body(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages), cached)

    def cached_tokens(self) -> int:
        return next((c.usage.cached_tokens for c in self.choices if c.usage is not None), 0)

    # ---- logprobs ----------------------------------------------------------------------------------
    def _chat_logprobs(self, lps: list[Logprob]) -> dict[str, Any]:
        def entry(token_id: int, lp: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": max(lp, MIN_LOGPROB), "bytes": list(text.encode())}

        return {
            "content": [entry(x.token_id, x.logprob) | {"top_logprobs": [entry(t, v) for t, v in x.top]} for x in lps],
            "refusal": None,
        }

    def _text_logprobs(self, lps: list[Logprob], offset: int) -> dict[str, Any]:
        tokens = [self.token_text(x.token_id) for x in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [max(x.logprob, MIN_LOGPROB) for x in lps],
            "top_logprobs": [{self.token_text(t): max(v, MIN_LOGPROB) for t, v in x.top} for x in lps],
            "text_offset": offsets,
        }

    # ---- non-stream ------------------------------------------------------------------------------------
    def body(self, want_logprobs: bool) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            if self.chat:
                lp = self._chat_logprobs(c.logprobs) if want_logprobs else None
                message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
                finish = c.finish_reason
                if self.tools is not None:
                    content, calls = self.tools.parse(c.text)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = [call.to_openai() for call in calls]
                        c.tool_names = [call.name for call in calls]
                        finish = c.finish_reason = "tool_calls" if finish == "stop" else finish
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                lp = self._text_logprobs(c.logprobs, 0) if want_logprobs else None
                choices.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": None,
        }

    # ---- stream ------------------------------------------------------------------------------------------
    def chunk(self, index: int, out: RequestOutput, want_logprobs: bool, include_usage: bool) -> bytes:
        c = self.choices[index]
        before = c.length - len(out.new_text)
        lps = out.logprobs or []
        if self.chat:
            finish = c.finish_reason if out.finished else None
            if c.tools is not None:
                delta, finish = self._tool_delta(c, out.new_text, finish)
                if not delta and c.started and finish is None and not (want_logprobs and lps):
                    return b""  # held back: it may be the start of a tool call
            else:
                delta = {"content": out.new_text} if out.new_text or not c.started else {}
            if not c.started:
                delta = {"role": "assistant", "content": delta.pop("content", "")} | delta
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": self._chat_logprobs(lps) if want_logprobs and lps else None,
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": index,
                "text": out.new_text,
                "logprobs": self._text_logprobs(lps, before) if want_logprobs and lps else None,
                "finish_reason": c.finish_reason if out.finished else None,
            }
        c.started = True
        # the chunk's fixed fields are encoded once per response; this encodes only the choice
        return self._chunk_head + _sse_json(choice) + (b'],"usage":null}\n\n' if include_usage else b"]}\n\n")

    def _tool_delta(self, c: Choice, new_text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A tool-calling stream's delta: content and tool-call fragments, as OpenAI sends them."""
        assert c.tools is not None
        content, calls = c.tools.feed(new_text, finish is not None)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        c.tool_names = c.tools.names
        if finish == "stop" and c.tool_names:
            finish = c.finish_reason = "tool_calls"
        return delta, finish

    def tool_names(self) -> list[str]:
        return [name for c in self.choices for name in c.tool_names]

    def usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "system_fingerprint": None,
                "choices": [],
                "usage": self.usage(),
            }
        )
