"""Llama family: Llama 2/3, Qwen2 (qkv bias), Mistral. Parameter names follow the HF checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.kernels.pointwise import PointwiseKernels
from engine.layers.attention import PagedAttention
from engine.layers.linear import Linear, MergedLinear
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from engine.models.decoder import DecoderLayer, DecoderModel, embedding

if TYPE_CHECKING:
    from engine.kernels.kernel_set import CpuKernels


@dataclass(slots=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: dict[str, Any]
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaArgs:
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position=hf.get("max_position_embeddings", 2048),
            rope=rope_parameters(hf),
            qkv_bias=hf.get("attention_bias", False) or hf.get("model_type") == "qwen2",
            o_bias=hf.get("attention_bias", False),  # Llama's flag covers o_proj too; Qwen2 has no o_proj bias
            mlp_bias=hf.get("mlp_bias", False),
            hidden_act=hf.get("hidden_act", "silu"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
        )


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = MergedLinear(
            a.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, a.qkv_bias
        )
        self.o_proj = Linear(self.q_size, a.hidden_size, a.o_bias)
        self.attn = PagedAttention(a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim**-0.5, scratch)
        self.kernel: PointwiseKernels | None = None  # RoPE in place

    def bind_kernels(self, kernels: CpuKernels) -> None:
        self.kernel = kernels.rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, h + kv, d)  # q and k side by side: one rotation, [T, H + KV, D]
        qk = self.kernel.rotary(qk, cos, sin) if self.kernel is not None else apply_rotary(qk, cos, sin)
        return self.o_proj(self.attn(qk[:, :h], qk[:, h:], v.view(-1, kv, d)))


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, a: LlamaArgs, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(a, scratch)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act, a.mlp_bias)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaModel(DecoderModel):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = embedding(a.vocab_size, a.hidden_size)
        scratch = (torch.empty(0), torch.empty(0))  # K/V gathered from the cache, reused by every layer
        self.layers = nn.ModuleList(LlamaDecoderLayer(a, scratch) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our parameter name, shard)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        a = self.args = LlamaArgs.from_hf(hf_config)
        self.model = LlamaModel(a)
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position, a.rope)
        self.lm_head = Linear(a.hidden_size, a.vocab_size)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(positions, self.model.norm.weight.dtype)
        return self.model(input_ids, cos, sin)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [B, vocab]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[str, tuple[int, ...]]]:
        """Per attention layer, the cache tensors it owns: K and V of [blocks, block_size, KV heads, head_dim]."""
        shape = (num_blocks, block_size, self.args.num_kv_heads, self.args.head_dim)
        return [("k_cache", shape), ("v_cache", shape)]

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
