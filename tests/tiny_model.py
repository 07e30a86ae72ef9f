"""A tiny random Llama with a real byte-level BPE tokenizer and a ChatML template, built locally in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tokenizer_builders import train_byte_level

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "Tianmen is a secure inference gateway. 天门是一个安全的推理网关。",
    "The quick brown fox jumps over the lazy dog. 🦊 emoji and ünïcödé text.",
    "Hello world! How are you today? I am fine, thank you.",
] * 20


def build_tiny_chat_model(path: Path, seed: int = 0, tied: bool = True, max_len: int = 512) -> Path:
    """tied=False: a random LM head of its own (a tied tiny model mostly repeats its prompt's last token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = train_byte_level(CORPUS, SPECIALS, vocab_size=400)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHATML,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": max_len,
            }
        )
    )
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        tie_word_embeddings=tied,
        eos_token_id=eos,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).float().save_pretrained(path, safe_serialization=True)
    return path
