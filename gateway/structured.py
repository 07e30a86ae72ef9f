"""The request's structured-output constraint: OpenAI's response_format, or one of vLLM's guided_* fields or its
structured_outputs object, as one engine StructuredOutputs. Asking for two at once is a 400."""

from __future__ import annotations

from typing import Any

from engine import InvalidRequestError
from engine.structured import StructuredOutputs
from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.protocol_structured import JsonObjectFormat, JsonSchemaResponseFormat


def requested(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutputs | None:
    """The one constraint the body asks for, or None; APIError(400) for two, or for one the engine refuses."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if isinstance(rf, JsonObjectFormat):
        found.append(("response_format", {"json_object": True}))
    elif isinstance(rf, JsonSchemaResponseFormat):
        schema = rf.json_schema.schema_
        # OpenAI: a json_schema format without a schema asks for any JSON object
        found.append(("response_format.json_schema.schema", {"json": schema} if schema else {"json_object": True}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            found.append((name, {kind: getattr(body, name)}))
    if body.guided_choice is not None:
        found.append(("guided_choice", {"choice": tuple(body.guided_choice)}))
    so = body.structured_outputs
    if so is not None:
        for kind, value in (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar)):
            if value is not None:
                found.append((f"structured_outputs.{kind}", {kind: value}))
        if so.choice is not None:
            found.append(("structured_outputs.choice", {"choice": tuple(so.choice)}))
        if so.json_object:
            found.append(("structured_outputs.json_object", {"json_object": True}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"ask for one structured-output constraint at a time; got {names}", param=found[1][0])
    field, spec = found[0]
    try:
        return StructuredOutputs(**spec, field=field)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
