"""Rate limits through the real gateway: two gateways sharing one real redis-server, headers, outages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from security.tls import client_ssl_context
from tests.gateway_server import RunningGateway, run_gateway
from tests.redis_server import RedisServer
from tests.tiny_model import build_tiny_chat_model

BODY = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


def limits(redis: RedisServer, **kw: str) -> dict[str, str]:
    env = {
        "TIANMEN_RATELIMIT_REDIS_URL": redis.url,
        "TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE": "5",
        "TIANMEN_RATELIMIT_TOKENS_PER_MINUTE": "none",
        "TIANMEN_RATELIMIT_MAX_CONCURRENT": "none",
    }
    env.update(kw)
    return env


def call(gw: RunningGateway, token: str, body: dict | None = None) -> httpx.Response:
    with httpx.Client(verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as c:
        return c.post(
            gw.url + "/v1/chat/completions",
            json={"model": gw.model, **(body or BODY)},
            headers={"Authorization": f"Bearer {token}"},
        )


def test_two_gateways_share_one_limit(tmp_path: Path, model: Path, redis: RedisServer) -> None:
    home = tmp_path / "home"
    with run_gateway(home, model, limits(redis)) as a, run_gateway(home, model, limits(redis)) as b:
        token = a.token(sub="carol")
        statuses = [call(gw, token).status_code for gw in (a, b) * 5]
        assert statuses.count(200) == 5 and statuses.count(429) == 5
        refused = call(a, token)
        err = refused.json()["error"]
        assert refused.status_code == 429 and err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
        assert 1 <= int(refused.headers["retry-after"]) <= 13  # GCRA: one request every 12 s at 5/min
        ok = call(b, b.token(sub="dave"))  # another subject has its own budget
        assert ok.status_code == 200
        assert ok.headers["x-ratelimit-limit-requests"] == "5" and ok.headers["x-ratelimit-remaining-requests"] == "4"
        assert ok.headers["x-ratelimit-reset-requests"].endswith("s")


def test_tokens_are_settled_with_real_counts(tmp_path: Path, model: Path, redis: RedisServer) -> None:
    # 1000 tokens/min refill at ~17/s: every check below leaves a margin of hundreds of tokens
    env = limits(redis, TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE="none", TIANMEN_RATELIMIT_TOKENS_PER_MINUTE="1000")
    with run_gateway(tmp_path / "home", model, env) as gw:
        token = gw.token(sub="erin")
        probe = call(gw, token, {**BODY, "max_tokens": 8, "ignore_eos": True}).json()
        text = probe["choices"][0]["message"]["content"]
        # a call that stops early: admission reserves prompt + 450, settlement refunds the unused part
        short = call(gw, token, {**BODY, "max_tokens": 450, "ignore_eos": True, "stop": [text[2:4]]})
        assert short.json()["choices"][0]["finish_reason"] == "stop"
        assert int(short.headers["x-ratelimit-remaining-tokens"]) < 600  # the reservation was charged
        # ...and refunded down to the few tokens really used (the header shows this call's reservation taken too:
        # before tokenizing it bounds the prompt by its bytes plus the template's markup, ~150 tokens here)
        after_short = int(call(gw, token).headers["x-ratelimit-remaining-tokens"])
        assert after_short > 700
        # a stream cut by the client settles at what it really produced
        body = {"model": gw.model, **BODY, "max_tokens": 450, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as c,
            c.stream(
                "POST", gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}
            ) as r,
        ):
            assert int(r.headers["x-ratelimit-remaining-tokens"]) < 600
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
        after_cut = int(call(gw, token).headers["x-ratelimit-remaining-tokens"])
        assert after_cut > 700


def test_redis_outage_closed_is_503_then_recovers(tmp_path: Path, model: Path, redis: RedisServer) -> None:
    with run_gateway(tmp_path / "home", model, limits(redis, TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE="100")) as gw:
        token = gw.token(sub="frank")
        assert call(gw, token).status_code == 200
        redis.kill()
        r = call(gw, token)
        assert (
            r.status_code == 503 and r.json()["error"]["code"] == "ratelimit_unavailable" and "retry-after" in r.headers
        )
        redis.restart()
        for _ in range(100):  # the limiter probes Redis again at most once a second
            r = call(gw, token)
            if r.status_code == 200:
                break
            assert r.status_code == 503
            time.sleep(0.1)
        assert r.status_code == 200


def test_redis_outage_open_serves(tmp_path: Path, model: Path, redis: RedisServer) -> None:
    env = limits(redis, TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE="100", TIANMEN_RATELIMIT_ON_REDIS_ERROR="open")
    with run_gateway(tmp_path / "home", model, env) as gw:
        redis.kill()
        assert call(gw, gw.token(sub="gina")).status_code == 200


def test_tokens_consumed_stay_within_the_limit_whatever_the_requests(
    tmp_path: Path, model: Path, redis: RedisServer
) -> None:
    limit = 2000
    env = limits(redis, TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE="none", TIANMEN_RATELIMIT_TOKENS_PER_MINUTE=str(limit))
    with run_gateway(tmp_path / "home", model, env) as gw:
        token = gw.token(sub="hank")
        msgs = [{"role": "user", "content": "hello"}]
        bodies = (  # without max_tokens each choice may run to the context: that is what must be reserved
            [{"messages": msgs, "ignore_eos": True}] * 4
            + [{"messages": msgs, "ignore_eos": True, "n": 2}] * 3
            + [{"messages": [{"role": "user", "content": "tell me more " * 20}], "max_tokens": 200, "ignore_eos": True}]
            * 3
        )

        async def one(c: httpx.AsyncClient, body: dict) -> httpx.Response:
            return await c.post("/v1/chat/completions", json={"model": gw.model, **body})

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(
                base_url=gw.url,
                verify=client_ssl_context(gw.pki.ca_cert),
                headers={"Authorization": f"Bearer {token}"},
                timeout=120,
            ) as c:
                return await asyncio.gather(*(one(c, b) for b in bodies))

        started = time.monotonic()
        responses = asyncio.run(run())
        elapsed = time.monotonic() - started
    assert {r.status_code for r in responses} <= {200, 429}
    served = [r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200]
    assert served and any(r.status_code == 429 for r in responses)
    refill = limit * elapsed / 60
    assert sum(served) <= limit + refill + max(served), (served, elapsed)


def test_a_stream_longer_than_the_lease_keeps_its_concurrency_slot(
    tmp_path: Path, model: Path, redis: RedisServer
) -> None:
    ttl = 0.2
    env = limits(
        redis,
        TIANMEN_RATELIMIT_REQUESTS_PER_MINUTE="none",
        TIANMEN_RATELIMIT_MAX_CONCURRENT="1",
        TIANMEN_RATELIMIT_LEASE_TTL_S=str(ttl),
    )
    with run_gateway(tmp_path / "home", model, env) as gw:
        token = gw.token(sub="ivy")
        # sixteen choices (the most a request may ask) of 480 tokens with logprobs: a stream that runs well past the
        # TTL even on a fast machine (four choices ended inside 2 x TTL on a 2-core AMX Xeon)
        body = {"model": gw.model, **BODY, "max_tokens": 480, "ignore_eos": True, "stream": True, "n": 16}
        body |= {"logprobs": True, "top_logprobs": 5}
        with (
            httpx.Client(verify=client_ssl_context(gw.pki.ca_cert), timeout=60) as c,
            c.stream(
                "POST", gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}
            ) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            time.sleep(2 * ttl)  # the lease would have expired twice by now without renewal
            refused = call(gw, token)
            still_running = gw.engine.stats()["num_running"] > 0  # type: ignore[attr-defined]
            assert still_running, "the stream ended before the lease TTL: the check below would prove nothing"
            assert refused.status_code == 429 and "concurrent" in refused.json()["error"]["message"]
            rest = list(lines)
            assert "data: [DONE]" in rest[-2:]
        assert call(gw, token).status_code == 200  # the slot is released when the stream ends
