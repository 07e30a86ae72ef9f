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
    # Qwen2-0.5B's layers and calls with almost nothing in them (hidden 128, a 1,024-token vocabulary): its decode
    # step is the engine's own cost around the kernels, the part of a batch-1 token that is not streaming weights
    "qwen2-0.5b-hollow": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 24,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 1024,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    # the demo model's (SmolLM2-135M-Instruct) shape: the serving benchmark's engine work without the server
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v2-tiny": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "moe_intermediate_size": 384,
        "num_hidden_layers": 8,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 384,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 2,
        "topk_method": "greedy",
        "n_group": 1,  # one group of all experts: greedy routing as before, and vLLM's router needs the fields
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "vocab_size": 102400,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "torch_dtype": "bfloat16",
    },
}


def _w(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bfloat16)


def _llama_tensors(c: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    bias = c["model_type"] == "qwen2"

    def w(*shape: int) -> torch.Tensor:
        return _w(gen, *shape)

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


def _mlp(prefix: str, h: int, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        prefix + "gate_proj.weight": _w(gen, i, h),
        prefix + "up_proj.weight": _w(gen, i, h),
        prefix + "down_proj.weight": _w(gen, h, i),
    }


def _deepseek_tensors(c: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """HF DeepseekV2ForCausalLM names, routed experts one by one (as save_pretrained writes them)."""
    h, v, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    q_lora, kv_lora, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    qk, vd, moe_i = c["qk_nope_head_dim"] + rope, c["v_head_dim"], c["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": _w(gen, v, h), "model.norm.weight": _ones(h), "lm_head.weight": _w(gen, v, h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": _ones(h),
            p + "post_attention_layernorm.weight": _ones(h),
            p + "self_attn.q_a_proj.weight": _w(gen, q_lora, h),
            p + "self_attn.q_a_layernorm.weight": _ones(q_lora),
            p + "self_attn.q_b_proj.weight": _w(gen, heads * qk, q_lora),
            p + "self_attn.kv_a_proj_with_mqa.weight": _w(gen, kv_lora + rope, h),
            p + "self_attn.kv_a_layernorm.weight": _ones(kv_lora),
            p + "self_attn.kv_b_proj.weight": _w(gen, heads * (c["qk_nope_head_dim"] + vd), kv_lora),
            p + "self_attn.o_proj.weight": _w(gen, h, heads * vd),
        }
        if n < c["first_k_dense_replace"]:
            out |= _mlp(p + "mlp.", h, c["intermediate_size"], gen)
            continue
        out[p + "mlp.gate.weight"] = _w(gen, c["n_routed_experts"], h)
        out |= _mlp(p + "mlp.shared_experts.", h, moe_i * c["n_shared_experts"], gen)
        for e in range(c["n_routed_experts"]):
            out |= _mlp(p + f"mlp.experts.{e}.", h, moe_i, gen)
    return out


def checkpoint(shape: str) -> Path:
    """The directory of a random checkpoint with `shape`'s config (built on first use)."""
    path = CACHE / shape
    config = SHAPES[shape]
    if (path / "model.safetensors").exists():
        if json.loads((path / "config.json").read_text()) != config:  # config-only edits: the weights still fit
            (path / "config.json").write_text(json.dumps(config, indent=2))
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = (_deepseek_tensors if config["model_type"] == "deepseek_v2" else _llama_tensors)(config, gen)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return path
