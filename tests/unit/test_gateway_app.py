"""The Starlette app with a FakeEngine and a FakeVerifier: status codes the real engine rarely produces."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine import EngineDeadError, EngineOverloadedError, RequestOutput, SamplingParams, Usage
from gateway.app import Deps, create_app
from security.jwt import AuthError
from security.principal import Principal


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
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
        self.calls: list[tuple[str, str | None]] = []

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        self.calls.append((request_id, cache_salt))
        if self.mode == "overloaded":
            raise EngineOverloadedError("the engine's waiting queue is full (1 requests)")
        yield RequestOutput(request_id, [104], "h")
        if self.mode == "dies":
            raise EngineDeadError("the engine stopped after an internal error; restart the server")
        yield RequestOutput(request_id, [105], "i", "length", Usage(len(prompt), 2))


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
    seen: list[dict[str, Any]] = []

    async def hook(scope: Any, audit: dict[str, Any]) -> None:
        seen.append(dict(audit))

    c, _ = client(on_complete=hook)
    with c:
        c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer bad"})
        c.post("/v1/chat/completions", json={"model": "fake"}, headers=AUTH)
        c.get("/nope", headers=AUTH)
    assert [a["status"] for a in seen] == [200, 401, 400, 404]
    assert (
        seen[0]["completion_tokens"] == 2 and seen[0]["tenant"] == "acme" and seen[1]["auth_failure"] == "bad_signature"
    )
