"""ToolPlan: what a chat request's tools, tool_choice and parallel_tool_calls mean for rendering, the grammar and
parsing. `auto` parses whatever the model writes; `required` and a named function constrain it with a grammar,
so the call is always valid JSON for the function's parameters; `none` leaves tools out of the prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import InvalidRequestError
from engine.structured import StructuredOutputs
from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest
from gateway.protocol_tools import NamedToolChoice
from gateway.tools import select
from gateway.tools.extract import ToolCall, parse
from gateway.tools.parsers.base import FunctionSpec, ToolParser
from gateway.tools.stream import ToolStream


@dataclass(slots=True)
class ToolPlan:
    parser: ToolParser
    tools: list[dict[str, Any]]  # the OpenAI tool objects, for the template
    declared: frozenset[str]
    parallel: bool
    grammar: StructuredOutputs | None  # required / named: the grammar the output must match
    constrained: bool

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse(self.parser, text, self.declared, self.parallel)

    def stream(self) -> ToolStream:
        return ToolStream(self.parser, self.declared, self.parallel)


def plan(body: ChatCompletionRequest, tokenizer: Any, setting: str = select.AUTO) -> ToolPlan | None:
    """The request's plan, or None where tools play no part (none given, or tool_choice none)."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise APIError(400, "tool_choice needs tools: declare the functions in tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(400, f"tools: the function name {dup!r} is declared twice", param="tools")
    parallel = body.parallel_tool_calls is not False
    functions = [FunctionSpec(t.function.name, t.function.parameters) for t in tools]
    parser = select.choose(tokenizer, setting)
    grammar = None
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        if wanted not in names:
            raise APIError(400, f"tool_choice names {wanted!r}, which is not in tools", param="tool_choice")
        functions, parallel = [f for f in functions if f.name == wanted], False
    elif choice == "auto":
        strict = next((i for i, t in enumerate(tools) if t.function.strict), None)
        if strict is not None:
            raise APIError(
                400,
                f"tools.{strict}.function.strict: strict arguments are enforced with tool_choice 'required' or a "
                "named function; with 'auto' this server does not enforce them",
                param=f"tools.{strict}.function.strict",
                code="unsupported_parameter",
            )
    if choice != "auto":
        lark = parser.grammar(functions, parallel, lambda m: select.literal(tokenizer, m))
        try:
            grammar = StructuredOutputs(grammar=lark, field="tools")
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="tools") from None
    return ToolPlan(
        parser,
        [t.model_dump(exclude_none=True) for t in tools],
        frozenset(f.name for f in functions),
        parallel,
        grammar,
        grammar is not None,
    )
