"""DeepSeek-V2, V2-Lite, V2.5 and V3: MLA over a latent paged cache + DeepSeekMoE. V3 differs by config:
sigmoid routing with e_score_correction_bias (noaux_tc). Parameter names follow the HF checkpoints.

Tensor parallel: MLA's heads split (engine.layers.mla), dense MLPs and experts split by intermediate size, the
vocabulary split; with expert_parallel the routed experts are spread whole over the ranks instead
(engine.layers.moe)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.layers.mla import MLAttention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoE, MoEGate
from engine.layers.norm import RMSNorm
from engine.layers.parallel import VocabEmbedding, gather_logits, vocab_head
from engine.layers.rotary import RotaryEmbedding, rope_parameters, yarn_mscale
from engine.models import deepseek_program
from engine.models.decode_program import DecodePrograms, make_programs, programs_may_run
from engine.models.decoder import DecoderLayer, DecoderModel
from engine.parallel.group import Group, SingleGroup

if TYPE_CHECKING:
    from engine.kernels.kernel_set import CpuKernels

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


@dataclass(slots=True)
class DeepseekArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_mtp_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: dict[str, Any]
    rope_interleave: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    tie_word_embeddings: bool
    # MoE
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    scoring: str  # softmax (V2) | sigmoid (V3)
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DeepseekArgs:
        v3 = hf.get("model_type") == "deepseek_v3" or hf.get("topk_method") == "noaux_tc"
        grouped = v3 or hf.get("topk_method") == "group_limited_greedy"
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_mtp_layers=hf.get("num_nextn_predict_layers") or 0,
            num_heads=hf["num_attention_heads"],
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position=hf.get("max_position_embeddings", 2048),
            rope=rope_parameters(hf),
            rope_interleave=hf.get("rope_interleave", True),  # V2 is always interleaved; V3 has the flag
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            hidden_act=hf.get("hidden_act", "silu"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
            num_experts=hf["n_routed_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            num_shared_experts=hf.get("n_shared_experts") or 0,
            scoring="sigmoid" if v3 else "softmax",
            num_groups=(hf.get("n_group") or 1) if grouped else 1,
            topk_groups=(hf.get("topk_group") or 1) if grouped else 1,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        )

    @property
    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        mscale_all_dim = self.rope.get("mscale_all_dim")
        if self.rope["rope_type"] != "default" and mscale_all_dim:  # YaRN: DeepSeek scales the logits too
            scale *= yarn_mscale(self.rope["factor"], mscale_all_dim) ** 2
        return scale


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(self, a: DeepseekArgs, index: int, scratch: torch.Tensor, group: Group, expert_parallel: bool) -> None:
        super().__init__()
        self.self_attn = MLAttention(
            a.hidden_size,
            a.num_heads,
            a.q_lora_rank,
            a.kv_lora_rank,
            a.qk_nope_head_dim,
            a.qk_rope_head_dim,
            a.v_head_dim,
            a.attention_bias,
            a.softmax_scale,
            a.rope_interleave,
            scratch,
            group,
        )
        self.mlp: nn.Module
        if index < a.first_k_dense_replace:
            self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act, a.mlp_bias, group)
        else:
            gate = MoEGate(
                a.hidden_size,
                a.num_experts,
                a.num_experts_per_tok,
                a.scoring,
                a.num_groups,
                a.topk_groups,
                a.norm_topk_prob,
                a.routed_scaling_factor,
            )
            self.mlp = MoE(
                gate,
                a.hidden_size,
                a.moe_intermediate_size,
                a.num_shared_experts,
                a.hidden_act,
                a.mlp_bias,
                group,
                expert_parallel,
            )
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class DeepseekModel(DecoderModel):
    def __init__(self, a: DeepseekArgs, group: Group, expert_parallel: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(a.vocab_size, a.hidden_size, group)
        scratch = torch.empty(0)  # cache rows gathered for attention, reused by every layer
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(a, i, scratch, group, expert_parallel) for i in range(a.num_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class DeepseekV2ForCausalLM(nn.Module):
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, hf_config: dict[str, Any], group: Group | None = None, expert_parallel: bool = False) -> None:
        super().__init__()
        a = self.args = DeepseekArgs.from_hf(hf_config)
        self.group = group or SingleGroup()
        # checkpoint name -> (our parameter name, shard); routed experts stay one module each (experts.N.*)
        self.packed_modules_mapping = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
        if a.q_lora_rank:
            self.packed_modules_mapping |= {
                "q_a_proj": ("qkv_a_proj", "q_a"),
                "kv_a_proj_with_mqa": ("qkv_a_proj", "kv_a"),
            }
        # V3's multi-token-prediction layers follow the decoder's; serving does not use them
        self.ignored_prefixes = tuple(
            f"model.layers.{i}." for i in range(a.num_layers, a.num_layers + a.num_mtp_layers)
        )
        self.model = DeepseekModel(a, self.group, expert_parallel)
        self.rotary = RotaryEmbedding(a.qk_rope_head_dim, a.max_position, a.rope)
        self.lm_head = vocab_head(a.hidden_size, a.vocab_size, self.group)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.programs: DecodePrograms | None = None  # decode steps as one C call (engine.models.deepseek_program)

    def bind_kernels(self, kernels: CpuKernels) -> None:
        self.programs = make_programs(self, deepseek_program.build, kernels)

    def programmed_linears(self) -> list[nn.Module]:
        """The linear layers and gated MLPs whose GEMMs decode programs call, where programs may run: the selection
        times them as a program calls them (engine.kernels.bind.plan_linears)."""
        if not programs_may_run(self):
            return []
        out: list[nn.Module] = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_lora_rank:
                out += [attn.qkv_a_proj, attn.q_b_proj, attn.o_proj]
            else:
                out += [attn.q_proj, attn.kv_a_proj_with_mqa, attn.o_proj]
            gated = mlp.shared_experts if isinstance(mlp, MoE) else mlp
            if isinstance(gated, GatedMLP):
                out += [gated, gated.down_proj]
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(positions, self.model.norm.weight.dtype)  # [T, 1, R]
        if self.programs is not None:
            return self.programs.forward(self.model, input_ids, cos, sin)
        return self.model(input_ids, cos, sin)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(hidden), self.args.vocab_size, self.group)  # [B, vocab], the head's dtype

    def held_elsewhere(self, name: str) -> bool:
        """Expert parallel: a checkpoint tensor of a routed expert that another rank holds."""
        m = _EXPERT.search(name)
        if m is None:
            return False
        layer = int(m.group(1))
        if layer >= len(self.model.layers):
            return False
        mlp = self.model.layers[layer].mlp
        return isinstance(mlp, MoE) and not mlp.holds_expert(int(m.group(2)))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[str, tuple[int, ...]]]:
        """Per attention layer, one latent cache: [blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
        return [("kv_cache", (num_blocks, block_size, self.args.kv_lora_rank + self.args.qk_rope_head_dim))]

    def attention_layers(self) -> list[MLAttention]:
        return [layer.self_attn for layer in self.model.layers]
