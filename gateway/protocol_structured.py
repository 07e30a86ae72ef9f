"""Request schemas for structured outputs: OpenAI's response_format, and vLLM's guided_* fields and its
structured_outputs object. Each becomes one engine StructuredOutputs (gateway.structured)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from gateway.protocol_tools import MAX_DESCRIPTION, check_schema_size

STRICT = ConfigDict(strict=True, extra="forbid")
MAX_PATTERN = 16 << 10  # a regex or a grammar (the engine bounds every constraint at 64 KiB again)
MAX_GRAMMAR = 64 << 10
MAX_CHOICES, MAX_CHOICE_CHARS = 256, 1024
SCHEMA_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for json_schema.name

Pattern = Annotated[str, Field(min_length=1, max_length=MAX_PATTERN)]
Grammar = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR)]
Choices = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]], Field(min_length=1, max_length=MAX_CHOICES)
]
SchemaText = Annotated[str, Field(min_length=2, max_length=64 << 10)]


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(pattern=SCHEMA_NAME)]
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_schema_size(schema)


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


def _format_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    # NOTE: tags with brackets are left out of error paths (gateway.protocol._UNION_TAG), so errors name
    # response_format.json_schema.name, not response_format.json_schema.json_schema.name
    return f"format[{kind}]" if isinstance(kind, str) else None


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("format[text]")]
    | Annotated[JsonObjectFormat, Tag("format[json_object]")]
    | Annotated[JsonSchemaResponseFormat, Tag("format[json_schema]")],
    Discriminator(
        _format_type,
        custom_error_type="response_format",
        custom_error_message="type must be text, json_object or json_schema",
    ),
]


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` (exactly one constraint); its backend options are not implemented."""

    model_config = STRICT
    json_: dict[str, Any] | SchemaText | None = Field(None, alias="json")
    regex: Pattern | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None

    @field_validator("json_")
    @classmethod
    def _bounded(cls, schema: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        return check_schema_size(schema) if isinstance(schema, dict) else schema
