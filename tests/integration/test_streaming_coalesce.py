"""Streams through the gateway deliver exactly the tokens they would alone, however their chunks are coalesced:
16 concurrent streams over TLS with the official client, and a client forced behind (every delta after the
first ready at once, so they go out as one chunk) with stop strings, include_usage and n > 1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from engine import AsyncEngine, EngineConfig, RequestOutput, SamplingParams
from gateway.app import Deps, create_app
from security.tls import client_ssl_context
from tests.gateway_server import RunningGateway, run_gateway
from tests.tiny_model import build_tiny_chat_model
from tests.unit.test_gateway_app import AUTH, FakeVerifier

TOKENS = 24
# greedy decoding of the tiny random model repeats one token: seeded sampling gives varied text (and characters
# split across tokens), and a seeded request draws the same tokens whatever else is in its batch
WAIT_S = 60.0  # a bound on waiting for the engine, not a speed requirement


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[RunningGateway]:
    with run_gateway(tmp_path_factory.mktemp("home"), model) as g:
        yield g


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i}: what is the capital of France?"}]


async def test_sixteen_concurrent_streams_get_what_each_gets_alone(gw: RunningGateway) -> None:
    http = httpx.AsyncClient(verify=client_ssl_context(gw.pki.ca_cert), limits=httpx.Limits(max_connections=16))
    c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=gw.token(), http_client=http, max_retries=0)
    common: dict[str, Any] = {"model": gw.model, "max_tokens": TOKENS, "temperature": 1.0}
    try:
        alone = []
        for i in range(16):  # one at a time, not streamed
            r = await c.chat.completions.create(messages=messages(i), seed=i, **common)  # type: ignore[call-overload]
            alone.append((r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens))

        async def streamed(i: int) -> tuple[str, int, int]:
            stream = await c.chat.completions.create(
                messages=messages(i), seed=i, stream=True, stream_options={"include_usage": True}, **common
            )
            parts, usage = [], None
            async for chunk in stream:
                parts += [ch.delta.content or "" for ch in chunk.choices]
                usage = chunk.usage or usage
            assert usage is not None
            return "".join(parts), usage.prompt_tokens, usage.completion_tokens

        assert await asyncio.gather(*(streamed(i) for i in range(16))) == alone
        r = await c.chat.completions.create(messages=messages(3), n=2, seed=3, stream=True, **common)
        texts = ["", ""]
        async for chunk in r:
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
        assert texts == [alone[3][0], alone[4][0]]  # choice i draws with seed + i
    finally:
        await c.close()


class Behind:
    """The real engine, read by a caller that falls behind: after the first batch it waits until the engine has
    nothing left to do, so every further delta is ready at once (what a slow client sees)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate_batches(
        self, prompt: list[int], params: SamplingParams, request_id: str, cache_salt: str | None = None
    ) -> AsyncIterator[list[RequestOutput]]:
        batches = self.engine.generate_batches(prompt, params, request_id, cache_salt)
        try:
            yield await anext(batches)
            for _ in range(int(WAIT_S / 0.01)):
                stats = self.engine.stats()
                if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                    break
                await asyncio.sleep(0.01)
            async for batch in batches:
                yield batch
        finally:
            await batches.aclose()


@pytest.fixture(scope="module")
def apps(model: Path) -> Iterator[tuple[TestClient, TestClient]]:
    engine = AsyncEngine.from_config(EngineConfig(model=model, dtype="float32", enable_prefix_caching=False))
    with (
        TestClient(create_app(Deps(engine=engine, verifier=FakeVerifier()))) as plain,
        TestClient(create_app(Deps(engine=Behind(engine), verifier=FakeVerifier()))) as behind,
    ):
        yield plain, behind
    asyncio.run(engine.shutdown())


def sse(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    body = {"model": "tiny-chat", "messages": messages(0), "temperature": 1.0, "seed": 7, "stream": True, **body}
    r = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def content(events: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(ch["delta"].get("content") or "" for e in events for ch in e["choices"] if ch["index"] == index)


def usage(events: list[dict[str, Any]]) -> dict[str, Any]:
    return events[-1]["usage"]


def test_coalesced_chunks_carry_every_token_once(apps: tuple[TestClient, TestClient]) -> None:
    plain, behind = apps
    body = {"max_tokens": TOKENS, "logprobs": True, "stream_options": {"include_usage": True}}
    ref, got = sse(plain, **body), sse(behind, **body)
    assert content(got) == content(ref) and usage(got) == usage(ref) and usage(got)["completion_tokens"] == TOKENS
    per_chunk = [len((ch["logprobs"] or {}).get("content", [])) for e in got for ch in e["choices"]]
    carrying = [n for n in per_chunk if n]  # what was ready when the first was asked for, then all the rest
    assert len(carrying) <= 2 and sum(carrying) == TOKENS
    assert [e["choices"][0]["finish_reason"] for e in got if e["choices"]][-1] == "length"


def test_stop_strings_across_coalesced_chunks(apps: tuple[TestClient, TestClient]) -> None:
    plain, behind = apps
    full = content(sse(plain, max_tokens=60, ignore_eos=True))
    stop = full[9:13]
    assert full.index(stop) > 0
    body = {"max_tokens": 60, "ignore_eos": True, "stop": [stop], "stream_options": {"include_usage": True}}
    ref, got = sse(plain, **body), sse(behind, **body)
    assert content(got) == content(ref) == full[: full.index(stop)]
    assert usage(got) == usage(ref) and usage(got)["completion_tokens"] < 60
    assert [e["choices"][0]["finish_reason"] for e in got if e["choices"]][-1] == "stop"


def test_n_choices_coalesced(apps: tuple[TestClient, TestClient]) -> None:
    plain, behind = apps
    alone = [content(sse(plain, max_tokens=TOKENS, ignore_eos=True, seed=7 + i)) for i in range(3)]
    body = {"max_tokens": TOKENS, "ignore_eos": True, "n": 3, "stream_options": {"include_usage": True}}
    got = sse(behind, **body)
    assert [content(got, i) for i in range(3)] == alone and len(set(alone)) == 3
    assert usage(got)["completion_tokens"] == 3 * TOKENS
