"""Llama family: Llama 2/3, Qwen2 (qkv bias), Mistral. Parameter names follow the HF checkpoints.

Tensor parallel (a `group` of several ranks): each rank holds its query heads and their KV heads (QKV
column-parallel), its slice of the MLP, and its slice of the vocabulary; O and down are row-parallel with one
all-reduce each (engine.layers.parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.kernels.pointwise import PointwiseKernels
from engine.layers.attention import PagedAttention
from engine.layers.linear import MergedLinear
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.parallel import VocabEmbedding, gather_logits, row_linear, split_heads, vocab_head
from engine.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from engine.models import llama_program
from engine.models.decode_program import DecodePrograms, make_programs, programs_may_run
from engine.models.decoder import DecoderLayer, DecoderModel
from engine.parallel.group import Group, SingleGroup

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
    def __init__(self, a: LlamaArgs, scratch: tuple[torch.Tensor, torch.Tensor], group: Group) -> None:
        super().__init__()
        heads, d = split_heads(a.num_heads, a.num_kv_heads, group), a.head_dim  # this rank's heads
        self.group = group
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, d
        self.q_size, self.kv_size = heads.num_heads * d, heads.num_kv_heads * d
        starts = {"q": heads.q_start * d, "k": heads.kv_start * d, "v": heads.kv_start * d}
        self.qkv_proj = MergedLinear(
            a.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            a.qkv_bias,
            starts if group.size > 1 else None,
        )
        self.o_proj = row_linear(a.num_heads * d, a.hidden_size, a.o_bias, group)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5, scratch)
        self.kernel: PointwiseKernels | None = None  # RoPE in place

    def bind_kernels(self, kernels: CpuKernels) -> None:
        self.kernel = kernels.rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, h + kv, d)  # q and k side by side: one rotation, [T, H + KV, D]
        qk = self.kernel.rotary(qk, cos, sin) if self.kernel is not None else apply_rotary(qk, cos, sin)
        return self.group.all_reduce(self.o_proj(self.attn(qk[:, :h], qk[:, h:], v.view(-1, kv, d))))


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, a: LlamaArgs, scratch: tuple[torch.Tensor, torch.Tensor], group: Group) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(a, scratch, group)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act, a.mlp_bias, group)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaModel(DecoderModel):
    def __init__(self, a: LlamaArgs, group: Group) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(a.vocab_size, a.hidden_size, group)
        scratch = (torch.empty(0), torch.empty(0))  # K/V gathered from the cache, reused by every layer
        self.layers = nn.ModuleList(LlamaDecoderLayer(a, scratch, group) for _ in range(a.num_layers))
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

    def __init__(self, hf_config: dict[str, Any], group: Group | None = None, expert_parallel: bool = False) -> None:
        # expert_parallel: a dense model has no experts to spread
        super().__init__()
        a = self.args = LlamaArgs.from_hf(hf_config)
        self.group = group or SingleGroup()
        self.model = LlamaModel(a, self.group)
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position, a.rope)
        self.lm_head = vocab_head(a.hidden_size, a.vocab_size, self.group)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.programs: DecodePrograms | None = None  # decode steps as one C call (engine.models.llama_program)

    def bind_kernels(self, kernels: CpuKernels) -> None:
        self.programs = make_programs(self, llama_program.build, kernels)

    def programmed_linears(self) -> list[nn.Module]:
        """The linear layers and gated MLPs whose GEMMs decode programs call, where programs may run: the selection
        times them as a program calls them (engine.kernels.bind.plan_linears)."""
        if not programs_may_run(self):
            return []
        parts = [(la.self_attn.qkv_proj, la.self_attn.o_proj, la.mlp, la.mlp.down_proj) for la in self.model.layers]
        return [m for part in parts for m in part]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(positions, self.model.norm.weight.dtype)
        if self.programs is not None:
            return self.programs.forward(self.model, input_ids, cos, sin)
        return self.model(input_ids, cos, sin)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(hidden), self.args.vocab_size, self.group)  # [B, vocab], the head's dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[str, tuple[int, ...]]]:
        """Per attention layer, the cache tensors it owns: K and V of [blocks, block_size, KV heads, head_dim]
        (this rank's KV heads)."""
        shape = (num_blocks, block_size, self.model.layers[0].self_attn.num_kv_heads, self.args.head_dim)
        return [("k_cache", shape), ("v_cache", shape)]

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
