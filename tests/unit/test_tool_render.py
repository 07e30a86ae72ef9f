"""Tools into the prompt: a template that renders them gets `tools=` as transformers passes them, one that does
not gets the Hermes fallback; the parser is chosen from the model's vocabulary and template."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken

from engine.tokenizer import Tokenizer
from gateway.tools import select
from gateway.tools.parsers import DeepSeekV3, Hermes, Llama3Json, Mistral
from gateway.tools.render import template_inputs
from tests.tiny_model import CHATML, CORPUS
from tests.tokenizer_builders import train_byte_level

# Qwen2.5's tool section, abridged: tools as JSON lines in the system turn, calls and results in Hermes tags
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tc in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
]  # fmt: skip


def tokenizer(template: str, specials: tuple[str, ...] = (), special: bool = True) -> Tokenizer:
    backend = train_byte_level(CORPUS, ["<|im_start|>", "<|im_end|>"], vocab_size=400)
    backend.add_tokens([AddedToken(t, special=special, normalized=False) for t in specials])
    return Tokenizer(backend, {"eos_token": "<|im_end|>"}, {"default": template})


def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them() -> None:
    tok = tokenizer(QWEN_LIKE)
    assert tok.renders_tools
    messages, extra = template_inputs(HISTORY, TOOLS, tok.renders_tools)
    assert messages is HISTORY and extra == {"tools": TOOLS}
    text = tok.apply_chat_template(messages, **extra)
    assert json.dumps(TOOLS[0]) in text
    assert '"arguments": {"city": "Rome"}' in text and "<tool_response>\nrain\n</tool_response>" in text


def test_the_hermes_fallback_writes_tools_calls_and_results_into_the_messages() -> None:
    tok = tokenizer(CHATML)
    assert not tok.renders_tools
    messages, extra = template_inputs(HISTORY, TOOLS, tok.renders_tools)
    assert extra == {}
    assert messages[0]["role"] == "system" and json.dumps(TOOLS[0]) in messages[0]["content"]
    assert "<tool_call></tool_call>" in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    }
    assert messages[3] == {  # consecutive results share one user turn
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>",
    }
    tok.apply_chat_template(messages)  # ChatML renders every message: content is a string everywhere
    with_system, _ = template_inputs([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], TOOLS, False)
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools") and len(with_system) == 2
    no_tools, _ = template_inputs(HISTORY, None, False)  # tool_choice none: the history is still rendered
    assert no_tools[0] == HISTORY[0] and "tool_calls" not in no_tools[1]


@pytest.mark.parametrize(
    ("specials", "template", "parser"),
    [
        ((), QWEN_LIKE, Hermes),
        ((), CHATML, Hermes),  # the fallback prompt asks for Hermes
        (("[TOOL_CALLS]", "[ARGS]"), QWEN_LIKE.replace("<tool_call>", "[TOOL_CALLS]"), Mistral),
        (("<|python_tag|>",), QWEN_LIKE.replace("<tool_call>", "<|python_tag|>"), Llama3Json),
        (("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"), QWEN_LIKE, DeepSeekV3),
    ],
)
def test_the_parser_is_chosen_from_the_model(specials: tuple[str, ...], template: str, parser: type) -> None:
    tok = tokenizer(template, specials)
    assert type(select.choose(tok)) is parser
    assert type(select.choose(tok, "llama3_json")) is Llama3Json  # the setting wins


def test_markers_that_are_special_tokens_become_token_terminals() -> None:
    tok = tokenizer(QWEN_LIKE, ("[TOOL_CALLS]",))
    token = tok.encode("[TOOL_CALLS]", add_special_tokens=False)
    assert select.literal(tok, "[TOOL_CALLS]") == f"<[{token[0]}]>"
    assert select.literal(tok, "<tool_call>") == '"<tool_call>"'
    plain = tokenizer(QWEN_LIKE, ("<tool_call>",), special=False)  # Qwen's: an added token, not a special one
    assert select.literal(plain, "<tool_call>") == '"<tool_call>"'
