"""/v1/chat/completions, /v1/completions, /v1/models, /health, /ready, /openapi.json: parse → engine → respond."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)
from gateway import admission
from gateway.errors import APIError, error_body
from gateway.protocol import ChatCompletionRequest, CompletionRequest, openapi_schema, parse
from gateway.streaming import DONE, ResponseBuilder, sse
from security.principal import Principal


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def models(request: Request) -> Response:
    engine, principal = request.state.deps.engine, request.scope["principal"]
    data = [{"id": engine.model_name, "object": "model", "created": request.state.deps.started, "owned_by": "tianmen"}]
    return JSONResponse({"object": "list", "data": [m for m in data if principal.may_use(m["id"])]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    if not request.state.deps.engine.ready:
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "5"})
    return JSONResponse({"status": "ready", "model": request.state.deps.engine.model_name})


async def metrics(request: Request) -> Response:
    deps = request.state.deps
    _require_admin(request)
    if deps.metrics is None:
        raise APIError(404, "metrics are not enabled", code="not_found")
    return Response(deps.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def profile(request: Request) -> Response:
    """Record the next N engine steps with torch.profiler into a Chrome trace (admin scope)."""
    deps = request.state.deps
    _require_admin(request)
    body = await _read_json(request)
    steps = body.get("steps") if isinstance(body, dict) else None
    if not isinstance(steps, int) or not 1 <= steps <= 10_000:
        raise APIError(400, "steps must be an integer in [1, 10000]", param="steps")
    trace = deps.profile_dir / f"trace-{request.scope['request_id']}.json"
    deps.profile_dir.mkdir(parents=True, exist_ok=True)
    deps.engine.profile(steps, trace)
    return JSONResponse({"trace": str(trace), "steps": steps})


def _require_admin(request: Request) -> None:
    scope = request.state.deps.admin_scope
    if not request.scope["principal"].has_scope(scope):
        raise APIError(403, f"this endpoint needs the {scope!r} scope", code="insufficient_scope")


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema())


async def _read_json(request: Request) -> Any:
    try:
        body = await request.body()
    except ClientDisconnect:  # gone before the body was in (or cut by the shutdown): nobody to answer, no trace
        raise APIError(
            400, "the connection closed before the request body was complete", code="client_disconnected"
        ) from None
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def _check_model(engine: Any, principal: Principal, model: str) -> None:
    if model != engine.model_name:
        raise APIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
    if not principal.may_use(model):
        raise APIError(403, f"this token may not use the model {model!r}", param="model", code="model_not_allowed")


def _prompt_ids(engine: Any, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
    tok = engine.tokenizer
    try:
        if isinstance(body, ChatCompletionRequest):
            messages = [m.to_template() for m in body.messages]
            for i, m in enumerate(messages):
                token = tok.find_control_token(m["content"])
                if token is not None:  # NOTE: it would become a real control token and forge a role turn
                    raise APIError(
                        400,
                        f"message content contains the control token {token!r}; control tokens "
                        "may only come from the chat template",
                        param=f"messages.{i}.content",
                    )
            return list(tok.encode_chat(messages))
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)  # type: ignore[arg-type]
        text = prompt[0] if isinstance(prompt, list) else prompt
        return list(tok.encode(text))
    except InvalidRequestError as e:
        field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise APIError(400, str(e), param=e.param or field) from None


async def _complete(request: Request, chat: bool) -> Response:
    deps = request.state.deps
    engine = deps.engine
    if not engine.ready:
        raise APIError(503, "the engine is not ready; retry shortly", headers={"Retry-After": "5"})
    principal: Principal = request.scope["principal"]
    audit: dict[str, Any] = request.scope["audit"]
    body = parse(ChatCompletionRequest if chat else CompletionRequest, await _read_json(request))
    audit["model"], audit["stream"] = body.model, body.stream
    _check_model(engine, principal, body.model)
    prompt = _prompt_ids(engine, body)
    audit["prompt_tokens"] = len(prompt)
    limit = engine.max_model_len
    param = "messages" if chat else "prompt"
    if len(prompt) >= limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has {len(prompt)}",
            param=param,
            code="context_length_exceeded",
        )
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        max_tokens = limit - len(prompt)
    elif len(prompt) + max_tokens > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; you requested {len(prompt)} "
            f"prompt + {max_tokens} completion tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    audit["prompt_text"] = (
        json.dumps([m.model_dump(exclude_none=True) for m in body.messages], ensure_ascii=False)
        if isinstance(body, ChatCompletionRequest)
        else (body.prompt if isinstance(body.prompt, str) else json.dumps(body.prompt))
    )
    n_logprobs = body.num_logprobs() if isinstance(body, ChatCompletionRequest) else body.logprobs
    params = [body.sampling_params(max_tokens, n_logprobs, i) for i in range(body.n)]

    requested = body.requested_max_tokens()
    est = len(prompt) + body.n * (requested or deps.default_completion_estimate)
    adm = await admission.admit(deps.limiter, principal, est, audit)
    headers = dict(adm.headers) if adm is not None else {}
    try:
        return await _run(request, engine, body, prompt, params, n_logprobs is not None, adm, headers)
    finally:  # a stream settles when it ends; everything else (done, failed, cut) settles here
        if not audit.get("settled_by_stream"):
            await admission.settle(deps.limiter, adm, int(audit.get("total_tokens", 0)))


async def _run(
    request: Request,
    engine: Any,
    body: ChatCompletionRequest | CompletionRequest,
    prompt: list[int],
    params: list[SamplingParams],
    want_lp: bool,
    adm: Any,
    headers: dict[str, str],
) -> Response:
    deps, audit = request.state.deps, request.scope["audit"]
    chat = isinstance(body, ChatCompletionRequest)
    req_id = ("chatcmpl-" if chat else "cmpl-") + request.scope["request_id"]
    builder = ResponseBuilder(chat, req_id, engine.model_name, body.n, engine.tokenizer.token_text)
    started = time.monotonic()
    stream = _generate(engine, prompt, params, req_id, request.scope["principal"].tenant)
    first = await _first(stream)
    audit["ttft_ms"] = (time.monotonic() - started) * 1e3
    gaps: list[float] = audit.setdefault("itl_s", [])
    last_token_at: dict[int, float] = {}

    def tick(i: int, out: RequestOutput) -> None:  # inter-token latency, per choice
        if out.new_token_ids:
            now = time.monotonic()
            if i in last_token_at:
                gaps.append(now - last_token_at[i])
            last_token_at[i] = now

    if body.stream:

        async def events() -> AsyncIterator[bytes]:
            finished = False
            try:
                item: tuple[int, RequestOutput] | None = first
                while item is not None:
                    i, out = item
                    builder.add(i, out)
                    tick(i, out)
                    if out.new_text or out.finished or not builder.choices[i].started or out.logprobs:
                        yield builder.chunk(i, out, want_lp, body.include_usage)
                    try:
                        item = await anext(stream, None)
                    except EngineError as e:  # headers are gone: report in-band, as OpenAI does
                        yield sse(error_body(503, str(e), code="engine_error"))
                        audit["error"] = type(e).__name__
                        return
                finished = True
                if body.include_usage:
                    yield builder.usage_chunk()
                yield DONE
            finally:
                _record(audit, builder, None if finished else "client_disconnected")
                await stream.aclose()
                await admission.settle(deps.limiter, adm, audit["total_tokens"])

        audit["settled_by_stream"] = True
        headers["Cache-Control"] = "no-cache"
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def collect() -> None:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            builder.add(*item)
            tick(*item)
            item = await anext(stream, None)

    try:
        completed = await _until_disconnect(request, collect())
    finally:
        await stream.aclose()
        _record(audit, builder, None)
    if not completed:
        audit["finish_reason"] = "client_disconnected"
        return Response(status_code=499)  # nobody is listening any more; recorded for the audit trail
    return JSONResponse(builder.body(want_lp), headers=headers)


def _record(audit: dict[str, Any], builder: ResponseBuilder, override: str | None) -> None:
    usage = builder.usage()
    audit["completion_tokens"] = usage["completion_tokens"]
    audit["total_tokens"] = usage["total_tokens"]
    audit["cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
    audit["finish_reason"] = override or ",".join(sorted({c.finish_reason or "none" for c in builder.choices}))
    audit["response_text"] = "".join(c.text for c in builder.choices)


async def _generate(
    engine: Any, prompt: list[int], params: list[SamplingParams], req_id: str, salt: str
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """All n choices' deltas, tagged with their index; leaving early aborts every choice."""
    if len(params) == 1:
        async for out in engine.generate(prompt, params[0], req_id, cache_salt=salt):
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(i: int, p: SamplingParams) -> None:
        try:
            async for out in engine.generate(prompt, p, f"{req_id}-{i}", cache_salt=salt):
                q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(params)]
    try:
        remaining = len(params)
        while remaining:
            i, item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first(stream: AsyncIterator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput]:
    """Wait for the first delta so admission errors still become proper status codes."""
    try:
        return await anext(stream)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    except EngineOverloadedError as e:
        raise APIError(503, f"{e}; retry shortly", code="overloaded", headers={"Retry-After": "1"}) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from None


async def _until_disconnect(request: Request, work: Any) -> bool:
    """Run `work`; False if the client hung up first (then `work` is cancelled, which aborts the request)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False
