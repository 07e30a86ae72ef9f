"""A Llama-family decode step as one program (engine.kernels.program): every layer's kernels, no Python between.

Built for one decode batch class (1, <= 8, <= 32, <= 128 rows) when every norm, RoPE and attention of every layer
runs a kernel the program can call at that class: RMSNorm and RoPE from pointwise.c, the paged decode attention.
Each linear layer's GEMM runs through its C kernel's entry point (bf16mm or amxmm in bf16 math, wbf16 in float32,
i8mm / i8amx, w4mm / w4amx; the gated MLP through its fused SiLU entry) where the layer's plan chose one at that
class; where it chose a path with no C entry (oneDNN, torch's int4 GEMM), the program stops for the plan's own
call between two C calls, as it does for a plan that rotates its inputs first (engine.quant.transform), so it
still computes what the layers compute. Tensor parallel ranks keep the layers.

Per layer, over the program's own buffers (rows x width):
    norm(x, residual) → n          qkv = n Wqkv^T + b       RoPE(q, k) in place      k, v → cache; q → dense
    attention(q) → a               o = a Wo^T               norm(o, residual) → n    act = silu(n Wg^T) * n Wu^T
    x = act Wd^T
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kernels.decode_attn import DecodeAttention
from engine.kernels.pointwise import PointwiseKernels
from engine.kernels.program import Program, address
from engine.models.program_parts import emit, gated_mlp, norm_entry, part, start

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM


def build(model: LlamaForCausalLM, rows: int) -> Program | str:
    """The program for decode steps of `rows`' batch class, or what keeps one from being built (for the log).

    Only kernels the layers themselves run are called: a program computes what they compute, bit for bit."""
    started = start(model, rows)
    if isinstance(started, str):
        return started
    lib, f, cls, final = started
    b, dtype, esize, hidden, ptr = f.b, f.dtype, f.esize, f.hidden, torch.Tensor.data_ptr
    decoder = model.model
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        pa = attn.attn
        n1, n2 = norm_entry(layer.input_layernorm, dtype), norm_entry(layer.post_attention_layernorm, dtype)
        qkv = part(attn.qkv_proj.plan, cls, dtype, attn.qkv_proj.out_features)
        o = part(attn.o_proj.plan, cls, dtype, attn.o_proj.out_features)
        rope = attn.kernel.rope_entry(dtype) if isinstance(attn.kernel, PointwiseKernels) else None
        fits = isinstance(pa.kernel, DecodeAttention) and pa.in_place(f.width)
        attn_fn = pa.kernel.entry(dtype) if fits else None  # type: ignore[union-attr]
        parts = {"RMSNorm": n1 and n2, "the QKV GEMM": qkv, "the O GEMM": o, "RoPE": rope, "decode attention": attn_fn}
        missing = [name for name, p in parts.items() if p is None]
        if missing:
            return f"{missing[0]} has no C kernel here (the layer runs it in torch)"
        assert qkv is not None and o is not None and n1 is not None and n2 is not None  # (for the types)
        h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q_cols, kv_cols = h * d, kv * d
        if (
            pa.k_cache.dtype != dtype
            or pa.k_cache.dim() != 4
            or not (pa.k_cache.is_contiguous() and pa.v_cache.is_contiguous())
            or (qkv.cols, o.cols, attn.o_proj.in_features) != (q_cols + 2 * kv_cols, hidden, q_cols)
            or qkv.act is not None
            or o.act is not None
        ):
            return "a layer's shapes are not the plain Llama layout"
        qkv_buf, q_buf, a_buf = f.buffer("qkv", qkv.cols), f.buffer("q", q_cols), f.buffer("attention", q_cols)
        f.pre_norm(layer.input_layernorm, n1)
        emit(b, qkv, hidden, f.norm_out, qkv_buf)
        b.rope(address(rope), h + kv, d, ptr(qkv_buf), qkv.cols)
        b.store(qkv.cols * esize, ptr(qkv_buf), q_cols * esize, ptr(q_buf), ptr(qkv_buf) + q_cols * esize,
                ptr(qkv_buf) + (q_cols + kv_cols) * esize, kv_cols * esize, pa.k_cache.data_ptr(),
                pa.v_cache.data_ptr())  # fmt: skip
        b.attention(address(attn_fn), h, kv, d, ptr(q_buf), pa.k_cache.data_ptr(), pa.v_cache.data_ptr(),
                    pa.k_cache.shape[1], pa.scale, ptr(a_buf))  # fmt: skip
        emit(b, o, q_cols, a_buf, f.o_buf)
        f.post_norm(layer.post_attention_layernorm, n2)
        why = gated_mlp(b, mlp, cls, dtype, f.buffer, f.norm_out, f.x_buf)
        if why is not None:
            return why
        f.layer_done()
        b.keep += [pa.k_cache, pa.v_cache]
    return f.finish(lib, decoder.norm, final)
