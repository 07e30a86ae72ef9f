"""The request body as the routes read it (gateway.routes._body, straight from the ASGI messages): a body sent in
chunks comes back whole, a client gone before its body ends gets 400 `client_disconnected`, and the body-size
limit still cuts a body that outgrows it as it streams in."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from starlette.requests import Request

from gateway.errors import APIError
from gateway.middleware import BodyLimit
from gateway.routes import _body


def _request(messages: list[dict]) -> Request:
    it: Iterator[dict] = iter(messages)

    async def receive() -> dict:
        return next(it)

    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)


def test_a_body_in_chunks_comes_back_whole() -> None:
    parts = [b'{"model": ', b'"m", "prompt"', b': "hi"}']
    messages = [{"type": "http.request", "body": p, "more_body": i < 2} for i, p in enumerate(parts)]
    assert asyncio.run(_body(_request(messages))) == b"".join(parts)
    assert asyncio.run(_body(_request([{"type": "http.request", "body": b"{}"}]))) == b"{}"
    assert asyncio.run(_body(_request([{"type": "http.request"}]))) == b""  # no body at all


def test_a_client_gone_before_its_body_ends_gets_400() -> None:
    messages = [{"type": "http.request", "body": b'{"mod', "more_body": True}, {"type": "http.disconnect"}]
    with pytest.raises(APIError) as e:
        asyncio.run(_body(_request(messages)))
    assert e.value.status == 400 and e.value.code == "client_disconnected"


def test_the_size_limit_cuts_a_body_that_outgrows_it_while_streaming() -> None:
    seen: list[APIError] = []

    async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await _body(Request(scope, receive))
        except APIError as e:
            seen.append(e)

    chunks = [{"type": "http.request", "body": b"x" * 60, "more_body": True} for _ in range(3)]
    it = iter(chunks)

    async def receive() -> dict:
        return next(it)

    async def send(message: dict) -> None:
        raise AssertionError("nothing is sent here")

    asyncio.run(BodyLimit(app, max_bytes=100)({"type": "http", "headers": []}, receive, send))
    assert len(seen) == 1 and seen[0].status == 413 and seen[0].code == "request_too_large"
