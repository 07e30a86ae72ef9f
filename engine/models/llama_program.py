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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.kernels import program
from engine.kernels.decode_attn import DECODE_ROWS, DecodeAttention
from engine.kernels.gemm import Act, CEntry, EntryRun, KernelRun, WithAct
from engine.kernels.pointwise import PointwiseKernels
from engine.kernels.program import INPUT, Program, ProgramBuilder, address
from engine.kernels.select import row_class
from engine.layers.norm import RMSNorm

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class _Gemm:
    entry: CEntry  # how the program makes the kernel's call
    act: Act | None  # a gated MLP's act, run in torch after the GEMM (a path that does not fuse it)

    @property
    def cols(self) -> int:
        return self.entry.cols


def _gemm(plan: object, cls: int, dtype: torch.dtype) -> _Gemm | None:
    """The run a GemmPlan makes at batch class `cls`, where that is a C kernel over `dtype` activations (then,
    perhaps, a gated MLP's act in torch)."""
    runs = getattr(plan, "runs", None)
    if runs is None:
        return None
    run, act = runs[cls], None
    if isinstance(run, WithAct):
        run, act = run.run, run.act
    entry = run.c_entry() if isinstance(run, KernelRun | EntryRun) else None
    if entry is None or entry.dtype != dtype:
        return None
    return _Gemm(entry, act)


@dataclass(frozen=True, slots=True)
class _Hooked:
    """A GEMM whose plan chose a path with no C entry at this class, or transforms its inputs first: the program
    calls the plan from Python."""

    plan: Callable[[torch.Tensor], torch.Tensor]
    cols: int
    act: None = None  # the plan computes the whole output (a gated MLP's plan includes its act)


def _part(plan: object, cls: int, dtype: torch.dtype, cols: int) -> _Gemm | _Hooked | None:
    """The GEMM as the program runs it: its C entry, or the plan itself called between two C calls (`cols`: the
    plan's output columns); None where the layer has no plan (it runs F.linear). A plan that transforms its inputs
    first (`pre`: an online rotation) is always called whole: its kernel alone would skip that."""
    if getattr(plan, "pre", None) is None and (gemm := _gemm(plan, cls, dtype)) is not None:
        return gemm
    return _Hooked(plan, cols) if callable(plan) and getattr(plan, "runs", None) is not None else None


def _emit(b: ProgramBuilder, gemm: _Gemm | _Hooked, k: int, inp: torch.Tensor, out: torch.Tensor) -> None:
    if isinstance(gemm, _Gemm):
        gemm.entry.emit(b, k, inp.data_ptr(), out.data_ptr())
        b.keep += gemm.entry.keep
    else:
        b.python(_plan_hook(gemm.plan, inp, out))


def _plan_hook(
    plan: Callable[[torch.Tensor], torch.Tensor], inp: torch.Tensor, out: torch.Tensor
) -> Callable[[int], object]:
    return lambda rows: out[:rows].copy_(plan(inp[:rows]))


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
    if dtype not in (torch.bfloat16, torch.float32) or model.group.size != 1 or cls >= len(DECODE_ROWS):
        return "programs are built for bf16 or float32 math on one rank, up to 128 rows"
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
        qkv = _part(attn.qkv_proj.plan, cls, dtype, attn.qkv_proj.out_features)
        o = _part(attn.o_proj.plan, cls, dtype, attn.o_proj.out_features)
        gate_up = _part(mlp.gate_up_act, cls, dtype, mlp.down_proj.in_features)
        down = _part(mlp.down_proj.plan, cls, dtype, mlp.down_proj.out_features)
        rope = attn.kernel.rope_entry(dtype) if isinstance(attn.kernel, PointwiseKernels) else None
        fits = isinstance(pa.kernel, DecodeAttention) and pa.in_place(width)
        attn_fn = pa.kernel.entry(dtype) if fits else None  # type: ignore[union-attr]
        parts = {"RMSNorm": n1 and n2, "the QKV GEMM": qkv, "the O GEMM": o, "the gate/up GEMM": gate_up,
                 "the down GEMM": down, "RoPE": rope, "decode attention": attn_fn}  # fmt: skip
        missing = [name for name, part in parts.items() if part is None]
        if missing:
            return f"{missing[0]} has no C kernel here (the layer runs it in torch)"
        assert qkv is not None and o is not None and gate_up is not None and down is not None  # (for the types)
        h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q_cols, kv_cols = h * d, kv * d
        inter = gate_up.cols // 2 if gate_up.act is not None else gate_up.cols  # the act's output columns
        shapes = (qkv.cols, o.cols, down.cols, attn.o_proj.in_features, mlp.down_proj.in_features)
        if (
            pa.k_cache.dtype != dtype
            or pa.k_cache.dim() != 4
            or not (pa.k_cache.is_contiguous() and pa.v_cache.is_contiguous())
            or shapes != (q_cols + 2 * kv_cols, hidden, hidden, q_cols, inter)
            or qkv.act is not None
            or o.act is not None
            or down.act is not None
        ):
            return "a layer's shapes are not the plain Llama layout"
        qkv_buf, q_buf = shared("qkv", qkv.cols), shared("q", q_cols)
        a_buf, act_buf = shared("attention", q_cols), shared("act", inter)
        b.norm(n1, hidden, x, res, ptr(layer.input_layernorm.weight), layer.input_layernorm.eps, ptr(norm_out), res)  # type: ignore[arg-type]
        res = x if res is None else res  # without a residual, the first norm's input is the residual from then on
        _emit(b, qkv, hidden, norm_out, qkv_buf)
        b.rope(address(rope), h + kv, d, ptr(qkv_buf), qkv.cols)
        b.store(qkv.cols * esize, ptr(qkv_buf), q_cols * esize, ptr(q_buf), ptr(qkv_buf) + q_cols * esize,
                ptr(qkv_buf) + (q_cols + kv_cols) * esize, kv_cols * esize, pa.k_cache.data_ptr(),
                pa.v_cache.data_ptr())  # fmt: skip
        b.attention(address(attn_fn), h, kv, d, ptr(q_buf), pa.k_cache.data_ptr(), pa.v_cache.data_ptr(),
                    pa.k_cache.shape[1], pa.scale, ptr(a_buf))  # fmt: skip
        _emit(b, o, q_cols, a_buf, o_buf)
        # the residual sum lands in the program's own buffer: the first layer's came from the step's input
        post = layer.post_attention_layernorm
        b.norm(n2, hidden, ptr(o_buf), res, ptr(post.weight), post.eps, ptr(norm_out), ptr(residual))  # type: ignore[arg-type]
        res = ptr(residual)
        if gate_up.act is None:  # the fused entry (or the plan) writes silu(gate) * up itself
            _emit(b, gate_up, hidden, norm_out, act_buf)
        else:  # [gate | up], then the layers' own act in torch between two C calls: the same bits as the layers
            gu_buf = shared("gate_up", gate_up.cols)
            _emit(b, gate_up, hidden, norm_out, gu_buf)
            b.python(_act_hook(gate_up.act, gu_buf, act_buf))
        _emit(b, down, inter, act_buf, x_buf)
        x = ptr(x_buf)
        b.keep += [pa.k_cache, pa.v_cache]
    b.norm(final, hidden, x, res, ptr(decoder.norm.weight), decoder.norm.eps, ptr(norm_out), ptr(residual))
    return b.build(lib, norm_out)


def _act_hook(act: Act, gate_up: torch.Tensor, out: torch.Tensor) -> Callable[[int], object]:
    return lambda rows: out[:rows].copy_(act(gate_up[:rows]))
