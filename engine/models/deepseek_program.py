"""A DeepSeek-V2 decode step as one program (engine.kernels.program): MLA and MoE layers' kernels, no Python between.

WHY: at batch 1 a DeepSeek-V2-tiny token spent ~0.6 ms an MLA layer and ~0.6 ms a MoE layer, of which their GEMMs
took ~0.2 and ~0.3; the rest was ~140 small torch ops a token and the Python around them (2-core Xeon, W4A16,
`python -m benchmarks.step_profile --shape deepseek-v2-tiny --quantization w4a16 --num-prompts 1`).

Built for a decode batch class where every piece runs a kernel the program can call: the norms and RoPE on
interleaved pairs (pointwise.c), MLA's latent decode attention, its per-head W_UK / W_UV products as grouped calls
(engine.kernels.grouped), the routing and combine in C (pointwise.c's moe_route, V2's and V3's routers, and
moe_combine) and the routed experts as grouped calls (bf16, W4A16 or W8A8); the linear layers' GEMMs as in
engine.models.llama_program (their C entry, or the plan between two C calls). Anything else (bmm for W_UK / W_UV,
the experts one call each, RoPE on halves) keeps the layers, which compute the same.

Per layer (rows [rows][...] unless said; "heads-major" is [heads][rows][...], a grouped call's layout):
    norm(x, residual) → n                      qa = n W_qkv_a^T = [q_a | c | k_pe]
    norm(q_a) → nq                             q = nq W_q_b^T = [heads][nope | rope]
    RoPE pairs on q's rope and on k_pe         norm(c) | k_pe → latent → the cache at the step's slots
    q's nope → heads-major → W_UK (grouped; over int4 key rows: scaled per latent group, then by group) →
    q_cat[:, h, :L]; q's rope → q_cat[:, h, L:]
    attention(q_cat) over the latent cache → a[:, h, :L] → heads-major → W_UV (grouped) → [rows][heads * V]
    O GEMM → o;  norm(o, residual) → n
    dense: the gated MLP (as Llama's);  MoE: route(n) → weights, order, counts, xs;  experts' gate/up + SiLU and
    down (grouped) → ys;  shared experts (a gated MLP) → sh;  combine(ys, weights, sh) → x
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kernels.decode_attn import DecodeAttention
from engine.kernels.grouped import GroupedExperts, GroupedLinear, SplitGrouped
from engine.kernels.pointwise import PointwiseKernels, route_config
from engine.kernels.program import Program, address
from engine.layers.mla import MLAttention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoE
from engine.models.program_parts import Frame, Gemm, Hooked, emit, gated_mlp, norm_entry, part, start
from engine.quant.absorbed_key import GroupScaledKey
from engine.quant.grouped import GroupedQuantExperts, GroupedQuantLinear, rows_dtype

if TYPE_CHECKING:
    from engine.models.deepseek_v2 import DeepseekV2ForCausalLM


def build(model: DeepseekV2ForCausalLM, rows: int) -> Program | str:
    """The program for decode steps of `rows`' batch class, or what keeps one from being built (for the log).

    Only kernels the layers themselves run are called: a program computes what they compute, bit for bit."""
    started = start(model, rows)
    if isinstance(started, str):
        return started
    lib, f, cls, final = started
    decoder = model.model
    for layer in decoder.layers:
        n1, n2 = norm_entry(layer.input_layernorm, f.dtype), norm_entry(layer.post_attention_layernorm, f.dtype)
        if n1 is None or n2 is None:
            return "RMSNorm has no C kernel here (the layer runs it in torch)"
        f.pre_norm(layer.input_layernorm, n1)
        why = _mla(f, layer.self_attn, cls)
        if why is not None:
            return why
        f.post_norm(layer.post_attention_layernorm, n2)
        mlp = layer.mlp
        why = (
            _moe(f, mlp, cls)
            if isinstance(mlp, MoE)
            else gated_mlp(f.b, mlp, cls, f.dtype, f.buffer, f.norm_out, f.x_buf)
        )
        if why is not None:
            return why
        f.layer_done()
    return f.finish(lib, decoder.norm, final)


def _rope_pairs(attn: MLAttention, dtype: torch.dtype) -> int | None:
    """The C entry of the layer's RoPE where it runs pointwise.c's on interleaved pairs."""
    kernel = getattr(attn.rotate, "__self__", None)
    if not attn.interleaved or not isinstance(kernel, PointwiseKernels):
        return None
    fn = kernel.rope_pairs_entry(dtype)
    return address(fn) if fn is not None else None


def _rows_type(call: object) -> torch.dtype | None:
    """The rows a W_UK / W_UV grouped call takes and gives: its kernel's (a bf16-weight call's, or a quantized
    one's), or, for W_UK over int4 key rows, the bf16 call's it takes past one row where it has one."""
    if isinstance(call, GroupScaledKey):
        return call.dtype if call.wide is None else call.wide.kernel.dtype
    if isinstance(call, GroupedLinear | SplitGrouped):
        return call.kernel.dtype
    return rows_dtype(call.kernel) if isinstance(call, GroupedQuantLinear) else None


def _mla(f: Frame, attn: MLAttention, cls: int) -> str | None:
    """MLA of norm_out into o_buf; None, or why the layer has no program here."""
    b, dtype, es, ptr = f.b, f.dtype, f.esize, torch.Tensor.data_ptr
    h, nope, r, lat, v = attn.num_heads, attn.nope, attn.rope, attn.kv_lora_rank, attn.v_dim
    qa: Gemm | Hooked | None
    q_lora = attn.q_lora_rank or 0
    if q_lora:  # [q_a | c | k_pe] from one GEMM, then q_a's norm and the query's up-projection
        qa = part(attn.qkv_a_proj.plan, cls, dtype, attn.qkv_a_proj.out_features)
        qb = part(attn.q_b_proj.plan, cls, dtype, attn.q_b_proj.out_features)
        nq = norm_entry(attn.q_a_layernorm, dtype)
    else:  # V2-Lite: the query and [c | k_pe] from two GEMMs
        qa = part(attn.kv_a_proj_with_mqa.plan, cls, dtype, attn.kv_a_proj_with_mqa.out_features)
        qb = part(attn.q_proj.plan, cls, dtype, attn.q_proj.out_features)
        nq = None
    o = part(attn.o_proj.plan, cls, dtype, attn.o_proj.out_features)
    nkv = norm_entry(attn.kv_a_layernorm, dtype)
    rope = _rope_pairs(attn, dtype)
    fits = isinstance(attn.kernel, DecodeAttention) and attn.in_place(f.width)
    attn_fn = attn.kernel.entry(dtype) if fits else None  # type: ignore[union-attr]
    absorbed = attn.absorbed
    grouped = absorbed is not None and _rows_type(absorbed[0]) == _rows_type(absorbed[1]) == dtype
    parts = {"MLA's input projection": qa, "the query's projection": qb, "the O GEMM": o,
             "MLA's norms": (nq or not q_lora) and nkv, "RoPE on pairs": rope, "latent decode attention": attn_fn,
             "W_UK / W_UV as grouped calls": grouped}  # fmt: skip
    missing = [name for name, p in parts.items() if not p]
    if missing:
        return f"{missing[0]} has no C kernel here (the layer runs it in torch)"
    assert qa is not None and qb is not None and o is not None and absorbed is not None and nkv and rope
    cache = attn.kv_cache
    qa_cols, q_cols, row = qa.cols, h * (nope + r), lat + r
    if (
        qa.act or qb.act or o.act
        or (qa_cols, qb.cols, o.cols, attn.o_proj.in_features) != (q_lora + row, q_cols, f.hidden, h * v)
        or cache.dtype != dtype or cache.dim() != 3 or cache.shape[2] != row or not cache.is_contiguous()
        or (absorbed[0].n, absorbed[0].k, absorbed[1].n, absorbed[1].k) != (lat, nope, v, lat)
    ):  # fmt: skip
        return "an MLA layer's shapes are not DeepSeek-V2's layout"
    qa_buf, q_buf = f.buffer("qa", qa_cols), f.buffer("q", q_cols)
    latent, q_cat, att = f.buffer("latent", row), f.buffer("q_cat", h * row), f.buffer("att", h * row)
    # heads-major, rows * h of them: q_nope then the attended latents in, their products out
    heads_in, heads_out = f.buffer("heads_in", h * max(nope, lat)), f.buffer("heads_out", h * max(lat, v))
    counts = f.buffer("heads", h, dtype=torch.int64, rows=1)
    o_in = f.buffer("o_in", h * v)

    emit(b, qa, f.hidden, f.norm_out, qa_buf)
    if nq is not None:
        nq_buf = f.buffer("nq", q_lora)
        b.norm_rows(nq, q_lora, ptr(qa_buf), qa_cols * es, ptr(attn.q_a_layernorm.weight), attn.q_a_layernorm.eps,
                    ptr(nq_buf), q_lora * es)  # fmt: skip
        emit(b, qb, q_lora, nq_buf, q_buf)
    else:
        emit(b, qb, f.hidden, f.norm_out, q_buf)
    b.rope_pairs(rope, h, r, ptr(q_buf) + nope * es, q_cols, nope + r)
    k_pe = ptr(qa_buf) + (q_lora + lat) * es
    b.rope_pairs(rope, 1, r, k_pe, qa_cols, r)
    b.norm_rows(nkv, lat, ptr(qa_buf) + q_lora * es, qa_cols * es, ptr(attn.kv_a_layernorm.weight),
                attn.kv_a_layernorm.eps, ptr(latent), row * es)  # fmt: skip
    b.copy(1, r * es, k_pe, qa_cols * es, 0, ptr(latent) + lat * es, row * es, 0)
    b.scatter(row * es, ptr(latent), row * es, ptr(cache))
    # q_cat = [q_nope W_UK | q_pe] per head
    b.copy(h, nope * es, ptr(q_buf), q_cols * es, (nope + r) * es, ptr(heads_in), nope * es, 0)
    b.fill_rows(h, ptr(counts))
    if isinstance(absorbed[0], GroupScaledKey):  # over the checkpoint's int4 key rows at one row
        absorbed[0].emit(b, ptr(counts), ptr(heads_in), ptr(heads_out), f.width)
    elif isinstance(absorbed[0], SplitGrouped):  # float32 weights as two bf16 halves, the rows fed twice
        absorbed[0].emit(b, ptr(counts), ptr(heads_in), ptr(heads_out), h, f.width)
    else:
        absorbed[0].emit(b, ptr(counts), ptr(heads_in), ptr(heads_out))
    b.copy(h, lat * es, ptr(heads_out), lat * es, 0, ptr(q_cat), h * row * es, row * es)
    b.copy(h, r * es, ptr(q_buf) + nope * es, q_cols * es, (nope + r) * es, ptr(q_cat) + lat * es, h * row * es,
           row * es)  # fmt: skip
    b.attention(address(attn_fn), h, 1, row, ptr(q_cat), ptr(cache), ptr(cache), cache.shape[1], attn.scale, ptr(att))
    # the attended latents through W_UV per head, then [rows][heads * V] for O
    b.copy(h, lat * es, ptr(att), h * row * es, row * es, ptr(heads_in), lat * es, 0)
    if isinstance(absorbed[1], SplitGrouped):
        absorbed[1].emit(b, ptr(counts), ptr(heads_in), ptr(heads_out), h, f.width)
    else:
        absorbed[1].emit(b, ptr(counts), ptr(heads_in), ptr(heads_out))
    b.copy(h, v * es, ptr(heads_out), v * es, 0, ptr(o_in), h * v * es, v * es)
    emit(b, o, h * v, o_in, f.o_buf)
    b.keep += [cache]
    return None


def _moe(f: Frame, moe: MoE, cls: int) -> str | None:
    """The MoE layer of norm_out into x_buf; None, or why the layer has no program here."""
    b, dtype, ptr = f.b, f.dtype, torch.Tensor.data_ptr
    router, combine = moe.router, getattr(moe.combine, "__self__", None)
    grouped = moe.grouped
    gate, k, hidden = moe.gate, moe.gate.top_k, f.hidden
    if (
        router is None
        or router.route_entry(dtype) is None
        or not router.routes(torch.empty(1, hidden, dtype=dtype), gate)
    ):
        return "the MoE routing runs in torch"
    if not isinstance(combine, PointwiseKernels) or combine.combine_entry(dtype) is None:
        return "the MoE combine runs in torch"
    if not isinstance(grouped, GroupedExperts | GroupedQuantExperts) or moe.num_local != moe.num_experts:
        return "the routed experts run one call each"
    experts, pairs = gate.weight.shape[0], f.width * k
    up, down = (grouped.gate_up, grouped.down) if isinstance(grouped, GroupedExperts) else grouped.projections(pairs)
    if (up.kernel.dtype if isinstance(grouped, GroupedExperts) else rows_dtype(up.kernel)) != dtype:
        return "the routed experts' grouped kernel takes rows of another dtype"
    weights, ids = f.buffer("route_w", k, dtype=torch.float32), f.buffer("route_ids", k, dtype=torch.int64)
    order = f.buffer("order", 1, dtype=torch.int64, rows=pairs)
    counts = f.buffer("experts", experts, dtype=torch.int64, rows=1)
    xs, act, ys = (
        f.buffer("xs", hidden, rows=pairs),
        f.buffer("e_act", up.cols, rows=pairs),
        f.buffer("ys", hidden, rows=pairs),
    )
    bias = gate.e_score_correction_bias.float().contiguous() if gate.scoring == "sigmoid" else None
    config = route_config(gate)
    b.route(address(router.route_entry(dtype)), hidden, experts, k, ptr(f.norm_out), ptr(gate.weight),
            ptr(bias) if bias is not None else None, ptr(config), gate.routed_scaling_factor, ptr(weights), ptr(ids),
            ptr(order), ptr(counts), ptr(xs))  # fmt: skip
    up.emit(b, ptr(counts), ptr(xs), ptr(act))
    down.emit(b, ptr(counts), ptr(act), ptr(ys))
    shared = None
    if isinstance(moe.shared_experts, GatedMLP):
        shared = f.buffer("shared", hidden)
        why = gated_mlp(b, moe.shared_experts, cls, dtype, f.buffer, f.norm_out, shared)
        if why is not None:
            return why
    b.combine(address(combine.combine_entry(dtype)), k, hidden, ptr(order), ptr(ys), ptr(weights),
              ptr(shared) if shared is not None else None, ptr(f.x_buf))  # fmt: skip
    b.keep += [gate.weight, config] + ([bias] if bias is not None else [])
    return None
