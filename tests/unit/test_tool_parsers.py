"""Tool-call parsers on recorded outputs of each family's format, malformed and partial ones included: never an
exception, the text returned as content when no valid call is found, and a stream that reassembles into exactly
the non-streamed answer. Each format's grammar (tool_choice required) is checked against its parser."""

from __future__ import annotations

import json
import random

import pytest

from engine.structured import GrammarCompiler, StructuredOutputs
from engine.tokenizer import Tokenizer
from gateway.tools.extract import parse
from gateway.tools.parsers import PARSERS, DeepSeekV3, Hermes, Llama3Json, Mistral, ToolParser
from gateway.tools.parsers.base import FunctionSpec, closed, hold_back
from gateway.tools.stream import ToolStream
from tests.tiny_model import build_tiny_chat_model

DECLARED = frozenset({"get_weather", "open_ticket"})
PARIS = '{"city": "Paris", "unit": "celsius"}'
TICKET = '{"priority": 2}'
DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_call(name: str, args: str, v31: bool = False) -> str:
    if v31:
        return f"{DS_CB}{name}{DS_S}{args}{DS_CE}"
    return f"{DS_CB}function{DS_S}{name}\n```json\n{args}\n```{DS_CE}"


# (parser, model output, expected content, expected [(name, arguments)])
CASES: list[tuple[type[ToolParser], str, str | None, list[tuple[str, str]]]] = [
    # Hermes (Qwen2.5 / Qwen3 / the fallback prompt)
    (
        Hermes,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
        None,
        [("get_weather", PARIS)],
    ),
    (
        Hermes,
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
        "Let me check.",
        [("get_weather", PARIS)],
    ),
    (
        Hermes,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>\n<tool_call>\n'
        f'{{"name": "open_ticket", "arguments": {TICKET}}}\n</tool_call>',
        None,
        [("get_weather", PARIS), ("open_ticket", TICKET)],
    ),
    (
        Hermes,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),  # unterminated JSON: content
    (Hermes, f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}', None, [("get_weather", PARIS)]),
    (
        Hermes,
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        [],
    ),  # not a declared function
    (
        Hermes,
        '<tool_call>\n{"name": "open_ticket", "arguments": "{\\"priority\\": 2}"}\n</tool_call>',
        None,
        [("open_ticket", '{"priority": 2}')],
    ),  # arguments quoted as a string
    (
        Hermes,
        '<tool_call>\n{"arguments": {"priority": 2}, "name": "open_ticket"}\n</tool_call>',
        None,
        [("open_ticket", TICKET)],
    ),  # other key order
    (Hermes, "<tool_call>\nnot json\n</tool_call> sorry", "<tool_call>\nnot json\n</tool_call> sorry", []),
    (Hermes, "The weather is fine.", "The weather is fine.", []),
    (Hermes, "a < b <tool", "a < b <tool", []),
    # Llama 3.1+ JSON
    (Llama3Json, f'{{"name": "get_weather", "parameters": {PARIS}}}', None, [("get_weather", PARIS)]),
    (Llama3Json, f'<|python_tag|>{{"name": "get_weather", "parameters": {PARIS}}}', None, [("get_weather", PARIS)]),
    (
        Llama3Json,
        f'{{"name": "get_weather", "parameters": {PARIS}}}; {{"name": "open_ticket", "parameters": {TICKET}}}',
        None,
        [("get_weather", PARIS), ("open_ticket", TICKET)],
    ),
    (Llama3Json, '{"answer": 42}', '{"answer": 42}', []),
    (
        Llama3Json,
        '{"name": "get_weather", "parameters": {"city": ',
        '{"name": "get_weather", "parameters": {"city":',
        [],
    ),
    (Llama3Json, "It is sunny in Paris.", "It is sunny in Paris.", []),
    # Mistral
    (Mistral, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}]', None, [("get_weather", PARIS)]),
    (
        Mistral,
        f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}, {{"name": "open_ticket", '
        f'"arguments": {TICKET}}}]',
        "Sure.",
        [("get_weather", PARIS), ("open_ticket", TICKET)],
    ),
    (Mistral, f"[TOOL_CALLS]get_weather[ARGS]{PARIS}", None, [("get_weather", PARIS)]),
    (
        Mistral,
        f"[TOOL_CALLS]get_weather[ARGS]{PARIS}[TOOL_CALLS]open_ticket[ARGS]{TICKET}",
        None,
        [("get_weather", PARIS), ("open_ticket", TICKET)],
    ),
    (
        Mistral,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',
        [],
    ),
    (Mistral, "[TOOL_CALLS]get_weather[ARGS]{oops}", "[TOOL_CALLS]get_weather[ARGS]{oops}", []),
    (Mistral, "No tools needed.", "No tools needed.", []),
    # DeepSeek-V3 / V3.1
    (DeepSeekV3, f"{DS_B}{ds_call('get_weather', PARIS)}{DS_E}", None, [("get_weather", PARIS)]),
    (DeepSeekV3, f"{DS_B}{ds_call('get_weather', PARIS, v31=True)}{DS_E}", None, [("get_weather", PARIS)]),
    (
        DeepSeekV3,
        f"Checking.{DS_B}{ds_call('get_weather', PARIS)}\n{ds_call('open_ticket', TICKET)}{DS_E}",
        "Checking.",
        [("get_weather", PARIS), ("open_ticket", TICKET)],
    ),
    (DeepSeekV3, f'{DS_B}{DS_CB}function{DS_S}get_weather\n```json\n{{"city":', None, []),
    (DeepSeekV3, "Plain answer.", "Plain answer.", []),
]
IDS = [f"{p.name}-{i}" for i, (p, *_) in enumerate(CASES)]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=IDS)
def test_recorded_outputs(
    parser: type[ToolParser], text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    got_content, got = parse(parser(), text, DECLARED, parallel=True)
    assert [(c.name, c.arguments) for c in got] == calls
    if parser is DeepSeekV3 and not calls and content is None:  # unterminated: the raw text is the content
        assert got_content == text
    else:
        assert got_content == content
    for c in got:
        assert c.id.startswith("call_") and isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=IDS)
