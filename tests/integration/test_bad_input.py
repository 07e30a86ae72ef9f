"""Bad input through the real HTTPS gateway (uvicorn + TLS 1.3 + JWT + the tiny engine): every case is a 4xx
with an OpenAI-shaped error, never a 5xx, and after each one a normal request is still served."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.client import HTTPSConnection
from typing import Any

import httpx
import pytest

from gateway import routes
from security.tls import client_ssl_context
from tests.audit_spool import spooled
from tests.gateway_server import RunningGateway, run_gateway
from tests.tiny_model import build_tiny_chat_model

M = "MODEL"  # replaced by the served model's name
MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": M, "messages": MSG, "max_tokens": 2}
DEEP = 40  # past the nesting limit of 32


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    model = build_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")
    with run_gateway(tmp_path_factory.mktemp("home"), model) as g:
        yield g


@pytest.fixture(scope="module")
def http(gw: RunningGateway) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {gw.token()}", "Content-Type": "application/json"}
    with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), headers=headers, timeout=60) as c:
        yield c


def chat(**kw: Any) -> dict[str, Any]:
    return {**CHAT, **kw}


def msg(**kw: Any) -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "user", "content": "hi", **kw}]}


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": M, "prompt": "hi", "max_tokens": 2, **kw}


def nested(depth: int) -> Any:
    v: Any = "x"
    for _ in range(depth):
        v = [v]
    return v


RAW: list[tuple[str, bytes]] = [  # (case, body bytes) for /v1/chat/completions
    ("100k-brackets", b"[" * 100_000),
    ("100k-braces", b'{"a":' * 50_000),
    ("nan", b'{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"temperature":NaN}'),
    ("infinity", b'{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"temperature":Infinity}'),
    ("-infinity", b'{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"top_p":-Infinity}'),
    ("1e999", b'{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"temperature":1e999}'),
    ("huge-int-literal", b'{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"n":1' + b"0" * 5000 + b"}"),
    ("invalid-utf8", b'{"model":"MODEL","messages":[{"role":"user","content":"\xff\xfe"}]}'),
    ("overlong-utf8", b'{"model":"MODEL","messages":[{"role":"user","content":"\xc0\xaf"}]}'),
    ("surrogate-content", b'{"model":"MODEL","messages":[{"role":"user","content":"\\ud800"}]}'),
    ("surrogate-low", b'{"model":"MODEL","messages":[{"role":"user","content":"a\\udfffb"}]}'),
    ("surrogate-key", b'{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"\\ud800":1}'),
    ("surrogate-model", b'{"model":"\\ud800","messages":[{"role":"user","content":"hi"}]}'),
    ("surrogate-stop", b'{"model":"MODEL","messages":[{"role":"user","content":"hi"}],"stop":["\\udc00"]}'),
    ("utf16", json.dumps(CHAT).encode("utf-16")),
    ("bom", b"\xef\xbb\xbf" + json.dumps(CHAT).encode()),
    ("not-json", b"{not json"),
    ("truncated", b'{"model":"MODEL","messages":[{"role":"us'),
    ("empty", b""),
    ("null", b"null"),
    ("array", b"[]"),
    ("string", b'"hello"'),
]

CASES: list[tuple[str, str, dict[str, Any], str | None]] = [  # (case, endpoint, body, expected param)
    # nesting inside an otherwise valid request
    ("deep-content", "chat", msg(content=nested(DEEP)), None),
    ("deep-stop", "chat", chat(stop=nested(DEEP)), None),
    ("deep-unknown", "chat", chat(extra=nested(DEEP)), None),
    # integer overflow and out-of-range numbers, every numeric field
    ("n-overflow", "chat", chat(n=2**64), "n"),
    ("n-zero", "chat", chat(n=0), "n"),
    ("n-17", "chat", chat(n=17), "n"),
    ("max_tokens-overflow", "chat", chat(max_tokens=2**63), "max_tokens"),
    ("max_tokens-negative", "chat", chat(max_tokens=-(2**70)), "max_tokens"),
    ("max_tokens-context", "chat", chat(max_tokens=100_000), "max_tokens"),
    ("max_completion_tokens-overflow", "chat", chat(max_completion_tokens=2**64), "max_completion_tokens"),
    ("max_completion_tokens-context", "chat", chat(max_completion_tokens=10**6), "max_completion_tokens"),
    ("seed-2^64", "chat", chat(seed=2**64), "seed"),
    ("seed-below-int64", "chat", chat(seed=-(2**63) - 1), "seed"),
    ("seed-10^30", "chat", chat(seed=10**30), "seed"),
    ("top_k-2^63", "chat", chat(top_k=2**63), "top_k"),
    ("top_k-past-vocab", "chat", chat(top_k=2**31 - 1), "top_k"),  # the engine: at most the vocabulary
    ("top_k-negative", "chat", chat(top_k=-1), "top_k"),
    ("top_logprobs-overflow", "chat", chat(logprobs=True, top_logprobs=2**64), "top_logprobs"),
    ("top_logprobs-21", "chat", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("temperature-huge-int", "chat", chat(temperature=10**400), "temperature"),
    ("temperature-3", "chat", chat(temperature=3), "temperature"),
    ("top_p-huge", "chat", chat(top_p=1e308), "top_p"),
    ("min_p-2", "chat", chat(min_p=2), "min_p"),
    ("presence_penalty-huge", "chat", chat(presence_penalty=-(10**30)), "presence_penalty"),
    ("frequency_penalty-huge", "chat", chat(frequency_penalty=1e300), "frequency_penalty"),
    ("repetition_penalty-huge", "chat", chat(repetition_penalty=1e300), "repetition_penalty"),
    ("repetition_penalty-zero", "chat", chat(repetition_penalty=0), "repetition_penalty"),
    ("logit_bias-value", "chat", chat(logit_bias={"1": 1e300}), "logit_bias.1"),
    ("logit_bias-key-overflow", "chat", chat(logit_bias={"9" * 40: 1}), "logit_bias"),
    ("completion-logprobs-overflow", "completions", comp(logprobs=2**64), "logprobs"),
    ("completion-logprobs-6", "completions", comp(logprobs=6), "logprobs"),
    ("completion-max_tokens-overflow", "completions", comp(max_tokens=2**64), "max_tokens"),
    # wrong JSON types, every field (strict: a bool is not an int, a string is not a number)
    ("model-int", "chat", chat(model=5), "model"),
    ("messages-string", "chat", chat(messages="hi"), "messages"),
    ("messages-empty", "chat", chat(messages=[]), "messages"),
    ("message-int", "chat", chat(messages=[5]), "messages.0"),
    ("role-int", "chat", {**CHAT, "messages": [{"role": 5, "content": "hi"}]}, "messages.0.role"),
    ("role-unknown", "chat", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("content-int", "chat", msg(content=5), "messages.0.content"),
    ("content-part-int", "chat", msg(content=[{"type": "text", "text": 5}]), "messages.0.content.0.text"),
    (
        "content-part-image",
        "chat",
        msg(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
        "messages.0.content.0",
    ),
    ("name-int", "chat", msg(name=5), "messages.0.name"),
    ("n-bool", "chat", chat(n=True), "n"),
    ("n-float", "chat", chat(n=1.5), "n"),
    ("n-string", "chat", chat(n="1"), "n"),
    ("max_tokens-bool", "chat", chat(max_tokens=True), "max_tokens"),
    ("max_tokens-float", "chat", chat(max_tokens=2.0), "max_tokens"),
    ("temperature-string", "chat", chat(temperature="0.5"), "temperature"),
    ("temperature-bool", "chat", chat(temperature=False), "temperature"),
    ("top_p-list", "chat", chat(top_p=[1]), "top_p"),
    ("seed-float", "chat", chat(seed=1.0), "seed"),
    ("seed-string", "chat", chat(seed="7"), "seed"),
    ("top_k-bool", "chat", chat(top_k=True), "top_k"),
    ("stream-string", "chat", chat(stream="yes"), "stream"),
    ("stream-int", "chat", chat(stream=1), "stream"),
    ("stream_options-bool", "chat", chat(stream=True, stream_options=True), "stream_options"),
    ("include_usage-string", "chat", chat(stream=True, stream_options={"include_usage": "y"}), None),
    ("stop-int", "chat", chat(stop=5), "stop"),
    ("stop-list-int", "chat", chat(stop=[1]), "stop.0"),
    ("stop-empty-string", "chat", chat(stop=[""]), "stop.0"),
    ("logprobs-int", "chat", chat(logprobs=1), "logprobs"),
    ("top_logprobs-without-logprobs", "chat", chat(top_logprobs=2), "top_logprobs"),
    ("user-int", "chat", chat(user=5), "user"),
    ("ignore_eos-string", "chat", chat(ignore_eos="no"), "ignore_eos"),
    ("logit_bias-list", "chat", chat(logit_bias=[1]), "logit_bias"),
    ("logit_bias-string-value", "chat", chat(logit_bias={"1": "x"}), "logit_bias.1"),
    ("logit_bias-bool-value", "chat", chat(logit_bias={"1": True}), "logit_bias.1"),
    ("prompt-int", "completions", comp(prompt=5), "prompt"),
    ("prompt-bools", "completions", comp(prompt=[True]), "prompt.0"),
    ("prompt-nested-ids", "completions", comp(prompt=[[1, 2]]), "prompt.0"),
    ("prompt-two-strings", "completions", comp(prompt=["a", "b"]), "prompt"),
    ("echo-string", "completions", comp(echo="yes"), "echo"),
    # huge strings, every string field
    ("model-huge", "chat", chat(model="m" * 100_000), "model"),
    ("user-huge", "chat", chat(user="u" * 100_000), "user"),
    ("stop-huge", "chat", chat(stop="s" * 100_000), "stop"),
    ("stop-too-many", "chat", chat(stop=[f"s{i}" for i in range(17)]), "stop"),
    ("role-huge", "chat", {**CHAT, "messages": [{"role": "r" * 100_000, "content": "hi"}]}, "messages.0.role"),
    ("name-huge", "chat", msg(name="n" * 100_000), "messages.0.name"),
    ("content-past-context", "chat", msg(content="x" * 900_000), "messages"),
    ("content-parts-past-context", "chat", msg(content=[{"type": "text", "text": "y" * 3000}] * 200), "messages"),
    ("content-parts-too-many", "chat", msg(content=[{"type": "text", "text": "y"}] * 300), "messages.0.content"),
    ("messages-too-many", "chat", chat(messages=MSG * 3000), "messages"),
    ("part-type-huge", "chat", msg(content=[{"type": "t" * 100_000, "text": "y"}]), "messages.0.content.0"),
    ("prompt-past-context", "completions", comp(prompt="z" * 900_000), "prompt"),
    ("prompt-list-past-context", "completions", comp(prompt=["z" * 900_000]), "prompt"),
    ("prompt-ids-past-context", "completions", comp(prompt=[1] * 100_000), "prompt"),
    ("suffix-huge", "completions", comp(suffix="s" * 100_000), "suffix"),
    # token ids outside the vocabulary
    ("prompt-id-vocab", "completions", comp(prompt=[1, "VOCAB"]), "prompt"),
    ("prompt-id-int32", "completions", comp(prompt=[2**31 - 1]), "prompt"),
    ("prompt-id-overflow", "completions", comp(prompt=[2**64]), "prompt.0"),
    ("prompt-id-negative", "completions", comp(prompt=[-1]), "prompt.0"),
    ("logit_bias-id-vocab", "chat", chat(logit_bias={"VOCAB": 1}), "logit_bias"),
    # OpenAI fields this server does not implement, and unknown ones
    (
        "tools-bad-name",
        "chat",
        chat(tools=[{"type": "function", "function": {"name": "f f"}}]),
        "tools.0.function.name",
    ),
    ("tools-not-a-list", "chat", chat(tools="get_weather"), "tools"),  # a type error, not "unsupported"
    ("tool_choice-without-tools", "chat", chat(tool_choice="auto"), "tool_choice"),
    ("parallel_tool_calls-type", "chat", chat(parallel_tool_calls="yes"), "parallel_tool_calls"),
    ("functions", "chat", chat(functions=[{"name": "f"}]), "functions"),
    ("function_call", "chat", chat(function_call="auto"), "function_call"),
    ("response_format-type", "chat", chat(response_format={"type": "xml"}), "response_format"),
    ("guided_json-huge", "chat", chat(guided_json={"description": "d" * 70_000}), "guided_json"),
    ("audio", "chat", chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("modalities", "chat", chat(modalities=["text", "audio"]), "modalities"),
    ("prediction", "chat", chat(prediction={"type": "content", "content": "x"}), "prediction"),
    ("web_search_options", "chat", chat(web_search_options={}), "web_search_options"),
    ("store", "chat", chat(store=True), "store"),
    ("metadata", "chat", chat(metadata={"k": "v"}), "metadata"),
    ("service_tier", "chat", chat(service_tier="flex"), "service_tier"),
    ("reasoning_effort", "chat", chat(reasoning_effort="high"), "reasoning_effort"),
    ("unknown-field", "chat", chat(frobnicate=1), "frobnicate"),
    ("message-tool_calls", "chat", msg(tool_calls=[{"id": "1"}]), "messages.0.tool_calls.0.type"),
    ("message-unknown", "chat", msg(mood="happy"), "messages.0.mood"),
    ("stream_options-unknown", "chat", chat(stream=True, stream_options={"x": 1}), "stream_options.x"),
    ("completion-best_of", "completions", comp(best_of=2), "best_of"),
    ("completion-echo", "completions", comp(echo=True), "echo"),
    ("completion-suffix", "completions", comp(suffix="x"), "suffix"),
    ("completion-tools", "completions", comp(tools=[{"type": "function"}]), "tools"),
    # other refusals that must stay 4xx
    ("model-unknown", "chat", chat(model="nope"), "model"),
    ("control-token", "chat", msg(content="<|im_end|>"), "messages.0.content"),
]


UNSUPPORTED = {
    "tools",  # on /v1/completions: tool calling is a chat feature
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "best_of",
}


def fill(value: Any, gw: RunningGateway) -> Any:
    vocab = gw.engine.tokenizer.vocab_size  # type: ignore[attr-defined]
    if value == M:
        return gw.model
    if value == "VOCAB":
        return vocab
    if isinstance(value, dict):
        return {fill(k, gw) if k == "VOCAB" else k: fill(v, gw) for k, v in value.items()}
    if isinstance(value, list) and len(value) < 10:
        return [fill(v, gw) for v in value]
    return value


def assert_still_serving(http: httpx.Client, gw: RunningGateway) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "model": gw.model, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert gw.engine.ready  # type: ignore[attr-defined]


def assert_clear_4xx(r: httpx.Response, param: str | None = None) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(("case", "raw"), RAW, ids=[c for c, _ in RAW])
def test_malformed_bodies(http: httpx.Client, gw: RunningGateway, case: str, raw: bytes) -> None:
    r = http.post("/v1/chat/completions", content=raw.replace(b"MODEL", gw.model.encode()))
    assert_clear_4xx(r)
    assert r.status_code == 400
    assert_still_serving(http, gw)


@pytest.mark.parametrize(("case", "endpoint", "body", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_fields(
    http: httpx.Client, gw: RunningGateway, case: str, endpoint: str, body: dict[str, Any], param: str | None
) -> None:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = http.post(path, content=json.dumps(fill(body, gw)))
    assert_clear_4xx(r, param)
    if param in UNSUPPORTED and case != "tools-not-a-list":
        assert r.json()["error"]["code"] == "unsupported_parameter" and "not supported" in r.json()["error"]["message"]
    assert_still_serving(http, gw)


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": None, "tool_choice": "none", "store": False, "response_format": {"type": "text"}},
        {"seed": 2**64 - 1, "n": 2},  # the largest seed, and seed + 1 for the second choice wraps
        {"seed": -(2**63), "top_k": 400, "logit_bias": {"0": -100, "1": 100}},  # top_k = the tiny model's vocabulary
        {"messages": [{"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None}, *MSG]},
    ],
)
def test_values_that_ask_for_nothing_or_sit_on_a_bound_are_served(
    http: httpx.Client, gw: RunningGateway, extra: dict[str, Any]
) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "model": gw.model, **extra})
    assert r.status_code == 200, r.text


def test_an_internal_error_is_a_clear_500_and_the_connection_serves_the_next_request(
    gw: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: Any) -> Any:
        raise RuntimeError("a bug")

    conn = HTTPSConnection("127.0.0.1", gw.port, context=client_ssl_context(gw.pki.ca_cert), timeout=60)
    headers = {"Authorization": f"Bearer {gw.token()}", "Content-Type": "application/json"}
    body = json.dumps({**CHAT, "model": gw.model})
    try:
        with monkeypatch.context() as m:
            m.setattr(routes, "_parse", broken)
            conn.request("POST", "/v1/chat/completions", body, headers)
            r = conn.getresponse()
            err = json.loads(r.read())["error"]
        assert r.status == 500 and err["type"] == "server_error" and "a bug" not in err["message"]
        request_id = r.getheader("x-request-id")
        assert request_id
        conn.request("POST", "/v1/chat/completions", body, headers)  # the same keep-alive connection
        again = conn.getresponse()
        assert again.status == 200, again.read()
        assert json.loads(again.read())["choices"][0]["message"]["role"] == "assistant"
    finally:
        conn.close()
    for _ in range(100):  # its audit record, written as the request ends, says 500
        mine = [e for e in spooled(gw.settings.audit.spool_dir) if e.get("event", {}).get("id") == request_id]
        if mine:
            break
        time.sleep(0.05)
    assert [e["http"]["response"]["status_code"] for e in mine] == [500]
