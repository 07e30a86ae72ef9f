"""ResponseBuilder's SSE chunks and merge(): coalesced deltas render as the deltas one by one would."""

from __future__ import annotations

import json

import pytest

from engine import Logprob, RequestOutput, Usage
from gateway.streaming import ResponseBuilder, merge, sse


def deltas() -> list[RequestOutput]:
    return [
        RequestOutput("r", [1], "天", logprobs=[Logprob(1, -0.5, [])]),
        RequestOutput("r", [2, 3], "门 ", logprobs=[Logprob(2, -0.25, []), Logprob(3, -1.0, [])]),
        RequestOutput("r", [4], "ok", "stop", Usage(5, 4), [Logprob(4, -2.0, [])], "END"),
    ]


def builder(chat: bool) -> ResponseBuilder:
    return ResponseBuilder(chat, "chatcmpl-1", "模型-m", 1, lambda t: f"<{t}>")


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_a_chunk_is_the_whole_object_encoded(chat: bool, include_usage: bool) -> None:
    b = builder(chat)
    for out in deltas():
        b.add(0, out)
        raw = b.chunk(0, out, True, include_usage)
        obj = json.loads(raw[6:])
        assert raw == sse(obj) and raw.endswith(b"\n\n")  # byte for byte what encoding the whole object gives
        assert list(obj) == ["id", "object", "created", "model", "system_fingerprint", "choices"] + (
            ["usage"] if include_usage else []
        )
        assert obj["model"] == "模型-m" and obj["object"] == ("chat.completion.chunk" if chat else "text_completion")


@pytest.mark.parametrize("chat", [True, False])
def test_merged_deltas_carry_the_same_text_tokens_and_logprobs(chat: bool) -> None:
    one, merged = builder(chat), builder(chat)
    texts, entries = [], []
    for out in deltas():
        one.add(0, out)
        choice = json.loads(one.chunk(0, out, True, False)[6:])["choices"][0]
        texts.append(choice["delta"].get("content", "") if chat else choice["text"])
        entries += choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]
    m = merge(deltas())
    assert m.new_token_ids == [1, 2, 3, 4] and m.finish_reason == "stop" and m.stop_reason == "END"
    assert m.usage == Usage(5, 4) and [lp.token_id for lp in m.logprobs or []] == [1, 2, 3, 4]
    merged.add(0, m)
    choice = json.loads(merged.chunk(0, m, True, False)[6:])["choices"][0]
    assert (choice["delta"]["content"] if chat else choice["text"]) == "".join(texts) == "天门 ok"
    assert (choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]) == entries
    assert choice["finish_reason"] == "stop"
    assert {**merged.body(True), "created": 0} == {**one.body(True), "created": 0}
    single = deltas()[:1]
    assert merge(single) is single[0]


@pytest.mark.parametrize("char", ["\x85", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"])
@pytest.mark.parametrize("chat", [True, False])
def test_text_with_a_unicode_line_end_stays_on_one_sse_line(chat: bool, char: str) -> None:
    """SSE ends lines at CR and LF only, but httpx's aiter_lines and requests' iter_lines split as str.splitlines
    does: every character it splits at must reach the client escaped, and decode to itself."""
    text = f"a{char}b"
    b = ResponseBuilder(chat, "chatcmpl-1", f"m{char}", 1, lambda t: text)
    out = RequestOutput("r", [1], text, logprobs=[Logprob(1, -0.5, [(1, -0.5)])])
    b.add(0, out)
    chunk, plain = b.chunk(0, out, True, True), sse({"text": text})
    for raw in (chunk, plain):
        lines = raw.decode().splitlines()
        assert lines[1:] == [""] and lines[0].startswith("data: ")
    assert json.loads(plain[6:]) == {"text": text}  # decoded, each string is what the model wrote
    obj = json.loads(chunk[6:])
    choice = obj["choices"][0]
    assert obj["model"] == f"m{char}" and (choice["delta"]["content"] if chat else choice["text"]) == text
    tokens = choice["logprobs"]["content"][0]["token"] if chat else choice["logprobs"]["tokens"][0]
    assert tokens == text
