"""/v1/chat/completions, /v1/completions, /v1/models, /health, /ready, /openapi.json: parse → engine → respond."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.structured import StructuredOutputs
from gateway import admission, completion, json_body, offload, prompt, structured
from gateway.errors import APIError
from gateway.models import ModelRegistry, ServedModel
from gateway.protocol import ChatCompletionRequest, CompletionRequest, openapi_schema, parse
from gateway.state import RequestState
from gateway.tools.plan import ToolPlan, plan
from security.principal import Principal


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def models(request: Request) -> Response:
    """The models this token may use: each served model, then each alias (with the model it names now)."""
    deps, principal = request.app.state.deps, request.scope["principal"]
    card = {"object": "model", "created": deps.started, "owned_by": "tianmen"}
    served, aliases = [], []
    for m in deps.models:
        if deps.models.allowed(principal, m):
            quantization = getattr(getattr(m.engine, "config", None), "quantization", "none")  # none | w8a8 | w4a16
            served.append({"id": m.name, **card, "quantization": quantization})
            aliases += [{"id": a, **card, "alias_of": m.name} for a in m.aliases]
    return JSONResponse({"object": "list", "data": served + aliases})


async def health(request: Request) -> Response:
    if not request.app.state.deps.models.healthy:  # a step thread died: restart the process
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    registry = request.app.state.deps.models
    if not registry.ready:
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "5"})
    return JSONResponse({"status": "ready", "models": [m.name for m in registry]})


async def metrics(request: Request) -> Response:
    deps = request.app.state.deps
    _require_admin(request)
    if deps.metrics is None:
        raise APIError(404, "metrics are not enabled", code="not_found")
    return Response(deps.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def profile(request: Request) -> Response:
    """Record the next N engine steps with torch.profiler into a Chrome trace (admin scope)."""
    deps = request.app.state.deps
    _require_admin(request)
    body = json_body.decode(await _body(request))
    steps = body.get("steps") if isinstance(body, dict) else None
    if not isinstance(steps, int) or not 1 <= steps <= 10_000:
        raise APIError(400, "steps must be an integer in [1, 10000]", param="steps")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise APIError(400, "model must be a string", param="model")
    served = deps.models.first if name is None else deps.models.resolve(name)
    if served is None:
        raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
    trace = deps.profile_dir / f"trace-{request.scope['request_id']}.json"
    deps.profile_dir.mkdir(parents=True, exist_ok=True)
    served.engine.profile(steps, trace)
    return JSONResponse({"trace": str(trace), "steps": steps, "model": served.name})


def _require_admin(request: Request) -> None:
    scope = request.app.state.deps.admin_scope
    if not request.scope["principal"].has_scope(scope):
        raise APIError(403, f"this endpoint needs the {scope!r} scope", code="insufficient_scope")


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema())


async def _body(request: Request) -> bytes:
    """The request's body, read from its ASGI messages here: Starlette's `Request.body()` goes through an async
    generator closed by `aclosing`, about 3% of a short request's time on the event loop (py-spy, Zen 4)."""
    chunks: list[bytes] = []
    while True:
        message = await request.receive()
        if message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        elif message["type"] == "http.disconnect":  # gone before the body was in (or cut by the shutdown)
            raise APIError(
                400, "the connection closed before the request body was complete", code="client_disconnected"
            )


def _route(models: ModelRegistry, principal: Principal, model: str) -> ServedModel:
    """The served model a request names (by its name or an alias), if this token may use it."""
    served = models.resolve(model)
    if served is None:
        raise APIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
    if not models.allowed(principal, served):
        raise APIError(403, f"this token may not use the model {model!r}", param="model", code="model_not_allowed")
    if not served.engine.ready:
        raise APIError(503, "the engine is not ready; retry shortly", headers={"Retry-After": "5"})
    return served


