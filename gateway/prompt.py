"""Prompt sizes known before tokenizing (for the context check and the rate-limit reservation) and the tokenizing.

Before the rate limiter is asked, only cheap facts are used: the character count bounds the token count
from below (no token decodes to more than `max_token_chars` characters) and the UTF-8 byte count bounds it
from above (byte-level BPE and byte-fallback tokenizers give at most one token per byte, plus the template's
markup). The template rendering, the control-token scan and the encoding run later, off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import dataclass
from typing import Any

from engine import InvalidRequestError
from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, CompletionRequest

# the most tokens a chat template adds around the text: a default system prompt (Llama 3's is ~30 tokens)
TEMPLATE_TOKENS = 128
MESSAGE_TOKENS = 16  # per message: role markers and separators (ChatML: 4, Llama 3: 5)

Body = ChatCompletionRequest | CompletionRequest


@dataclass(slots=True, frozen=True)
class PromptBounds:
    vocab_size: int
    max_token_chars: int  # the longest token's text, +1 for a decoder that drops a word's leading space


@functools.cache  # one entry per served model's tokenizer, which the process holds anyway
def _bounds(tokenizer: Any) -> PromptBounds:
    size = int(tokenizer.vocab_size)
    longest = max((len(tokenizer.token_text(i)) for i in range(size)), default=1)
    return PromptBounds(size, longest + 1)


async def bounds(tokenizer: Any) -> PromptBounds:
    """Computed once per tokenizer (a pass over the vocabulary), off the event loop."""
    return await asyncio.to_thread(_bounds, tokenizer)


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
    else:
        most += 8  # BOS/EOS and a prefix-space token
    return fewest, most


def reservation(body: Body, b: PromptBounds, max_model_len: int) -> int:
    """The tokens the request can really consume: the prompt plus n completions, bounded before tokenizing."""
    fewest, most = token_range(body, b)
    requested = body.requested_max_tokens()
    if requested is None:  # each choice may run to the context: p + n(L - p) is largest at the fewest p
        return fewest + body.n * max(0, max_model_len - fewest)
    return min(most, max_model_len - requested) + body.n * requested  # longer prompts are refused


def prompt_ids(tokenizer: Any, body: Body) -> list[int]:
    """Render and tokenize (blocking: run it in a thread); a control token in chat content is a 400."""
    ids = body.token_ids() if isinstance(body, CompletionRequest) else None
    if ids is not None:
        return list(ids)
    try:
        if isinstance(body, ChatCompletionRequest):
            messages = [m.to_template() for m in body.messages]
            for i, m in enumerate(messages):
                token = tokenizer.find_control_token(m["content"])
                if token is not None:  # NOTE: it would become a real control token and forge a role turn
                    raise APIError(
                        400,
                        f"message content contains the control token {token!r}; control tokens "
                        "may only come from the chat template",
                        param=f"messages.{i}.content",
                    )
            return list(tokenizer.encode_chat(messages))
        return list(tokenizer.encode(body.text()))
    except InvalidRequestError as e:
        field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise APIError(400, str(e), param=e.param or field) from None
