"""Request schemas for tool calling (OpenAI's): tools, tool_choice, and the tool calls and results that
conversations carry back. Strict and bounded like gateway.protocol; the JSON schemas inside are bounded in bytes."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

STRICT = ConfigDict(strict=True, extra="forbid")
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_SCHEMA_BYTES = 64 << 10  # one tool's parameters, or a response_format schema, serialized
MAX_DESCRIPTION = 16 << 10
MAX_ARGUMENTS = 1 << 20  # a tool call's arguments sent back (the body limit bounds them first)
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule: also what keeps names safe in prompts, grammars and logs

FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME)]
CallId = Annotated[str, Field(min_length=1, max_length=256)]


def schema_bytes(schema: dict[str, Any]) -> int:
    return len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


def check_schema_size(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema is not None and (n := schema_bytes(schema)) > MAX_SCHEMA_BYTES:
        raise ValueError(f"the schema is {n} bytes serialized; at most {MAX_SCHEMA_BYTES} are accepted")
    return schema


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_schema_size(schema)


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = STRICT
    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENTS)]


class ToolCallParam(BaseModel):
    """A tool call of an earlier assistant turn, as the SDKs send it back."""

    model_config = STRICT
    id: CallId
    type: Literal["function"]
    function: FunctionCall

    def to_template(self) -> dict[str, Any]:
        """As chat templates take it (transformers, vLLM): arguments as an object when they are a JSON object."""
        args: Any = self.function.arguments
        try:
            decoded = json.loads(args)
            if isinstance(decoded, dict):
                args = decoded
        except ValueError:
            pass
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


ToolCalls = Annotated[list[ToolCallParam], Field(max_length=MAX_TOOL_CALLS)]
Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]
