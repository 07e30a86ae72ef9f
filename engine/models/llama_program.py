"""A Llama-family decode step as one program (engine.kernels.program): every layer's kernels, no Python between.

Built for one decode batch class (1, <= 8, <= 32, <= 128 rows) when every part of every layer runs a kernel the
program can call at that class: RMSNorm and RoPE from pointwise.c, the paged decode attention, and each linear
layer's GEMM through a bf16 kernel's entry point (bf16mm, amxmm; the gated MLP through its fused SiLU entry).
Anything else (float32 math, oneDNN or quantized GEMMs, tensor parallel ranks) keeps the layers' Python path.

Per layer, over the program's own buffers (rows x width):
    norm(x, residual) → n          qkv = n Wqkv^T + b       RoPE(q, k) in place      k, v → cache; q → dense
    attention(q) → a               o = a Wo^T               norm(o, residual) → n    act = silu(n Wg^T) * n Wu^T
    x = act Wd^T
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kernels import program
from engine.kernels.decode_attn import DECODE_ROWS, DecodeAttention
from engine.kernels.gemm import KernelRun
from engine.kernels.pointwise import PointwiseKernels
from engine.kernels.program import INPUT, Program, ProgramBuilder, address
from engine.kernels.select import row_class
from engine.layers.norm import RMSNorm

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM


def _gemm(plan: object, cls: int) -> tuple[int, int, int, int, torch.Tensor | None] | None:
    """(entry point, output columns, the entry's N (the weight's rows), packed weight, bias) of the run a GemmPlan
    makes at batch class `cls`."""
    runs = getattr(plan, "runs", None)
    if runs is None:
        return None
    run = runs[cls]
    entry = run.bf16_entry() if isinstance(run, KernelRun) else None
    if entry is None:
        return None
    fn, cols, bias = entry
    return address(fn), cols, run.n, run.packed.data_ptr(), bias


def _norm_entry(norm: RMSNorm, dtype: torch.dtype) -> int | None:
    k, w = norm.kernel, norm.weight
    fn = k.norm_entry(dtype) if isinstance(k, PointwiseKernels) and w.dtype == dtype and w.is_contiguous() else None
    return address(fn) if fn is not None else None


def build(model: LlamaForCausalLM, rows: int) -> Program | str:
    """The program for decode steps of `rows`' batch class, or what keeps one from being built (for the log).

    Only kernels the layers themselves run are called: a program computes what they compute, bit for bit."""
    lib = program.library()
    a, decoder = model.args, model.model
    dtype = decoder.norm.weight.dtype
    cls = row_class(rows)
    if lib is None:
        return "the program executor did not build"
    if dtype != torch.bfloat16 or model.group.size != 1 or cls >= len(DECODE_ROWS):
        return "programs are built for bf16 math on one rank, up to 128 rows"
    width = DECODE_ROWS[cls]  # the most rows a step of this class has
    b = ProgramBuilder()
    hidden, esize = a.hidden_size, torch.empty(0, dtype=dtype).element_size()
    final = _norm_entry(decoder.norm, dtype)
    if final is None:
        return "the final RMSNorm runs in torch"
    ptr = torch.Tensor.data_ptr
    norm_out = b.buffer(width, hidden, dtype=dtype)
    residual = b.buffer(width, hidden, dtype=dtype)
    x_buf = b.buffer(width, hidden, dtype=dtype)
    o_buf = b.buffer(width, hidden, dtype=dtype)
    buffers: dict[tuple[str, int], torch.Tensor] = {}

    def shared(name: str, cols: int) -> torch.Tensor:
        """The [width, cols] buffer `name` of every layer (they run one after another, and it stays in cache)."""
        if (name, cols) not in buffers:
            buffers[name, cols] = b.buffer(width, cols, dtype=dtype)
        return buffers[name, cols]

    x: int | program.Step = INPUT  # layer 0 reads the embeddings where the step put them
    res: int | program.Step | None = None  # no residual before the first norm
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        pa = attn.attn
        n1, n2 = _norm_entry(layer.input_layernorm, dtype), _norm_entry(layer.post_attention_layernorm, dtype)
        qkv, o = _gemm(attn.qkv_proj.plan, cls), _gemm(attn.o_proj.plan, cls)
        gate_up, down = _gemm(mlp.gate_up_act, cls), _gemm(mlp.down_proj.plan, cls)
        rope = attn.kernel.rope_entry(dtype) if isinstance(attn.kernel, PointwiseKernels) else None
        fits = isinstance(pa.kernel, DecodeAttention) and pa.in_place(width)
        attn_fn = pa.kernel.entry(dtype) if fits else None  # type: ignore[union-attr]
        parts = {"RMSNorm": n1 and n2, "the QKV GEMM": qkv, "the O GEMM": o, "the gate/up GEMM": gate_up,
                 "the down GEMM": down, "RoPE": rope, "decode attention": attn_fn}  # fmt: skip
        missing = [name for name, part in parts.items() if part is None]
        if missing:
            return f"{missing[0]} has no C kernel here (torch, oneDNN or a kernel of another signature runs it)"
        assert qkv is not None and o is not None and gate_up is not None and down is not None  # (for the types)
        h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q_cols, kv_cols = h * d, kv * d
        shapes = (qkv[1], o[1], down[1], attn.o_proj.in_features, mlp.down_proj.in_features)
        if (
            pa.k_cache.dtype != dtype
            or pa.k_cache.dim() != 4
            or not (pa.k_cache.is_contiguous() and pa.v_cache.is_contiguous())
            or shapes != (q_cols + 2 * kv_cols, hidden, hidden, q_cols, gate_up[1])
        ):
            return "a layer's shapes are not the plain Llama layout"
        qkv_buf, q_buf = shared("qkv", qkv[1]), shared("q", q_cols)
        a_buf, act_buf = shared("attention", q_cols), shared("act", gate_up[1])
        for bias in (qkv[4], o[4], gate_up[4], down[4]):
            if bias is not None:
                b.keep.append(bias)
        b.norm(n1, hidden, x, res, ptr(layer.input_layernorm.weight), layer.input_layernorm.eps, ptr(norm_out), res)  # type: ignore[arg-type]
        res = x if res is None else res  # without a residual, the first norm's input is the residual from then on
        b.gemm(qkv[0], qkv[2], hidden, ptr(norm_out), qkv[3], _ptr(qkv[4]), ptr(qkv_buf))
        b.rope(address(rope), h + kv, d, ptr(qkv_buf), qkv[1])
        b.store(qkv[1] * esize, ptr(qkv_buf), q_cols * esize, ptr(q_buf), ptr(qkv_buf) + q_cols * esize,
                ptr(qkv_buf) + (q_cols + kv_cols) * esize, kv_cols * esize, pa.k_cache.data_ptr(),
                pa.v_cache.data_ptr())  # fmt: skip
        b.attention(address(attn_fn), h, kv, d, ptr(q_buf), pa.k_cache.data_ptr(), pa.v_cache.data_ptr(),
                    pa.k_cache.shape[1], pa.scale, ptr(a_buf))  # fmt: skip
        b.gemm(o[0], o[2], q_cols, ptr(a_buf), o[3], _ptr(o[4]), ptr(o_buf))
        # the residual sum lands in the program's own buffer: the first layer's came from the step's input
        post = layer.post_attention_layernorm
        b.norm(n2, hidden, ptr(o_buf), res, ptr(post.weight), post.eps, ptr(norm_out), ptr(residual))  # type: ignore[arg-type]
        res = ptr(residual)
        b.gemm(gate_up[0], gate_up[2], hidden, ptr(norm_out), gate_up[3], _ptr(gate_up[4]), ptr(act_buf))
        b.gemm(down[0], down[2], gate_up[1], ptr(act_buf), down[3], _ptr(down[4]), ptr(x_buf))
        x = ptr(x_buf)
        b.keep += [pa.k_cache, pa.v_cache]
    b.norm(final, hidden, x, res, ptr(decoder.norm.weight), decoder.norm.eps, ptr(norm_out), ptr(residual))
    return b.build(lib, norm_out)


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None
