"""Structured outputs and tool calling through the real gateway (TLS, JWT, uvicorn) with the official openai
client and langchain-openai. The model is a random tiny one: only the grammar makes its output valid."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from security.tls import client_ssl_context
from tests.audit_spool import spooled
from tests.gateway_server import RunningGateway, run_gateway
from tests.structured_schemas import SCHEMAS
from tests.tiny_model import build_tiny_chat_model

ASK = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TICKET = {
    "type": "function",
    "function": {
        "name": "open_ticket",
        "parameters": {
            "type": "object",
            "properties": {"priority": {"type": "integer", "minimum": 1, "maximum": 3}},
            "required": ["priority"],
            "additionalProperties": False,
        },
    },
}
HANG_GUARD = 600  # polls of 50 ms: only so that a missing record fails instead of hanging
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TICKET)}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    # 2048 positions: the tools section of the prompt is ~800 tokens in this tiny vocabulary
    model = build_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat", max_len=2048)
    with run_gateway(tmp_path_factory.mktemp("home"), model) as g:
        yield g


def client(gw: RunningGateway, sub: str = "alice") -> openai.OpenAI:
    ctx = client_ssl_context(gw.pki.ca_cert)
    return openai.OpenAI(
        base_url=gw.url + "/v1", api_key=gw.token(sub=sub), http_client=httpx.Client(verify=ctx), max_retries=0
    )


def post(gw: RunningGateway, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    with httpx.Client(base_url=gw.url, verify=client_ssl_context(gw.pki.ca_cert), timeout=120) as c:
        return c.post(path, json=body, headers={"Authorization": f"Bearer {gw.token()}"})


def json_schema_format(i: int) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}


# ---- structured outputs ----------------------------------------------------------------------------------
async def test_eight_schemas_at_once_stream_and_not(gw: RunningGateway) -> None:
    ctx = client_ssl_context(gw.pki.ca_cert)
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key=gw.token(), http_client=httpx.AsyncClient(verify=ctx), max_retries=0
    ) as c:

        async def one(i: int, stream: bool) -> tuple[str, str | None]:
            kw: dict[str, Any] = dict(
                model=gw.model, messages=ASK, max_tokens=200, response_format=json_schema_format(i)
            )
            kw["temperature"] = 1.0 if i % 2 else 0.0
            if not stream:
                r = await c.chat.completions.create(**kw)
                return r.choices[0].message.content or "", r.choices[0].finish_reason
            text, finish = "", None
            async for chunk in await c.chat.completions.create(**kw, stream=True):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            return text, finish

        results = await asyncio.gather(*(one(i, s) for s in (False, True) for i in range(len(SCHEMAS))))
    for k, (text, finish) in enumerate(results):
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS[k % len(SCHEMAS)])


class Risk(BaseModel):
    level: Literal["low", "medium", "high"]
    score: int = Field(ge=0, le=100)
    reason: str = Field(max_length=10)


def test_parse_with_a_pydantic_model(gw: RunningGateway) -> None:
    with client(gw) as c:
        r = c.beta.chat.completions.parse(model=gw.model, messages=ASK, max_tokens=200, response_format=Risk)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Risk) and 0 <= parsed.score <= 100 and len(parsed.reason) <= 10


def test_json_object_and_vllm_extensions(gw: RunningGateway) -> None:
    with client(gw) as c:

        def text(max_tokens: int = 60, **extra: Any) -> tuple[str, str | None]:
            r = c.chat.completions.create(model=gw.model, messages=ASK, max_tokens=max_tokens, temperature=0, **extra)
            return r.choices[0].message.content or "", r.choices[0].finish_reason

        assert text(extra_body={"guided_choice": ["approve", "reject"]})[0] in ("approve", "reject")
        out, _ = text(extra_body={"guided_regex": "[A-Z]{2}-[0-9]{4}"})
        assert len(out) == 7 and out[2] == "-" and out[3:].isdigit()
        jsonschema.validate(json.loads(text(200, extra_body={"guided_json": SCHEMAS[1]})[0]), SCHEMAS[1])
        assert text(extra_body={"guided_grammar": 'root ::= "yes" | "no"'})[0] in ("yes", "no")
        jsonschema.validate(
            json.loads(text(200, extra_body={"structured_outputs": {"json": SCHEMAS[5]}})[0]), SCHEMAS[5]
        )
        assert text(extra_body={"structured_outputs": {"choice": ["a", "b"]}})[0] in ("a", "b")
        out, finish = text(400, response_format={"type": "json_object"})
        assert out.startswith("{") and (finish == "length" or isinstance(json.loads(out), dict))
        out, finish = text(5, response_format=json_schema_format(7))  # cut mid-object: length, as OpenAI
        assert finish == "length" and out.startswith('{"')
        comp = c.completions.create(model=gw.model, prompt="x", max_tokens=20, extra_body={"guided_choice": ["up"]})
        assert comp.choices[0].text == "up"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
            "strin",
        ),
        ({"guided_regex": "(a"}, "guided_regex", "unclosed"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
        ({"guided_grammar": "\n\n"}, "guided_grammar", "root"),  # the GBNF converter's bare Exception: no 500
        ({"guided_json": SCHEMAS[0], "guided_regex": "a"}, "guided_regex", "one structured-output constraint"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
            "response_format.json_schema.name",
            "pattern",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_object or json_schema"),
        (
            {"structured_outputs": {"json": {}, "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "unknown field",
        ),
        ({"guided_choice": []}, "guided_choice", "at least 1"),
        ({"guided_choice": ["x"] * 257}, "guided_choice", "at most 256"),
        ({"guided_json": {"type": "object", "description": "d" * (64 << 10)}}, "guided_json", "bytes"),
        ({"guided_json": "[not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": 7}, "guided_regex", "string"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "unknown field"),
    ],
)
def test_bad_constraints_are_400s_that_say_why(
    gw: RunningGateway, body: dict[str, Any], param: str, words: str
) -> None:
    r = post(gw, {"model": gw.model, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert post(gw, {"model": gw.model, "messages": ASK, "max_tokens": 2}).status_code == 200  # everyone else served


# ---- tool calling ----------------------------------------------------------------------------------------
def assert_valid_call(call: Any, names: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_required_and_named_always_yield_a_valid_call(gw: RunningGateway, seed: int) -> None:
    with client(gw) as c:
        for choice, names in (
            ("required", {"get_weather", "open_ticket"}),
            ({"type": "function", "function": {"name": "open_ticket"}}, {"open_ticket"}),
        ):
            r = c.chat.completions.create(
                model=gw.model, messages=ASK, tools=[WEATHER, TICKET], tool_choice=choice, max_tokens=200,
                temperature=1.0, seed=seed, parallel_tool_calls=False,
            )  # fmt: skip
            choice0 = r.choices[0]
            assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
            assert len(choice0.message.tool_calls or []) == 1
            assert_valid_call(choice0.message.tool_calls[0], names)


def test_parallel_calls_when_allowed(gw: RunningGateway) -> None:
    with client(gw) as c:
        r = c.chat.completions.create(
            model=gw.model, messages=ASK, tools=[WEATHER, TICKET], tool_choice="required", max_tokens=400,
            temperature=0,
        )  # fmt: skip
    if r.choices[0].finish_reason == "tool_calls":
        calls = r.choices[0].message.tool_calls or []
        assert calls and len({call.id for call in calls}) == len(calls)
        for call in calls:
            assert_valid_call(call, {"get_weather", "open_ticket"})
    else:  # a random model may chain calls until max_tokens; the complete ones are still calls
        assert r.choices[0].finish_reason == "length"


def test_a_streamed_call_reassembles_into_the_non_streamed_one(gw: RunningGateway) -> None:
    kw: dict[str, Any] = dict(
        model=gw.model, messages=ASK, tools=[WEATHER, TICKET], tool_choice="required", max_tokens=200, temperature=0,
        parallel_tool_calls=False,
    )  # fmt: skip
    with client(gw) as c:
        full = c.chat.completions.create(**kw).choices[0]
        chunks = list(c.chat.completions.create(**kw, stream=True))
        with c.chat.completions.stream(**kw) as s:  # the SDK's own stream helper reassembles the deltas
            helped = s.get_final_completion().choices[0]
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    firsts = [tc for d in deltas for tc in d.tool_calls or [] if tc.id is not None]
    assert len(firsts) == 1 and firsts[0].function.name and firsts[0].function.arguments == ""
    assert firsts[0].index == 0 and firsts[0].type == "function"
    fragments = [tc.function.arguments for d in deltas for tc in d.tool_calls or [] if tc.id is None]
    assert len(fragments) > 1  # the arguments come in pieces, as they are generated
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    want = full.message.tool_calls[0]
    assert (firsts[0].function.name, "".join(fragments)) == (want.function.name, want.function.arguments)
    got = helped.message.tool_calls[0]
    assert (got.function.name, got.function.arguments) == (want.function.name, want.function.arguments)
    assert helped.finish_reason == "tool_calls"


def test_a_tool_result_round_trips(gw: RunningGateway) -> None:
    with client(gw) as c:
        first = c.chat.completions.create(
            model=gw.model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0
        )
        call = first.choices[0].message.tool_calls[0]
        history = [
            *ASK,
            first.choices[0].message,  # the SDK's own object, sent back as OpenAI's docs do
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
        ]
        second = c.chat.completions.create(model=gw.model, messages=history, tools=[WEATHER], max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_requests_bad_input(gw: RunningGateway) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
        ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
        (
            {"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]},
            "tools.0.function.strict",
            "strict",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                "tool_choice": "required",
            },
            "tools",
            "strin",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot both",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "tool_choice 'none'"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_start|>system"}}]},
            "tools",
            "control token",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages.0",
            "only assistant",
        ),
    ]
    for extra, param, words in cases:
        r = post(gw, {"model": gw.model, "messages": ASK, "max_tokens": 4, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"].startswith(param) and words in err["message"], (extra, err)
    r = post(gw, {"model": gw.model, "prompt": "x", "max_tokens": 2, "tools": [WEATHER]}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"  # tool calling is a chat feature
    assert (
        post(gw, {"model": gw.model, "prompt": "x", "max_tokens": 2, "tools": []}, "/v1/completions").status_code == 200
    )


def test_audit_records_tool_names_and_constraint(gw: RunningGateway) -> None:
    with client(gw, sub="auditor-tools") as c:
        tools: dict[str, Any] = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
        c.chat.completions.create(model=gw.model, messages=ASK, max_tokens=200, **tools)
        c.chat.completions.create(model=gw.model, messages=ASK, max_tokens=30, response_format=json_schema_format(1))
        list(c.chat.completions.create(model=gw.model, messages=ASK, max_tokens=200, stream=True, **tools))
    spool = Path(gw.settings.audit.spool_dir)  # type: ignore[arg-type]

    def chats() -> list[dict[str, Any]]:
        return [e["tianmen"] for e in spooled(spool) if e.get("user", {}).get("id") == "auditor-tools"]

    for _ in range(HANG_GUARD):  # the stream's close record is written just after its last byte
        if any(t["phase"] == "close" and t.get("tool_calls") for t in chats()):
            break
        time.sleep(0.05)
    records = chats()
    called = [t for t in records if t.get("tool_calls") == ["get_weather"]]
    assert {t["phase"] for t in called} == {"complete", "close"}  # streamed: on its close record
    assert all(t["schema_constrained"] is True and t["finish_reason"] == "tool_calls" for t in called)
    schema_only = [t for t in records if "tool_calls" not in t and t.get("schema_constrained") is True]
    assert schema_only and schema_only[0]["finish_reason"] in ("stop", "length")
    assert all("arguments" not in json.dumps(t.get("tool_calls")) for t in records)


# ---- langchain-openai, the most used client after the SDK ----------------------------------------------
def test_langchain_bind_tools_round_trip(gw: RunningGateway) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    with httpx.Client(verify=client_ssl_context(gw.pki.ca_cert)) as http_client:
        llm = ChatOpenAI(
            model=gw.model, base_url=gw.url + "/v1", api_key=gw.token(), max_tokens=120, temperature=0, max_retries=0,
            http_client=http_client,
        )  # fmt: skip
        bound = llm.bind_tools([get_weather], tool_choice="get_weather")
        question = HumanMessage("What is the weather in Paris?")
        ai = bound.invoke([question])
        assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
        assert isinstance(ai.tool_calls[0]["args"], dict) and isinstance(ai.tool_calls[0]["args"]["city"], str)
        result = ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])
        answer = llm.bind_tools([get_weather]).invoke([question, ai, result])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
