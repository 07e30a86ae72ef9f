"""`make run`'s demo model (SmolLM2-135M-Instruct, sealed) through the real gateway: its chat template has no
tools, so the Hermes fallback describes them, and tool_choice="required" yields a valid get_weather call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from security.tls import client_ssl_context
from tests.gateway_server import RunningGateway, run_gateway

pytestmark = pytest.mark.slow

GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with run_gateway(tmp_path_factory.mktemp("home"), None) as g:  # None: the embedded default's demo model
        yield g


def test_the_demo_model_calls_get_weather(gw: RunningGateway) -> None:
    ctx = client_ssl_context(gw.pki.ca_cert)
    with openai.OpenAI(
        base_url=gw.url + "/v1", api_key=gw.token(), http_client=httpx.Client(verify=ctx), max_retries=0
    ) as c:
        messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
        kw: dict[str, Any] = dict(model=gw.model, messages=messages, tools=[GET_WEATHER], tool_choice="required")
        r = c.chat.completions.create(**kw, max_tokens=60, temperature=0, parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather"
        jsonschema.validate(args, GET_WEATHER["function"]["parameters"])
        assert "paris" in args["city"].lower()  # a real model reads the question
        parallel = c.chat.completions.create(**kw, max_tokens=200, temperature=0).choices[0]  # it may call twice
        assert parallel.finish_reason == "tool_calls" and parallel.message.tool_calls
        for more in parallel.message.tool_calls:
            assert more.function.name == "get_weather"
            jsonschema.validate(json.loads(more.function.arguments), GET_WEATHER["function"]["parameters"])
        followup = [
            *messages,
            choice.message.model_dump(exclude_none=True),
            {
                "role": "tool",
                "tool_call_id": call.id,
                "content": json.dumps({"city": "Paris", "sky": "sunny", "c": 21}),
            },
        ]
        answer = c.chat.completions.create(model=gw.model, messages=followup, tools=[GET_WEATHER], max_tokens=40)
        assert answer.choices[0].message.content
