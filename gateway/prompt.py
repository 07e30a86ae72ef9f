"""Prompt sizes known before tokenizing (for the context check and the rate-limit reservation) and the tokenizing.

Before the rate limiter is asked, only cheap facts are used: the character count bounds the token count
from below (no token decodes to more than `max_token_chars` characters) and the UTF-8 byte count bounds it
from above (byte-level BPE and byte-fallback tokenizers give at most one token per byte, plus the template's
markup). The template rendering, the control-token scan and the encoding run later, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from engine import InvalidRequestError
from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.tools import render
from gateway.tools.plan import ToolPlan

# the most tokens a chat template adds around the text: a default system prompt (Llama 3's is ~30 tokens)
TEMPLATE_TOKENS = 128
MESSAGE_TOKENS = 16  # per message: role markers and separators (ChatML: 4, Llama 3: 5)
TOOLS_TOKENS = 256  # the tools section's own words (the Hermes fallback's are ~110 tokens)

Body = ChatCompletionRequest | CompletionRequest


@dataclass(slots=True, frozen=True)
class PromptBounds:
    vocab_size: int
    max_token_chars: int  # the longest token's text, +1 for a decoder that drops a word's leading space


def _bounds(tokenizer: Any) -> PromptBounds:
    size = int(tokenizer.vocab_size)
    longest = max((len(tokenizer.token_text(i)) for i in range(size)), default=1)
    return PromptBounds(size, longest + 1)


# a tokenizer (by identity; one per served model, which the process holds anyway) → its bounds: once computed,
# read without a thread hop
_known: dict[Any, PromptBounds] = {}


async def bounds(tokenizer: Any) -> PromptBounds:
    """Computed once per tokenizer (a pass over the vocabulary), off the event loop."""
    known = _known.get(tokenizer)
    if known is None:
        known = _known[tokenizer] = await asyncio.to_thread(_bounds, tokenizer)
    return known


def check_token_ids(body: Body, vocab_size: int) -> None:
    ids = body.token_ids() if isinstance(body, CompletionRequest) else None
    if ids is not None and max(ids) >= vocab_size:
        bad = next(i for i, t in enumerate(ids) if t >= vocab_size)
        raise APIError(400, f"prompt.{bad}: token id {ids[bad]} is not in the vocabulary (size {vocab_size})", "prompt")
    for t in body.logit_bias_ids() or {}:
        if t >= vocab_size:
            raise APIError(400, f"logit_bias: token id {t} is not in the vocabulary (size {vocab_size})", "logit_bias")


def _contents(body: Body) -> list[str]:
    if isinstance(body, ChatCompletionRequest):
        return [m.text() for m in body.messages]
    return [] if body.token_ids() is not None else [body.text()]


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def token_range(body: Body, b: PromptBounds) -> tuple[int, int]:
    """(fewest, most) tokens the prompt can have: content characters over the longest token, and bytes + markup."""
    ids = body.token_ids() if isinstance(body, CompletionRequest) else None
    if ids is not None:
        return len(ids), len(ids)
    contents = _contents(body)
    fewest = max(1, math.ceil(sum(len(t) for t in contents) / b.max_token_chars))
    most = sum(_utf8(t) for t in contents)
    if isinstance(body, ChatCompletionRequest):
        most += TEMPLATE_TOKENS + sum(MESSAGE_TOKENS + _utf8(m.role) + _utf8(m.name or "") for m in body.messages)
        most += _tool_bytes(body)
    else:
        most += 8  # BOS/EOS and a prefix-space token
    return fewest, most


def _tool_bytes(body: ChatCompletionRequest) -> int:
    """Tools and earlier tool calls, as a template may print them: twice their compact JSON (indentation), and the
    tools section's words."""
    calls = [c.model_dump() for m in body.messages for c in m.tool_calls or []]
    calls += [m.tool_call_id for m in body.messages if m.tool_call_id]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    size = 2 * _utf8(json.dumps(calls, ensure_ascii=False)) if calls else 0
    return size + (2 * _utf8(json.dumps(tools, ensure_ascii=False)) + TOOLS_TOKENS if tools else 0)


def reservation(body: Body, b: PromptBounds, max_model_len: int) -> int:
    """The tokens the request can really consume: the prompt plus n completions, bounded before tokenizing."""
    fewest, most = token_range(body, b)
    requested = body.requested_max_tokens()
    if requested is None:  # each choice may run to the context: p + n(L - p) is largest at the fewest p
        return fewest + body.n * max(0, max_model_len - fewest)
    return min(most, max_model_len - requested) + body.n * requested  # longer prompts are refused


def _no_control_token(tokenizer: Any, text: str, what: str, param: str) -> None:
    token = tokenizer.find_control_token(text)
    if token is not None:  # NOTE: it would become a real control token and forge a role turn
        raise APIError(
            400,
            f"{what} contains the control token {token!r}; control tokens may only come from the chat template",
            param=param,
        )


def prompt_ids(tokenizer: Any, body: Body, tools: ToolPlan | None = None) -> list[int]:
    """Render and tokenize (blocking: run it in a thread); a control token in chat content is a 400.

    `tools`: the request's tool plan, whose tools the template (or the Hermes fallback) renders."""
    ids = body.token_ids() if isinstance(body, CompletionRequest) else None
    if ids is not None:
        return list(ids)
    try:
        if isinstance(body, ChatCompletionRequest):
            messages = [m.to_template() for m in body.messages]
            for i, m in enumerate(messages):
                _no_control_token(tokenizer, m["content"], "message content", f"messages.{i}.content")
                if "tool_calls" in m:
                    text = json.dumps(m["tool_calls"], ensure_ascii=False)
                    _no_control_token(tokenizer, text, "a tool call", f"messages.{i}.tool_calls")
            defs = tools.tools if tools is not None else None
            if defs:
                _no_control_token(tokenizer, json.dumps(defs, ensure_ascii=False), "a tool definition", "tools")
            messages, extra = render.template_inputs(messages, defs, tokenizer.renders_tools)
            return list(tokenizer.encode_chat(messages, **extra))
        return list(tokenizer.encode(body.text()))
    except InvalidRequestError as e:
        field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise APIError(400, str(e), param=e.param or field) from None
