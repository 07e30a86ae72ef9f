"""Random-weight checkpoints of real model shapes, written once into benchmarks/.cache."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CACHE = Path(__file__).parent / ".cache"

SHAPES: dict[str, dict] = {
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
}


def _llama_tensors(c: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    bias = c["model_type"] == "qwen2"

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "self_attn.q_proj.weight": w(h, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
        if bias:
            out |= {p + f"self_attn.{x}_proj.bias": w(dim) for x, dim in (("q", h), ("k", kv), ("v", kv))}
    if not c.get("tie_word_embeddings"):
        out["lm_head.weight"] = w(v, h)
    return out


def checkpoint(shape: str) -> Path:
    """The directory of a random checkpoint with `shape`'s config (built on first use)."""
    path = CACHE / shape
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    save_file(_llama_tensors(config, gen), path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return path
