"""OpenAI request schemas (pydantic) and their mapping onto engine SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine import InvalidRequestError, SamplingParams
from gateway.errors import APIError


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        content = (
            self.content
            if isinstance(self.content, str) or self.content is None
            else "".join(p.text for p in self.content)
        )
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    user: str | None = None
    # vLLM-style extensions
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    ignore_eos: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int = 0) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
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
                seed=None if self.seed is None else self.seed + choice,
                stop=stop,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
            )
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; a failure is a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "list")))]
        param = ".".join(loc) or None
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
