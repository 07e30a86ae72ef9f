"""CpuKernels: the kernels a model's layers may take in the binding pass (engine.kernels.bind)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.kernels.decode_attn import DecodeAttention
from engine.kernels.grouped import GroupedKernel, GroupedLinear, SplitGrouped
from engine.kernels.pointwise import PointwiseKernels
from engine.kernels.prefill_attn_amx import PrefillAttention

if TYPE_CHECKING:
    from engine.layers.mla import MLAttention
    from engine.quant.absorbed_key import GroupScaledKey

# a grouped call's form: [rows, K] and rows per group → [rows, N] (GroupedLinear, engine.quant's GroupedQuantLinear)
Grouped = GroupedLinear | SplitGrouped | Callable[[torch.Tensor, list[int]], torch.Tensor]

# given a MoE layer's quantized experts' gate/up and down weights, their grouped call ([rows, H], counts → [rows, H])
QuantExpertsFactory = Callable[[list[object], list[object]], Callable[[torch.Tensor, list[int]], torch.Tensor] | None]


@dataclass(slots=True)
class CpuKernels:
    """One field per kernelled op; None where the kernel is off, did not build, failed its self-check, or was
    measured slower than the torch code on this machine (engine.kernels.op_choice)."""

    rms_norm: PointwiseKernels | None = None
    rope: PointwiseKernels | None = None
    rope_pairs: PointwiseKernels | None = None  # RoPE on interleaved pairs (DeepSeek's MLA)
    moe_combine: PointwiseKernels | None = None  # a MoE layer's weighted sum of its routed and shared rows
    moe_route: PointwiseKernels | None = None  # a MoE layer's greedy softmax routing, its pairs grouped by expert
    argmax: PointwiseKernels | None = None
    sample: PointwiseKernels | None = None  # random sampling's inverse CDF (engine.sampler.inverse_cdf)
    decode_attn: DecodeAttention | None = None
    # per decode batch class (engine.kernels.decode_attn.DECODE_ROWS), whether decode_attn runs a step of that many
    # rows (False: gather + SDPA was faster there)
    decode_attn_at: tuple[bool, ...] = ()
    # prompt chunks of up to this many tokens attend through decode_attn, one query row per token, over the cache
    # (0: never): measured against SDPA's causal prefill (engine.kernels.op_choice.prefill_in_place_limit)
    prefill_in_place: int = 0
    # prompt chunks of up to this many tokens, whole or after cached tokens, attend through this kernel instead of
    # SDPA (0: never): measured on whole prompts by engine.kernels.op_choice.choose_prefill_attention
    prefill_attn: PrefillAttention | None = None
    prefill_attn_up_to: int = 0
    # a MoE layer's routed experts in one grouped call per projection (engine.kernels.grouped.GroupedExperts), where
    # that beat a oneDNN call per expert (engine.kernels.op_choice.choose_grouped_experts)
    moe_experts: GroupedKernel | None = None
    # the same for quantized experts (engine.quant.grouped.GroupedQuantExperts), where that beat the kernel's call
    # per expert (engine.kernels.op_choice.choose_quant_experts): given the experts' gate/up and down weights, the
    # grouped call, or None where they do not fit it
    moe_quant: QuantExpertsFactory | None = None
    # MLA decode over the paged latent cache in place (engine.layers.mla), where it beat gather + SDPA
    # (engine.kernels.op_choice.choose_latent_attention)
    latent_attn: DecodeAttention | None = None
    latent_attn_at: tuple[bool, ...] = ()  # as decode_attn_at
    # MLA decode's per-head W_UK / W_UV products as one grouped call each, where that beat torch.bmm: given the
    # layer, its two grouped calls (engine.kernels.op_choice.choose_absorbed_gemm; W_UV over the checkpoint's
    # quantized rows where that beat the bf16 call: choose_absorbed_quant; W_UK over its int4 key rows likewise:
    # choose_absorbed_key; in float32 math both over the int4 rows: choose_absorbed_float32, or the float32 weights
    # as two exact bf16 halves: grouped.SplitGrouped)
    absorbed: Callable[[MLAttention], tuple[GroupedLinear | GroupScaledKey | SplitGrouped, Grouped] | None] | None = (
        None
    )
    # decode steps as one C call over the kernels above (engine.models.decode_program): auto | program | layers
    decode_program: str = "auto"
