"""Tools and tool-call turns into the chat template's inputs.

A template that renders tools gets them as transformers' apply_chat_template passes them (`tools=`, the OpenAI
shape) and the messages with their tool_calls and tool_call_id. A template that does not (SmolLM2's, plain ChatML)
gets them written into the messages the way Qwen2.5's template writes them, so the model still sees the functions
and the earlier calls and results: the Hermes fallback (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import json
from typing import Any

FALLBACK_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_inputs(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, native: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the chat template; `native`: the template renders tools."""
    if native:
        return messages, ({"tools": tools} if tools else {})
    out: list[dict[str, Any]] = []
    rest = messages
    if tools:
        section = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            first, rest = messages[0], messages[1:]
            out.append({**first, "content": f"{first['content']}\n\n{section}" if first["content"] else section})
        else:
            out.append({"role": "system", "content": section})
    for m in rest:
        if m.get("tool_calls"):
            calls = "\n".join(_call_text(c["function"]) for c in m["tool_calls"])
            text = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn, as Qwen2.5's
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out], {}


def _call_text(function: dict[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
