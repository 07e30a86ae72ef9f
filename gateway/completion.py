"""One admitted completion through the engine: the first delta (so engine errors keep their status), then
the JSON body or the SSE stream, the per-request record, and the lease settled when the call really ends."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine import EngineError, RequestOutput, SamplingParams
from gateway.admission import Lease
from gateway.errors import engine_error, error_body, error_payload
from gateway.privacy import CompletionGuard, PrivacySession
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.state import RequestState
from gateway.streaming import DONE, ResponseBuilder, merge, sse
from gateway.tools.plan import ToolPlan

log = logging.getLogger("tianmen.gateway")

WATCH_AFTER_S = 0.05  # a non-streamed request watches for its client leaving from then on


def cache_salt(tenant: str, subject: str, per_subject: bool) -> str:
    """The prefix-cache partition: the tenant, or (per_subject) the tenant and subject joined unambiguously."""
    return json.dumps([tenant, subject], ensure_ascii=True) if per_subject else tenant


async def run(
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    prompt: list[int],
    params: list[SamplingParams],
    lease: Lease,
    engine: Any,
    privacy: PrivacySession | None = None,
    tools: ToolPlan | None = None,
) -> Response:
    """`engine`: the served model's (gateway.models routes the request to it)."""
    deps, state = request.app.state.deps, request.scope["request_state"]
    chat = isinstance(body, ChatCompletionRequest)
    want_lp = body.num_logprobs() is not None
    req_id = ("chatcmpl-" if chat else "cmpl-") + request.scope["request_id"]
    builder = ResponseBuilder(
        chat,
        req_id,
        engine.model_name,
        body.n,
        engine.tokenizer.token_text,
        report_cached=deps.report_cached_tokens,
        tools=tools,
    )
    principal = request.scope["principal"]
    salt = cache_salt(principal.tenant, principal.subject, deps.cache_salt_per_subject)
    started = time.monotonic()
    guard = privacy.completion(body.n) if privacy is not None else None  # None: the text passes untouched
    stream = _generate(engine, prompt, params, req_id, salt)
    if guard is not None:
        stream = _guarded(stream, guard)
    first = await _first(stream)
    state.ttft_ms = (time.monotonic() - started) * 1e3
    gaps = state.itl_s
    last_token_at: dict[int, float] = {}
    headers = lease.headers

    def tick(i: int, out: RequestOutput) -> None:  # inter-token latency, per choice
        n = len(out.new_token_ids)
        if n:
            now = time.monotonic()
            if i in last_token_at:  # tokens that came together share their gap, as the load generator counts
                gaps.extend([(now - last_token_at[i]) / n] * n)
            last_token_at[i] = now

    if body.stream:

        async def events() -> AsyncIterator[bytes]:
            finished = False
            try:
                ready: list[tuple[int, RequestOutput]] | None = first
                while ready is not None:
                    chunks = []  # what is ready together goes out in one write (one TLS record)
                    for i, out in ready:
                        builder.add(i, out)
                        tick(i, out)
                        if out.new_text or out.finished or not builder.choices[i].started or out.logprobs:
                            chunks.append(builder.chunk(i, out, want_lp, body.include_usage))
                    if all(c.finish_reason is not None for c in builder.choices):
                        finished = True
                        if body.include_usage:
                            chunks.append(builder.usage_chunk())
                        if guard is not None and guard.blocked is not None:  # named in-band, as OpenAI does errors
                            chunks.append(sse(guard.error()))
                        yield b"".join([*chunks, DONE])
                        return
                    if chunks:
                        yield b"".join(chunks)
                    try:
                        ready = await anext(stream, None)
                    except Exception as e:  # headers are gone: report in-band, as OpenAI does
                        yield sse(_in_band(e, state))
                        return
                finished = True  # NOTE: not reached while the engine keeps its contract (every choice finishes)
                yield (builder.usage_chunk() if body.include_usage else b"") + DONE
            finally:
                _record(state, builder, None if finished or state.error else "client_disconnected", guard)
                await stream.aclose()
                await lease.settle(state.total_tokens)

        state.settled_by_stream = True
        headers["Cache-Control"] = "no-cache"
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def collect() -> None:
        ready: list[tuple[int, RequestOutput]] | None = first
        while ready is not None:
            for i, out in ready:
                builder.add(i, out)
                tick(i, out)
            try:
                ready = await anext(stream, None)
            except EngineError as e:
                state.error = type(e).__name__
                raise engine_error(e) from None

    try:
        completed = await _until_disconnect(request, collect())
    except BaseException:
        _record(state, builder, None, guard)  # what came before the failure, for the audit trail
        raise
    finally:
        await stream.aclose()
    if not completed:
        _record(state, builder, None, guard)
        state.finish_reason = "client_disconnected"
        return Response(status_code=499)  # nobody is listening any more; recorded for the audit trail
    try:
        response = builder.body(want_lp)
    finally:  # after the body: parsing the answer for tool calls may have changed its finish reason
        _record(state, builder, None, guard)
    return JSONResponse(response, headers=headers)