def test_a_stream_reassembles_into_the_whole_answer(
    parser: type[ToolParser], text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    want_content, want = parse(parser(), text, DECLARED, parallel=True)
    rng = random.Random(len(text))
    for split in ("chars", "random"):
        stream = ToolStream(parser(), DECLARED, parallel=True)
        pieces, pos = [], 0
        while pos < len(text):
            n = 1 if split == "chars" else rng.randint(1, 7)
            pieces.append(text[pos : pos + n])
            pos += n
        streamed_content, started, fragments = "", [], {}
        for k, piece in enumerate(pieces + [""]):
            delta, tool_deltas = stream.feed(piece, final=k == len(pieces))
            streamed_content += delta
            for d in tool_deltas:
                if "id" in d:  # OpenAI's order: the first delta of a call has its name and empty arguments
                    assert d["index"] == len(started) and d["function"]["arguments"] == "" and d["type"] == "function"
                    started.append(d["function"]["name"])
                    fragments[d["index"]] = ""
                else:
                    fragments[d["index"]] += d["function"]["arguments"]
        got = [(n, fragments[i]) for i, n in enumerate(started)]
        if calls or not started:  # well-formed: exactly the non-streamed answer
            assert (streamed_content or None) == want_content
            assert got == [(c.name, c.arguments) for c in want]
        else:  # a call cut short (max_tokens) was already under way: it stays a call, as in OpenAI's streams
            assert want_content is not None and want_content.startswith(streamed_content)
            assert all(text.count(args) for _, args in got)


@pytest.mark.parametrize("parser", list(PARSERS.values()))
def test_every_prefix_parses_without_raising(parser: type[ToolParser]) -> None:
    for p, text, _, _ in CASES:
        if p is not parser:
            continue
        for cut in range(len(text) + 1):  # max_tokens may stop a call anywhere
            content, calls = parse(parser(), text[:cut], DECLARED, parallel=True)
            if not calls:  # nothing lost: no valid call means all the text is the content
                assert content == (text[:cut].strip() or None)
            for c in calls:
                assert isinstance(json.loads(c.arguments), dict)


def test_parallel_false_keeps_the_first_call() -> None:
    text = CASES[2][1]
    _, calls = parse(Hermes(), text, DECLARED, parallel=False)
    assert [c.name for c in calls] == ["get_weather"]


def test_hold_back_keeps_only_what_cannot_start_a_marker() -> None:
    assert hold_back("hello <tool_c", "<tool_call>") == "hello "
    assert hold_back("hello <", "<tool_call>") == "hello "
    assert hold_back("hello", "<tool_call>") == "hello"
    assert hold_back("a <tool_call>", "<tool_call>") == "a <tool_call>"  # a whole marker is not held


def test_closed_schemas_forbid_invented_keys() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
              "enum": [{"properties": 1}]}  # fmt: skip
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["enum"] == [{"properties": 1}]  # values are left alone
    assert closed({"properties": {}, "additionalProperties": True})["additionalProperties"] is True


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> tuple[GrammarCompiler, Tokenizer]:
    model = build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")
    tok = Tokenizer.from_dir(model)
    return GrammarCompiler(tok.backend_json(), tok.vocab_size, [tok.eos_token_id or 0]), tok


FUNCTIONS = [
    FunctionSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    FunctionSpec("open_ticket", None),
]
GOOD = {  # a sentence of each format's grammar for `FUNCTIONS`, as the tiny vocabulary spells it
    Hermes: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    Llama3Json: '{"name": "open_ticket", "parameters": {}}',
    Mistral: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    DeepSeekV3: DS_B + ds_call("get_weather", '{"city": "Paris"}') + DS_E,
}


@pytest.mark.parametrize("parser", list(GOOD))
def test_each_grammar_accepts_what_its_parser_reads(
    compiler: tuple[GrammarCompiler, Tokenizer], parser: type[ToolParser]
) -> None:
    comp, tok = compiler
    p = parser()
    for parallel in (False, True):
        grammar = comp.compile(StructuredOutputs(grammar=p.grammar(FUNCTIONS, parallel, lambda m: json.dumps(m))))
        matcher = grammar.matcher()
        assert matcher.consume_tokens(tok.encode(GOOD[parser], add_special_tokens=False)), matcher.get_error()
        assert matcher.is_accepting()
        bad = grammar.matcher()  # an undeclared function is not in the language
        assert not bad.consume_tokens(tok.encode(GOOD[parser].replace("get_weather", "rm_rf").replace(
            "open_ticket", "rm_rf"), add_special_tokens=False))  # fmt: skip
    _, calls = parse(p, GOOD[parser], frozenset({"get_weather", "open_ticket"}), parallel=True)
    assert len(calls) == 1


def test_the_settings_list_every_parser() -> None:
    import inspect

    from gateway import settings
    from gateway.tools.select import CHOICES

    assert all(f'"{c}"' in inspect.getsource(settings._validate) for c in CHOICES)
