"""Which tool-call format a model writes: the setting (engine.tool_call_parser), or, on `auto`, the markers its
vocabulary and chat template use. A template that does not render tools gets the Hermes fallback prompt
(gateway.tools.render), so its model is parsed as Hermes."""

from __future__ import annotations

import functools
import json
from typing import Any

from gateway.tools.parsers import PARSERS, DeepSeekV3, Hermes, Llama3Json, Mistral, ToolParser

AUTO = "auto"
CHOICES = (AUTO, *PARSERS)


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of `text` if the vocabulary holds it as one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


@functools.lru_cache(maxsize=16)
def choose(tokenizer: Any, setting: str = AUTO) -> ToolParser:
    def has(text: str) -> bool:
        return single_token(tokenizer, text) is not None

    if setting != AUTO:
        return PARSERS[setting](has)
    if not tokenizer.renders_tools:
        return Hermes(has)
    template = tokenizer.chat_template or ""
    for cls in (DeepSeekV3, Mistral, Llama3Json):
        if any(has(m) or m in template for m in cls.markers):
            return cls(has)
    return Hermes(has)


def literal(tokenizer: Any, marker: str) -> str:
    """`marker` as a Lark terminal: a special token by its id (llguidance matches those only so), else a string."""
    token = single_token(tokenizer, marker)
    if token is not None and marker in tokenizer.control_tokens:
        return f"<[{token}]>"
    return json.dumps(marker, ensure_ascii=False)