def _in_band(e: Exception, state: RequestState) -> dict[str, Any]:
    state.error = type(e).__name__
    if isinstance(e, EngineError):
        return error_payload(engine_error(e))
    log.error("request %s failed mid-stream: %s", state.request_id, type(e).__name__, exc_info=e)
    return error_body(500, "internal error; the request id in x-request-id identifies it in the logs")


def _record(
    state: RequestState, builder: ResponseBuilder, override: str | None, guard: CompletionGuard | None = None
) -> None:
    usage = builder.usage()
    state.completion_tokens = usage["completion_tokens"]
    state.total_tokens = usage["total_tokens"]
    state.cached_tokens = builder.cached_tokens()
    state.finish_reason = override or ",".join(sorted({c.finish_reason or "none" for c in builder.choices}))
    if guard is not None:
        guard.close()
    # the audit trail keeps the answer as the policy rewrote it (a tokenized prompt's placeholders not restored)
    state.response_text = guard.audit_text() if guard is not None else "".join(c.text for c in builder.choices)
    state.tool_calls = builder.tool_names() if builder.tools is not None else None


async def _guarded(
    stream: AsyncIterator[list[tuple[int, RequestOutput]]], guard: CompletionGuard
) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """The engine's deltas through the privacy policy (gateway.privacy); closing it closes the engine's."""
    try:
        async for ready in stream:
            yield guard.apply(ready)
    finally:
        await stream.aclose()


async def _generate(
    engine: Any, prompt: list[int], params: list[SamplingParams], req_id: str, salt: str
) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """The deltas ready together, tagged with their choice's index: one merged delta per choice (a client that
    fell behind gets one chunk for all of them), choices in the order they came. Leaving early aborts them all."""
    if len(params) == 1:
        batches = engine.generate_batches(prompt, params[0], req_id, cache_salt=salt)
        try:
            async for batch in batches:
                yield [(0, merge(batch))]
        finally:
            await batches.aclose()
        return
    q: asyncio.Queue[tuple[int, list[RequestOutput] | BaseException]] = asyncio.Queue()

    async def pump(i: int, p: SamplingParams) -> None:
        try:
            async for batch in engine.generate_batches(prompt, p, f"{req_id}-{i}", cache_salt=salt):
                q.put_nowait((i, batch))
        except Exception as e:
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(params)]
    try:
        remaining = len(params)
        while remaining:
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
            by_choice: dict[int, list[RequestOutput]] = {}
            for i, item in items:
                if isinstance(item, BaseException):
                    raise item
                by_choice.setdefault(i, []).extend(item)
            ready = [(i, merge(outs)) for i, outs in by_choice.items()]
            remaining -= sum(out.finished for _, out in ready)
            yield ready
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first(stream: AsyncIterator[list[tuple[int, RequestOutput]]]) -> list[tuple[int, RequestOutput]]:
    """Wait for the first delta so admission errors still become proper status codes."""
    try:
        return await anext(stream)
    except EngineError as e:
        raise engine_error(e) from None


async def _until_disconnect(request: Request, work: Any, watch_after_s: float = WATCH_AFTER_S) -> bool:
    """Await `work` in this task; False if the client hung up first (then `work` is cancelled, which aborts the
    request). One watcher task, which cancels this one: cheaper than running `work` as a task of its own.

    WHY the watcher starts only after `watch_after_s`: most answers are done sooner, and a task made and
    cancelled per request cost the event loop ~3% of its CPU at saturation (a timer costs a fraction of it); a
    client that leaves is still noticed, at most that much later."""
    task = asyncio.current_task()
    assert task is not None
    gone = False
    watcher: asyncio.Future[None] | None = None

    async def disconnected() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(disconnected())

    timer = asyncio.get_running_loop().call_later(watch_after_s, watch)
    try:
        await work
        return True
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (shutdown): not ours to swallow
        if hasattr(task, "uncancel"):  # Python 3.11+: the cancel was ours and is handled
            task.uncancel()
        return False
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()
