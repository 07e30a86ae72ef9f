"""OpenAI request schemas (pydantic, strict) and their mapping onto engine SamplingParams.

Strict: a bool is not an int, a string is not a number, every number and string is bounded, and a
field we do not implement is a 400 (see gateway.unsupported), never silently dropped.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from engine import InvalidRequestError, SamplingParams
from engine.structured import StructuredOutputs
from gateway.errors import APIError
from gateway.protocol_structured import Choices, Grammar, Pattern, ResponseFormat, SchemaText, StructuredOutputsField
from gateway.protocol_tools import CallId, ToolCalls, ToolChoice, Tools, check_schema_size
from gateway.unsupported import strip_unsupported

INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_SHORT = 256  # model, user, name: identifiers, not content
MAX_TEXT = 1 << 20  # content and prompt strings (the body limit bounds them first; this bounds the schema)
MAX_STOP, MAX_STOP_CHARS = 16, 256
MAX_MESSAGES, MAX_PARTS = 2048, 256
MAX_LOGIT_BIAS = 300
MAX_PROMPT_IDS = 1 << 20
_UNION_TAG = re.compile(r".*\[.*|(constrained-)?(str|int|float|bool|list|dict)")  # pydantic's names of branches
_TOKEN_KEY = re.compile(r"[0-9]{1,10}")

Short = Annotated[str, Field(max_length=MAX_SHORT)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
STRICT = ConfigDict(strict=True, extra="forbid")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: Any) -> Any:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise ValueError(f"content part type {kind[:40]!r} is not supported; only 'text' is")
        return part


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] | None = None
    name: Short | None = None
    tool_calls: ToolCalls | None = None  # an earlier assistant turn's calls
    tool_call_id: CallId | None = None  # a tool result: the call it answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message must name the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only tool messages answer a tool call")
        return self

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        return "".join(p.text for p in self.content)

    def to_template(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":  # the function's name, as templates that show it expect
            message["name"] = self.name
        return message


class _SamplingFields(BaseModel):
    model_config = STRICT
    model: Short
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)] | None
    ) = None
    user: Short | None = None
    # vLLM-style extensions
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] = 1.0
    ignore_eos: bool = False
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs (gateway.structured)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | SchemaText | None = None
    guided_regex: Pattern | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None
    structured_outputs: StructuredOutputsField | None = None

    @field_validator("guided_json")
    @classmethod
    def _bounded_schema(cls, schema: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        return check_schema_size(schema) if isinstance(schema, dict) else schema

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not _TOKEN_KEY.fullmatch(key):
                raise ValueError(f"keys must be token ids (decimal integers), got {key[:40]!r}")
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def logit_bias_ids(self) -> dict[int, float] | None:
        return None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        choice: int = 0,
        structured: StructuredOutputs | None = None,
        skip_special_tokens: bool = True,
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None
        if self.seed is not None:  # choice i gets seed + i, wrapped into the range a generator accepts
            seed = self.seed + choice
            seed = seed - 2**64 if seed > SEED_MAX else seed
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=seed,
                stop=stop,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                logit_bias=self.logit_bias_ids(),
                structured=structured,
                skip_special_tokens=skip_special_tokens,
            )
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None


MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return top

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class CompletionRequest(_SamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=1)]
        | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_IDS)]
    )
    max_tokens: MaxTokens | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: Text | None = None

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, value: bool | str | None, info: ValidationInfo) -> bool | str | None:
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def token_ids(self) -> list[int] | None:
        p = self.prompt
        return p if isinstance(p, list) and isinstance(p[0], int) else None  # type: ignore[return-value]

    def text(self) -> str:
        p = self.prompt
        return p if isinstance(p, str) else str(p[0])


def _most_telling(errors: list[Any]) -> Any:
    """A union reports every branch: a broken constraint (the type matched) beats a type mismatch, deeper beats
    shallower, so `stop: [1]` says stop.0 should be a string and 17 stop strings say there are too many."""
    return max(errors, key=lambda x: (not x["type"].endswith("_type"), len(x["loc"])))


def parse(model: type[_SamplingFields], body: Any) -> Any:
    """Validate a decoded JSON body; a failure is a 400 naming the most specific bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    body = strip_unsupported(body, chat=model is ChatCompletionRequest)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = _most_telling(e.errors())
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and _UNION_TAG.fullmatch(p))]
        param = ".".join(loc) or None
        if err["type"] == "extra_forbidden":
            msg = "unknown field: this server does not implement it"
            raise APIError(400, f"{param}: {msg}", param=param, code="unknown_parameter") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from None


def openapi_schema() -> dict[str, Any]:
    def ref(name: str) -> dict[str, Any]:
        return {"$ref": f"#/components/schemas/{name}"}

    def post(summary: str, schema: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "security": [{"bearer": []}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(schema)}}},
                "responses": {"200": {"description": "a completion, or an SSE stream when stream is true"}},
            }
        }

    schemas: dict[str, Any] = {}
    for model in (ChatCompletionRequest, CompletionRequest):
        s = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(s.pop("$defs", {}))
        schemas[model.__name__] = s
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tianmen", "version": "0.1.0"},
        "paths": {
            "/v1/chat/completions": post("Chat completion", "ChatCompletionRequest"),
            "/v1/completions": post("Text completion", "CompletionRequest"),
            "/v1/models": {
                "get": {
                    "summary": "Models this token may use",
                    "security": [{"bearer": []}],
                    "responses": {"200": {"description": "a model list"}},
                }
            },
            "/health": {"get": {"summary": "Alive", "responses": {"200": {"description": "alive"}}}},
            "/ready": {"get": {"summary": "Engine loaded", "responses": {"200": {"description": "ready"}}}},
        },
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
