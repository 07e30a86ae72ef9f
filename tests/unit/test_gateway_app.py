"""The Starlette app with a FakeEngine and a FakeVerifier: status codes the real engine rarely produces."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine import EngineDeadError, EngineOverloadedError, RequestFailedError, RequestOutput, SamplingParams, Usage
from gateway import offload
from gateway.app import Deps, create_app
from gateway.auth_guard import FailedAuthLimiter
from gateway.state import RequestState
from security.jwt import AuthError
from security.principal import Principal
from security.ratelimit import RateLimitConfig, RateLimiter, RateLimitTier


class FakeTokenizer:
    vocab_size = 512
    renders_tools = False  # tools, if any, go into the messages (the Hermes fallback)

    def __init__(self) -> None:
        self.threads: list[int] = []  # where each encoding ran

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def find_control_token(self, text: str) -> str | None:
        return "<|ctl|>" if "<|ctl|>" in text else None


class FakeEngine:
    model_name = "fake"
    max_model_len = 128

    def __init__(self, mode: str = "ok") -> None:
        self.mode, self.ready, self.tokenizer = mode, mode != "loading", FakeTokenizer()
        self.healthy = mode != "stopped"
        self.calls: list[tuple[str, str | None]] = []
        self.params: list[SamplingParams] = []

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        self.calls.append((request_id, cache_salt))
        self.params.append(params)
        self.loop_thread = threading.get_ident()
        if self.mode == "overloaded":
            raise EngineOverloadedError("the engine's waiting queue is full (1 requests)")
        if self.mode == "fails":
            raise RequestFailedError("this request failed in the engine")
        yield RequestOutput(request_id, [104], "h")
        if self.mode == "dies":
            raise EngineDeadError("the engine stopped after an internal error; restart the server")
        yield RequestOutput(request_id, [105], "i", "length", Usage(len(prompt), 2, cached_tokens=1))

    async def generate_batches(
        self, prompt: list[int], params: SamplingParams, request_id: str, cache_salt: str | None = None
    ) -> AsyncIterator[list[RequestOutput]]:
        async for out in self.generate(prompt, params, request_id, cache_salt):
            yield [out]


class FakeVerifier:
    async def verify(self, token: str) -> Principal:
        if token == "bad":
            raise AuthError("bad_signature")
        scopes = frozenset(token.split(","))
        return Principal("alice", "acme", scopes, None, None)


def client(mode: str = "ok", **kw: Any) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(mode)
    return TestClient(create_app(Deps(engine=engine, verifier=FakeVerifier(), **kw))), engine


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hey"}]}
AUTH = {"Authorization": "Bearer inference"}


def test_ok_and_tenant_is_the_cache_salt() -> None:
    c, engine = client()
    with c:
        r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
    assert r.headers["x-request-id"] and engine.calls[0][1] == "acme"


def test_overloaded_engine_is_503_with_retry_after() -> None:
    c, _ = client("overloaded")
    with c:
        r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"


def test_engine_not_ready_is_503() -> None:
    c, _ = client("loading")
    with c:
        assert c.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 503
        assert c.get("/ready").status_code == 503
        assert c.get("/health").status_code == 200


def test_engine_dying_mid_stream_reports_in_band() -> None:
    c, _ = client("dies")
    with c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    assert r.status_code == 200
    assert '"error"' in r.text and "restart the server" in r.text and "[DONE]" not in r.text


def test_required_scope_and_bad_signature() -> None:
    c, _ = client(required_scope="inference")
    with c:
        assert c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer other"}).status_code == 403
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer bad"})
        assert r.status_code == 401 and "bad_signature" in r.headers["www-authenticate"]
        assert c.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200


@pytest.mark.parametrize("body", [{"model": "fake", "prompt": "x", "echo": True}, {"model": "fake", "prompt": []}])
def test_unsupported_completion_fields_are_400(body: dict[str, Any]) -> None:
    c, _ = client()
    with c:
        assert c.post("/v1/completions", json=body, headers=AUTH).status_code == 400


def test_audit_hook_sees_every_outcome() -> None:
    seen: list[RequestState] = []

    async def hook(scope: Any, state: RequestState) -> None:
        assert scope["request_state"] is state
        seen.append(state)

    c, _ = client(on_complete=hook)
    with c:
        c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer bad"})
        c.post("/v1/chat/completions", json={"model": "fake"}, headers=AUTH)
        c.get("/nope", headers=AUTH)
    assert [a.status for a in seen] == [200, 401, 400, 404]
    assert seen[0].completion_tokens == 2 and seen[0].tenant == "acme" and seen[1].auth_failure == "bad_signature"
    assert seen[0].prompt_tokens == 3 and seen[0].cached_tokens == 1 and seen[0].ttft_ms is not None


def test_engine_errors_map_through_one_table() -> None:
    for mode, status, code in (("overloaded", 503, "overloaded"), ("fails", 503, "request_failed")):
        c, _ = client(mode)
        with c:
            r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert r.status_code == status and r.json()["error"]["code"] == code and r.headers["retry-after"] == "1"
    c, _ = client("dies")  # dying after the first delta, without a stream: still an OpenAI-shaped 503
    with c:
        r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_response_start_hook_runs_before_the_first_byte() -> None:
    order: list[str] = []

    async def start(scope: Any, state: RequestState) -> None:
        order.append(f"start:{state.status}")

    async def done(scope: Any, state: RequestState) -> None:
        order.append(f"done:{state.status}")

    c, _ = client(on_response_start=start, on_complete=done)
    with c:
        assert c.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
        assert c.get("/health").status_code == 200  # probes are not audited
    assert order == ["start:200", "done:200"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_response_start_hook_turns_the_answer_into_503(stream: bool) -> None:
    seen: list[RequestState] = []

    async def start(scope: Any, state: RequestState) -> None:
        raise OSError("disk full")

    async def done(scope: Any, state: RequestState) -> None:
        seen.append(state)

    c, engine = client(on_response_start=start, on_complete=done)
    with c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "audit_unavailable"
        assert r.headers["retry-after"] and r.headers["x-request-id"] and "data:" not in r.text
    assert seen[0].status == 503 and seen[0].error == "audit_unavailable" and engine.calls


def test_failed_authentications_per_source_become_429() -> None:
    now = [0.0]
    guard = FailedAuthLimiter(per_minute=60, burst=3, clock=lambda: now[0])
    c, _ = client(auth_guard=guard)
    bad = {"Authorization": "Bearer bad"}
    with c:
        assert [c.get("/v1/models", headers=bad).status_code for _ in range(3)] == [401, 401, 401]
        r = c.get("/v1/models", headers=bad)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_auth_failures"
        assert r.headers["retry-after"] == "1"
        assert c.get("/v1/models", headers=AUTH).status_code == 200  # a valid token is still served
        now[0] = 1.0  # one failure per second refills
        assert c.get("/v1/models", headers=bad).status_code == 401
        assert c.get("/v1/models", headers=bad).status_code == 429


def test_auth_guard_memory_is_bounded() -> None:
    now = [0.0]
    guard = FailedAuthLimiter(per_minute=1, burst=1, max_sources=100, clock=lambda: now[0])
    assert guard.failed("10.0.0.1") is None and guard.failed("10.0.0.1") == pytest.approx(60)
    for i in range(1000):
        guard.failed(f"10.1.{i // 256}.{i % 256}")
    assert len(guard) == 100
    assert guard.failed("10.0.0.1") is None  # forgotten (the least recently seen go first)


def test_prefix_cache_per_subject_and_hidden_cached_tokens() -> None:
    c, engine = client(cache_salt_per_subject=True, report_cached_tokens=False)
    with c:
        r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 200 and "prompt_tokens_details" not in r.json()["usage"]
    assert engine.calls[0][1] == '["acme", "alice"]'
    c, engine = client()
    with c:
        r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_health_is_503_once_the_engine_stopped() -> None:
    c, _ = client("stopped")
    with c:
        r = c.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "engine stopped"}


def test_logit_bias_reaches_the_engine_and_is_bounded() -> None:
    c, engine = client()
    with c:
        r = c.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"104": 5, "7": -100.0}}, headers=AUTH)
        assert r.status_code == 200 and engine.params[0].logit_bias == {104: 5.0, 7: -100.0}
        for bias, param in (
            ({"104": 101}, "logit_bias.104"),
            ({"x": 1}, "logit_bias"),
            ({"512": 1}, "logit_bias"),  # outside the vocabulary
            ({str(i): 1 for i in range(301)}, "logit_bias"),
        ):
            r = c.post("/v1/chat/completions", json={**CHAT, "logit_bias": bias}, headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bias, r.text)


@pytest.mark.parametrize("inline_bytes", [0, offload.INLINE_BYTES])
def test_only_a_small_prompt_is_tokenized_on_the_event_loop(inline_bytes: int, monkeypatch) -> None:
    monkeypatch.setattr(offload, "INLINE_BYTES", inline_bytes)  # 0: every body counts as large
    c, engine = client()
    with c:
        assert c.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
    on_loop = engine.tokenizer.threads == [engine.loop_thread]
    assert on_loop == (inline_bytes > 0), (engine.tokenizer.threads, engine.loop_thread)


def test_out_of_quota_requests_are_refused_before_any_tokenizing() -> None:
    limiter = RateLimiter(RateLimitConfig(tiers={"default": RateLimitTier(requests_per_minute=1)}))
    c, engine = client(limiter=limiter)
    with c:
        assert c.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
        assert len(engine.tokenizer.threads) == 1
        r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert r.status_code == 429 and r.headers["retry-after"]
    assert len(engine.tokenizer.threads) == 1  # the refused request was never templated nor tokenized


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing() -> None:
    c, engine = client()
    long = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}  # fake tokens are 1 char; context 128
    with c:
        r = c.post("/v1/chat/completions", json=long, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert engine.tokenizer.threads == []
