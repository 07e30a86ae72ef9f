"""OpenAI fields this server does not implement: a 400 that says so, unless the value asks for nothing.

`null` (and the few values that mean "off", like store=false) is accepted, because SDKs echo them back;
anything else would be silently ignored, so it is refused. Unknown fields are refused by the schema.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import APIError

# field -> the values that ask for nothing (None always does)
_COMMON: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "reasoning_effort": (),
    "verbosity": (),
    "prompt_cache_key": (),
    "safety_identifier": (),
}
CHAT_ONLY: dict[str, tuple[Any, ...]] = {}
# tool calling is a chat feature: on /v1/completions these are refused as before
COMPLETION_ONLY: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
}
# fields of a message that the client SDKs send back with an earlier answer
MESSAGE: dict[str, tuple[Any, ...]] = {
    "function_call": (),
    "audio": (),
    "refusal": (),
    "annotations": ([],),
    "reasoning_content": (),
}


def strip_unsupported(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """`body` without the unsupported fields that ask for nothing; APIError(400) for one that asks for something."""
    table = _COMMON | (CHAT_ONLY if chat else COMPLETION_ONLY)
    out = _strip(body, table, "")
    messages = out.get("messages")
    if chat and isinstance(messages, list):
        out["messages"] = [
            _strip(m, MESSAGE, f"messages.{i}.") if isinstance(m, dict) else m for i, m in enumerate(messages)
        ]
    return out


def _strip(obj: dict[str, Any], table: dict[str, tuple[Any, ...]], prefix: str) -> dict[str, Any]:
    out = {}
    for key, value in obj.items():
        if key not in table:
            out[key] = value
        elif value is not None and not any(_same(value, v) for v in table[key]):
            raise APIError(
                400,
                f"{prefix}{key} is not supported by this server",
                param=f"{prefix}{key}",
                code="unsupported_parameter",
            )
    return out


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # strict: 0 is not False