async def _complete(request: Request, chat: bool) -> Response:
    deps = request.app.state.deps
    principal: Principal = request.scope["principal"]
    state: RequestState = request.scope["request_state"]
    raw = await _body(request)
    body = await offload.run(len(raw), _parse, ChatCompletionRequest if chat else CompletionRequest, raw)
    state.model, state.stream = body.model, body.stream
    served = _route(deps.models, principal, body.model)
    state.model = served.name  # the audit trail and metrics name the model that served, not the alias
    engine = served.engine
    bounds = await prompt.bounds(engine.tokenizer)
    prompt.check_token_ids(body, bounds.vocab_size)
    limit, requested = engine.max_model_len, body.requested_max_tokens()
    params = ("messages" if chat else "prompt", "max_tokens")
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        params = ("messages", "max_completion_tokens")
    _check_context(prompt.token_range(body, bounds)[0], requested, limit, params)  # before any tokenizing
    privacy = deps.privacy.session(principal.tenant, state) if deps.privacy is not None else None
    if privacy is not None:
        privacy.check_request(body)
    tools, constraint = _constraints(body, engine.tokenizer, served.tool_call_parser)
    state.constrained = constraint is not None
    lease = await admission.admit(
        deps.limiter, principal, prompt.reservation(body, bounds, limit), state, model=served.name
    )
    try:
        if privacy is not None:  # what the model sees, and what the audit trail keeps of the prompt
            body = await privacy.screen_async(body, engine.tokenizer)
        # the raw body bounds what the template renders (messages, tools) and what gets tokenized
        ids, state.prompt_text = await offload.run(len(raw), _tokenize, engine.tokenizer, body, tools)
        state.prompt_tokens = len(ids)
        _check_context(len(ids), requested, limit, params)
        max_tokens = limit - len(ids) if requested is None else requested
        show = tools is not None and tools.parser.show_special_tokens  # its markers are special tokens
        sampling = [
            body.sampling_params(max_tokens, body.num_logprobs(), i, constraint, skip_special_tokens=not show)
            for i in range(body.n)
        ]
        return await completion.run(request, body, ids, sampling, lease, engine, privacy, tools)
    finally:  # a stream settles when it ends; everything else (done, failed, cut) settles here
        if not state.settled_by_stream:
            await lease.settle(state.total_tokens)


def _parse(model: type[ChatCompletionRequest | CompletionRequest], raw: bytes) -> Any:
    return parse(model, json_body.decode(raw))


def _constraints(
    body: ChatCompletionRequest | CompletionRequest, tokenizer: Any, parser: str
) -> tuple[ToolPlan | None, StructuredOutputs | None]:
    """The tool plan and the one grammar the output must match (a response format, or a required tool call)."""
    tools = plan(body, tokenizer, parser) if isinstance(body, ChatCompletionRequest) else None
    constraint = structured.requested(body)
    if tools is not None and tools.grammar is not None:
        if constraint is not None:
            raise APIError(
                400,
                f"{constraint.field} and a required tool call cannot both constrain one answer",
                param=constraint.field,
            )
        constraint = tools.grammar
    elif tools is not None and constraint is not None:  # the grammar would keep the model from calling
        raise APIError(
            400,
            f"{constraint.field} with tools needs tool_choice 'none': a constrained answer cannot also call tools",
            param=constraint.field,
        )
    return tools, constraint


def _tokenize(
    tokenizer: Any, body: ChatCompletionRequest | CompletionRequest, tools: ToolPlan | None = None
) -> tuple[list[int], str]:
    """The prompt's token ids and its text for the audit content policy (blocking: see gateway.offload)."""
    ids = prompt.prompt_ids(tokenizer, body, tools)
    if isinstance(body, ChatCompletionRequest):
        return ids, json.dumps([m.model_dump(exclude_none=True) for m in body.messages], ensure_ascii=False)
    return ids, body.text() if body.token_ids() is None else json.dumps(body.prompt)


def _check_context(prompt_tokens: int, requested: int | None, limit: int, params: tuple[str, str]) -> None:
    """`prompt_tokens` is exact after tokenizing and a lower bound before."""
    if prompt_tokens >= limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has at least {prompt_tokens}",
            param=params[0],
            code="context_length_exceeded",
        )
    if requested is not None and prompt_tokens + requested > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; you requested at least {prompt_tokens} "
            f"prompt + {requested} completion tokens",
            param=params[1],
            code="context_length_exceeded",
        )
