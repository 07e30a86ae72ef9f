"""DeepSeek-V2's chat template renders exactly as transformers renders it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from tests.tiny_model import build_tiny_chat_model

DEEPSEEK_V2 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'Assistant:' }}{% endif %}"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_chat_model(tmp_path_factory.mktemp("m") / "ds")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg |= {"chat_template": DEEPSEEK_V2, "bos_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("gen", [True, False])
def test_deepseek_template_matches_transformers(model: Path, gen: bool) -> None:
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast.from_pretrained(model)
    ours = Tokenizer.from_dir(model)
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "天门在哪里?"},
    ]
    text = ours.apply_chat_template(chat, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
    assert text.endswith("Assistant:") == gen and text.startswith("<|endoftext|>You are terse.")
    assert ours.encode_chat(chat, add_generation_prompt=gen) == ref.apply_chat_template(
        chat, add_generation_prompt=gen, tokenize=True, return_dict=False
    )
