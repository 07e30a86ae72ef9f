"""The same choice by measurement for the kernels beside the GEMMs: each of RMSNorm, RoPE, greedy argmax, random
sampling's inverse CDF and paged decode attention is timed against its torch code at the model's own sizes, and
kept only where faster. Decode attention has more than one kernel where the CPU has AVX512-BF16
(engine.kernels.decode_attn_dp) or AMX (engine.kernels.decode_attn_amx): the fastest of all the paths is kept.
MLA's latent decode has the same choice (for float32 math: engine.kernels.decode_attn_latent).

The kernels were each checked against torch when they were built (engine.kernels.cbuild.Once); here only speed
is in question. Timings go into the same on-disk table as the GEMMs' (engine.kernels.select.PlanCache).

Where decode programs may run (engine.models.decode_program), what a program calls is bound even where torch won
its timing: a program calls only C kernels, and the program against the layers is itself measured per batch class
on the engine's own steps."""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable

import torch

from engine.context import AttentionContext, PrefillMeta, reset_context, set_context
from engine.kernels import (
    amxmm,
    bf16mm,
    decode_attn,
    decode_attn_amx,
    decode_attn_dp,
    decode_attn_latent,
    decode_attn_latent_dp,
    i8amx,
    i8avx2,
    i8mm,
    prefill_attn_amx,
    program,
    w4amx,
    w4f32,
    w4mm,
    w4vnni,
    wbf16,
)
from engine.kernels.decode_attn import DECODE_ROWS, DecodeAttention
from engine.kernels.gemm import GemmPath, KernelPath, OneDNNPath, TorchPath
from engine.kernels.grouped import GroupedExperts, GroupedKernel, GroupedLinear, SplitGrouped
from engine.kernels.kernel_set import CpuKernels, QuantExpertsFactory
from engine.kernels.pointwise import PointwiseKernels, apply_rotary, apply_rotary_interleaved, moe_combine, rms_norm
from engine.kernels.prefill_attn_amx import PrefillAttention
from engine.kernels.program import ProgramBuilder
from engine.kernels.select import MIN_ROUNDS, CacheFlush, PlanCache, ShapeChoice, Timer
from engine.layers.activation import ActAndMul
from engine.layers.attention import PagedAttention
from engine.layers.mla import MLAttention, bmm_absorbed, latent_attention, per_head_absorbed
from engine.layers.moe import MoE
from engine.layers.norm import RMSNorm
from engine.quant.absorbed_key import GroupScaledKey, KeyPieces
from engine.quant.grouped import GroupedQuantExperts, GroupedQuantLinear, QuantKernel, shares_packing
from engine.quant.paths import quant_paths
from engine.quant.weights import Int4Weight
from engine.sampler import inverse_cdf

log = logging.getLogger(__name__)

ROWS = 32  # a decode batch: where these ops' per-call overhead matters
# quantized experts' plans at decode's rows (bf16 math; float32 math: w4f32, i8avx2)
DECODE_QUANT_PATHS = ("w4mm", "w4mm-vnni", "w4mm-amx", "i8mm", "i8mm-amx", "w4f32", "i8avx2")
CONTEXT = 256  # decode attention's tokens of context per sequence
BLOCK = 16
PREFILL_LENGTHS = (32, 128, 512, 2048)  # prompt chunks timed both ways for prefill in place
COLD_BYTES = 256 << 20  # the most the decode attention probe allocates to read its caches from memory
PROBE_EXPERTS = 16  # routed experts timed for the grouped call (engine.kernels.grouped.GroupedExperts)


def for_programs(won: bool, programs: bool, what: str) -> bool:
    """Whether to bind a kernel a decode program calls, that `won` (or lost) its timing against torch: where
    programs may run, either way, for the layers too, so that a step gives the same bits as a program or through
    the layers. WHY: one such timing lost otherwise keeps every decode step out of the programs (DeepSeek on a Zen
    3, 2026-12-07, while its MoE router ran 1.26x torch's time at 32 rows; torch's RoPE on tiny test shapes)."""
    if not won and programs:
        log.info("%s: torch was faster at %d rows; the kernel is bound anyway, as decode programs call it", what, ROWS)
    return won or programs


def faster(
    key: str, ours: Callable[[], object], theirs: Callable[[], object], timer: Timer | None, cache: PlanCache | None
) -> bool:
    """Whether `ours` beat `theirs` (the torch code) on this machine; cached under `key`. No timer: yes. A tie is
    not a win."""
    return timer is None or fastest(key, {"torch": theirs, "kernel": ours}, timer, cache) == "kernel"


def rms_norm_wins(
    k: PointwiseKernels, dim: int, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None
) -> bool:
    x, r = torch.randn(ROWS, dim).to(dtype), torch.randn(ROWS, dim).to(dtype)
    w = torch.ones(dim, dtype=dtype)
    return faster(f"op rms_norm {ROWS}x{dim} {dtype}", lambda: k.rms_norm(x, r, w, 1e-6),
                  lambda: rms_norm(x, r, w, 1e-6), timer, cache)  # fmt: skip


def rope_wins(
    k: PointwiseKernels, heads: int, head_dim: int, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None
) -> bool:
    x = torch.randn(ROWS, heads, head_dim).to(dtype)
    angles = torch.randn(ROWS, 1, head_dim)  # a true rotation: the in-place kernel keeps x's scale call after call
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return faster(f"op rope {ROWS}x{heads}x{head_dim} {dtype}", lambda: k.rotary(x, cos, sin),
                  lambda: apply_rotary(x, cos, sin), timer, cache)  # fmt: skip


def rope_pairs_wins(
    k: PointwiseKernels, heads: int, head_dim: int, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None
) -> bool:
    """MLA's q_pe: a strided slice of the query rows, as the layer hands it over."""
    q = torch.randn(ROWS, heads, 2 * head_dim).to(dtype)
    angles = torch.randn(ROWS, 1, head_dim // 2)
    angles = torch.cat((angles, angles), dim=-1)  # a true rotation: the in-place kernel keeps x's scale
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = q[..., head_dim:]
    return faster(f"op rope_pairs {ROWS}x{heads}x{head_dim} {dtype}", lambda: k.rotary_interleaved(x, cos, sin),
                  lambda: apply_rotary_interleaved(x, cos, sin), timer, cache)  # fmt: skip


def moe_combine_wins(
    k: PointwiseKernels, moe: MoE, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None
) -> bool:
    """A decode batch's combine: ROWS tokens, each routed to its top-k of `moe`'s experts at random."""
    top_k, dim, g = moe.gate.top_k, moe.gate.weight.shape[1], torch.Generator().manual_seed(0)
    ids = torch.rand(ROWS, moe.num_experts, generator=g).topk(top_k, dim=-1)[1]
    weights = torch.rand(ROWS, top_k, generator=g)
    order = ids.flatten().argsort(stable=True)
    ys, shared = torch.randn(ROWS * top_k, dim).to(dtype), torch.randn(ROWS, dim).to(dtype)
    key = f"op moe_combine {ROWS}x{top_k}x{dim} {dtype}"
    return faster(key, lambda: k.moe_combine(ys, order, weights, shared, ROWS),
                  lambda: moe_combine(ys, order, weights, shared, ROWS), timer, cache)  # fmt: skip


def moe_route_wins(
    k: PointwiseKernels, moe: MoE, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None
) -> bool:
    """A decode batch's routing and grouping, MoE.forward's two ways, over `moe`'s own router."""
    gate = moe.gate
    x = torch.randn(ROWS, gate.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
    if not k.routes(x, gate):
        return False

    def theirs() -> object:
        weights, ids = gate(x)
        order = ids.flatten().argsort(stable=True)
        return weights, torch.bincount(ids.flatten(), minlength=moe.num_experts).tolist(), x[order // gate.top_k]

    key = f"op moe_route {ROWS}x{gate.top_k}x{gate.weight.shape[0]}x{gate.weight.shape[1]} {gate.scoring}"
    key += f" g{gate.num_groups}/{gate.topk_groups} {dtype}"
    return faster(key, lambda: k.route(x, gate), theirs, timer, cache)


def argmax_wins(
    k: PointwiseKernels, vocab: int, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None
) -> bool:
    """In the LM head's dtype: greedy rows take their token from the head's output as it is (engine.sampler)."""
    logits = torch.randn(ROWS, vocab).to(dtype)
    return faster(f"op argmax {ROWS}x{vocab} {dtype}", lambda: k.argmax(logits), lambda: logits.argmax(dim=-1),
                  timer, cache)  # fmt: skip


def sample_wins(k: PointwiseKernels, vocab: int, timer: Timer | None, cache: PlanCache | None) -> bool:
    logits, u = torch.randn(ROWS, vocab), torch.rand(ROWS, dtype=torch.float64)
    return faster(f"op sample {ROWS}x{vocab}", lambda: k.sample(logits, u), lambda: inverse_cdf(logits, u),
                  timer, cache)  # fmt: skip


def fastest(
    key: str, candidates: dict[str, Callable[[], object]], timer: Timer | None, cache: PlanCache | None,
    flush: Callable[[], None] | None = None,
) -> str:  # fmt: skip
    """The fastest of `candidates` (their first when there is no timer: a forced configuration); cached by key.
    With `flush` (the GEMM selection's, where the model does not stay in the caches) each timed call comes right
    after one, as a decode step finds a layer's weights in memory; the flush itself is not timed."""
    names = list(candidates)
    if timer is None or len(names) == 1:  # nothing to choose between: no timing
        return names[0]
    if flush is not None:
        # NOTE: with the flush inside the timed call every candidate measured ~30 ms on an AMX VM that reports
        # 480 MB of L3 (a flush writes 1.5x that) against ~1 ms of its own, and the choice was noise; the key
        # names the change, so choices cached that way are timed again
        key += " cold, flush untimed"
    cached = cache.get(key) if cache is not None else None
    if cached is not None and cached.per_class and cached.per_class[0] in candidates:
        return cached.per_class[0]
    for fn in candidates.values():
        fn()  # warm-up

    def rounds(best: dict[str, float]) -> dict[str, float]:
        for _ in range(MIN_ROUNDS * 2):
            for name, fn in candidates.items():
                if flush is not None:
                    flush()
                best[name] = min(best[name], timer(fn))
        return best

    best = rounds(dict.fromkeys(names, math.inf))
    # NOTE: other work on our cores inflates whichever candidate it lands on (a 2-thread kernel most: it waits
    # whenever one thread is preempted), so a contended set of rounds is timed once more; each candidate keeps its
    # best of both, and put() caches the answer only if the second set was quiet (engine.kernels.busy)
    if cache is not None and cache.busy():
        best = rounds(best)
    won = min(names, key=lambda n: best[n])  # a tie keeps the earlier candidate
    if cache is not None:
        cache.put(key, ShapeChoice([won], {k: [v * 1e6] for k, v in best.items()}))
    return won


def grouped_kernels(dtype: torch.dtype, prefer: str = "auto") -> dict[str, GroupedKernel]:
    """Every GEMM kernel with a grouped entry point for `dtype` math built for this CPU, by name; `prefer` (a
    forced gemm_path) first, as without a timer the first that fits is used."""
    # NOTE: bf16mm's build without software prefetch too: DeepSeek-V2-tiny's routed experts at 8 rows each, 7
    # layers streamed from memory on a 2-core Zen 4, 1,349 against 1,699 us a layer with it
    builders = (("amxmm", amxmm.AMXMM.dtype, amxmm.kernel), ("bf16mm", bf16mm.BF16MM.dtype, bf16mm.kernel),
                ("bf16mm-noprefetch", bf16mm.BF16MM.dtype, bf16mm.kernel_without_prefetch),
                ("bf16fma", bf16mm.BF16MM.dtype, bf16mm.kernel_fma32),
                ("wbf16", wbf16.WBF16.dtype, wbf16.kernel),
                ("wbf16-noprefetch", wbf16.WBF16.dtype, wbf16.kernel_without_prefetch))  # fmt: skip
    found = ((name, build()) for name, math, build in builders if math == dtype)  # builds only what can run
    kernels = {name: k for name, k in found if k is not None}
    return dict(sorted(kernels.items(), key=lambda item: item[0] != prefer))


def choose_grouped_experts(
    kernels: dict[str, GroupedKernel], moe: MoE, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None,
    flush: Callable[[], None] | None = None,
) -> GroupedKernel | None:  # fmt: skip
    """The grouped kernel (engine.kernels.grouped.GroupedExperts) that beat the others and one GEMM per expert
    and projection (oneDNN's; under float32 math also the bf16-weight kernel's) on random bf16 weights of `moe`'s
    expert shapes, ROWS tokens routed at random to its top-k; None where a GEMM per expert won or none fits.
    `flush`: as fastest's (in memory, a kernel's prefetch decides its speed)."""
    experts = moe.local_experts()
    quantized = any(hasattr(lin, "gemm_weight") for e in experts for lin in (e.gate_up_proj, e.down_proj))
    if not experts or quantized:  # MoE.bind_kernels would not take it either
        return None
    (n, h), i = experts[0].gate_up_proj.weight.shape, experts[0].down_proj.weight.shape[1]
    # NOTE: at most PROBE_EXPERTS of them, with as many rows each as a decode batch gives the model's experts:
    # random copies of all of DeepSeek-V3's 256 would take gigabytes for a timing
    e = min(len(experts), PROBE_EXPERTS)
    top_k = min(getattr(moe.gate, "top_k", 1), e)
    tokens = max(1, ROWS * e // len(experts))
    g = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(n, h, generator=g).bfloat16() for _ in range(e)]
    down = [torch.randn(h, i, generator=g).bfloat16() for _ in range(e)]
    fits = {name: k for name, k in kernels.items() if k.dtype == dtype and GroupedExperts.accepts(k, gate_up, down)}
    if not fits:
        return None
    counts, x = _routed(tokens, e, top_k, h, dtype, g)
    candidates: dict[str, Callable[[], object]] = {}
    for name, k in fits.items():
        grouped = GroupedExperts(k, gate_up, down)
        candidates[name] = lambda grouped=grouped: grouped(x, counts)  # type: ignore[misc]
    act = ActAndMul("silu")
    for base in _per_expert_paths(dtype):  # what the experts' GEMM plans would choose among
        ups = [base.prepare(w, None, None) for w in gate_up]
        downs = [base.prepare(w, None, None) for w in down]
        each = lambda ups=ups, downs=downs: _each_expert(x, counts, ups, downs, act)  # noqa: E731
        candidates[f"each {base.name}"] = each  # type: ignore[misc]
    others = "+".join(name for name in candidates if name not in fits)
    key = f"op moe_experts {len(experts)}x{n}x{h} top{top_k} {dtype} {'+'.join(fits)} vs {others}"
    return fits.get(fastest(key, candidates, timer, cache, flush))


def choose_quant_experts(
    moe: MoE, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None,
    flush: Callable[[], None] | None = None,
) -> QuantExpertsFactory | None:  # fmt: skip
    """The grouped call over quantized experts (engine.quant.grouped.GroupedQuantExperts: w4mm's for W4A16, i8mm's
    for W8A8, and on AMX CPUs also w4amx's or i8amx's; each kernel's builds with and without software prefetch; in
    float32 math w4f32's or i8avx2's), where it beat a call per expert and projection on `moe`'s own first experts,
    ROWS tokens routed at random to its top-k; None where that lost, the math is neither bf16 nor float32, the
    kernel is missing here or the experts do not fit it. The grouped kernels are timed again at one token, whose
    fastest the grouped call runs for a single token's rows. What it returns makes the grouped call for a layer's
    experts (None where they do not fit). `flush`: as fastest's."""
    experts = moe.local_experts()
    quantized = all(hasattr(e.gate_up_proj, "gemm_weight") for e in experts)
    if dtype not in (torch.bfloat16, torch.float32) or not experts or not quantized:
        return None
    e = min(len(experts), PROBE_EXPERTS)
    gate_up = [x.gate_up_proj.gemm_weight() for x in experts[:e]]  # type: ignore[operator]
    down = [x.down_proj.gemm_weight() for x in experts[:e]]  # type: ignore[operator]
    builds = _quant_grouped_builds(gate_up[0], dtype)
    kernels = {c: k for c, k in builds.items() if GroupedQuantExperts.accepts(k, gate_up, down)}
    if not kernels:
        return None
    top_k = min(getattr(moe.gate, "top_k", 1), e)
    tokens = max(1, ROWS * e // len(experts))
    counts, x = _routed(tokens, e, top_k, down[0].shape[0], dtype, torch.Generator().manual_seed(0))
    candidates: dict[str, Callable[[], object]] = {}
    groupeds = {c: GroupedQuantExperts(built, gate_up, down) for c, built in kernels.items()}
    for c, grouped in groupeds.items():
        candidates[c] = lambda grouped=grouped, x=x, counts=counts: grouped(x, counts)  # type: ignore[misc]
    # against a call per expert through each kernel the experts' plans take at decode's rows (on AMX CPUs also
    # the AMX one over the same packed copy, which may beat the grouped VNNI / AVX512-BF16 loops there)
    fits = [p for p in quant_paths(dtype) if p.name in DECODE_QUANT_PATHS]
    for path in (p for p in fits if p.accepts(gate_up[0], None) and p.accepts(down[0], None)):
        ups = [path.prepare(w, None, None) for w in gate_up]
        downs = [path.prepare(w, None, None) for w in down]
        each = lambda ups=ups, downs=downs: _each_expert(x, counts, ups, downs, ActAndMul("silu"))  # noqa: E731
        candidates[f"each {path.name}"] = each  # type: ignore[misc]
    n, k = gate_up[0].shape
    others = "+".join(c for c in candidates if c not in kernels)
    ours = "+".join(c.removeprefix("grouped ") for c in kernels)
    key = f"op moe_quant {len(experts)}x{n}x{k} {_scheme(gate_up[0])} top{top_k} {dtype} grouped {ours} vs {others}"
    chosen = kernels.get(fastest(key, candidates, timer, cache, flush))
    if chosen is None:
        return None
    # NOTE: and the grouped kernels again at one token (its top_k rows: batch-1 decode), which may take another:
    # on a 2-core Zen 5 w4vnni's grouped call took 39 µs a DeepSeek-V2-tiny layer there against w4mm's 44, and
    # 641 against 408 at 32 tokens
    counts1, x1 = _routed(1, e, top_k, down[0].shape[0], dtype, torch.Generator().manual_seed(1))
    # only over the chosen kernel's packed copies, which the one-token call shares (float32 math has two layouts:
    # i8avx2's and, on AVX512-VNNI CPUs, i8mm's)
    same = {c: g for c, g in groupeds.items() if shares_packing(kernels[c], chosen)}
    ones = {c: lambda grouped=g, x=x1, counts=counts1: grouped(x, counts) for c, g in same.items()}  # type: ignore[misc]
    one = kernels[fastest(f"{key} one token", ones, timer, cache, flush)]

    per_token = getattr(moe.gate, "top_k", 1)  # the model's (top_k above is capped at the probe's experts)

    def make(up: list[object], dn: list[object]) -> GroupedQuantExperts | None:
        if not GroupedQuantExperts.accepts(chosen, up, dn):
            return None
        fits = GroupedQuantExperts.accepts(one, up, dn)
        return GroupedQuantExperts(chosen, up, dn, one if fits else None, per_token)  # type: ignore[arg-type]

    return make


def _quant_grouped_builds(weight: object, dtype: torch.dtype) -> dict[str, QuantKernel]:
    """The grouped quantized kernels built for this CPU for `weight`'s scheme and the math's `dtype`, by name
    ("grouped w4mm", ...): in bf16 math w4mm's (or i8mm's) builds with and without software prefetch (and w4mm's
    wide tiles), on AVX512-VNNI CPUs w4vnni's and on AMX CPUs w4amx's (or i8amx's), all over the same packed copy;
    in float32 math w4f32's (on AVX-512 CPUs its 16-wide and 8-wide tiles; or i8avx2's, with and without its
    prefetch, and on AVX512-VNNI CPUs i8mm's over float32 rows)."""
    if dtype == torch.float32:
        if isinstance(weight, Int4Weight):
            f32 = (("grouped w4f32", w4f32.kernel()), ("grouped w4f32-ymm", w4f32.ymm_kernel()))
            return {name: k.for_scales(weight.scale) for name, k in f32 if k is not None}  # type: ignore[misc]
        plain = (("grouped i8avx2", i8avx2.kernel()), ("grouped i8avx2-noprefetch", i8avx2.kernel_without_prefetch()))
        # and i8mm's over float32 rows on AVX512-VNNI CPUs (its packed copies, its grouped entry's float32 form)
        vnni = (("grouped i8mm", i8mm.kernel()), ("grouped i8mm-noprefetch", i8mm.kernel_without_prefetch()))
        return {name: k for name, k in plain if k is not None} | {
            name: f for name, k in vnni if (f := i8mm.float32_rows(k)) is not None
        }
    modules = (w4mm, w4vnni, w4amx) if isinstance(weight, Int4Weight) else (i8mm, i8amx)
    builds: dict[str, QuantKernel | None] = {}
    for module in modules:
        name = module.__name__.rsplit(".", 1)[1]
        builds |= {f"grouped {name}": module.kernel(), f"grouped {name}-noprefetch": module.kernel_without_prefetch()}
    if isinstance(weight, Int4Weight):
        builds["grouped w4mm-wide"] = w4mm.wide_kernel()  # w4mm's wide tiles, for MoE layers' larger batches
        # each build for the weight's scales: the compact layout's where they are bf16 values (the same bits)
        builds = {name: k.for_scales(weight.scale) if k is not None else None for name, k in builds.items()}  # type: ignore[union-attr,misc]
    return {name: k for name, k in builds.items() if k is not None}


def choose_absorbed_quant(
    kernel: GroupedKernel, mla: MLAttention, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None,
    flush: Callable[[], None] | None = None,
) -> QuantKernel | None:  # fmt: skip
    """The quantized grouped kernel whose call ran MLA decode's W_UV product (o W_UV per head) over the
    checkpoint's own quantized rows (MLAttention.absorbed_quantized) faster than `kernel`'s bf16 call over the
    dequantized weight at one row, from memory as decode streams it (a quarter or half of the bytes); None where
    the bf16 call won, kv_b_proj is not quantized, the math is not bf16 or no kernel fits. `flush`: as fastest's.
    WHY one row only: there W_UV is ~8% of a quantized DeepSeek-V2-tiny token's bytes; at 32 rows the two calls
    took within 5% of each other on a Zen 4 (~0.1 ms a layer, ~1% of such a step), and timed as the sum of both
    the 32-row call decided it (W8A8 215 against 207 µs: the bf16 call kept)."""
    uv = mla.absorbed_quantized()
    if uv is None or dtype != torch.bfloat16:
        return None
    kernels = {c: k for c, k in _quant_grouped_builds(uv[0], dtype).items() if GroupedQuantLinear.accepts(k, uv)}
    if not kernels:
        return None
    h, lat = mla.num_heads, mla.kv_lora_rank
    one, heads = torch.randn(h, lat, generator=torch.Generator().manual_seed(0)).to(dtype), [1] * h

    def call(grouped: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> Callable[[], object]:
        return lambda: grouped(one, heads)

    candidates = {c: call(GroupedQuantLinear(k, uv)) for c, k in kernels.items()}
    candidates["bf16"] = call(GroupedLinear(kernel, mla.absorbed_weights()[1]))
    ours = "+".join(c.removeprefix("grouped ") for c in kernels)
    group = getattr(uv[0], "group_size", 0)
    key = f"op absorbed_uv 1 h{h} {tuple(uv[0].shape)} {_scheme(uv[0])} g{group} {dtype} grouped {ours} vs bf16"
    return kernels.get(fastest(key, candidates, timer, cache, flush))


def _fits_float32(kernel: QuantKernel, pieces: KeyPieces | None, rows: list[object] | None) -> bool:
    """Whether `kernel` takes both of a layer's products over its int4 rows: W_UK's key pieces, W_UV's rows."""
    return (
        pieces is not None and rows is not None
        and GroupScaledKey.accepts(kernel, pieces) and GroupedQuantLinear.accepts(kernel, rows)  # type: ignore[arg-type]
    )  # fmt: skip


def choose_absorbed_float32(
    mla: MLAttention, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None,
    flush: Callable[[], None] | None = None,
) -> QuantKernel | None:  # fmt: skip
    """In float32 math, the quantized grouped kernel whose two calls ran MLA decode's per-head products over
    kv_b_proj's own int4 rows (W_UK over its key rows, the query scaled per latent group in float32; W_UV over its
    value rows) at one row faster than torch.bmm over the dequantized float32 weight (what the layer runs
    otherwise), from memory, timed as a decode program runs them; None where bmm won, the math is not float32,
    kv_b_proj is not symmetric W4A16, no program runs here or no kernel fits. `flush`: as fastest's.
    WHY: in float32 math kv_b_proj's dequantized values are no bf16 values, so the bf16-weight grouped calls
    (wbf16's) cannot carry them (absorbed_gemm); through bmm the layer kept every decode step out of programs,
    reading 8x the int4 rows' bytes: DeepSeek-V2-tiny W4A16 decoded at 0.74-0.88x the float model's batch-1 time
    (Zen 5 forced to float32 math, 2026-12-07)."""
    pieces, rows = mla.absorbed_key_quantized(), mla.absorbed_quantized()
    if pieces is None or rows is None or dtype != torch.float32 or program.library() is None:
        return None
    builds = _quant_grouped_builds(rows[0], dtype)  # for the checkpoint's scales (the key pieces' are ones)
    kernels = {c: k for c, k in builds.items() if _fits_float32(k, pieces, rows)}
    if not kernels or timer is None:  # untimed: the first that fits (fastest's forced configuration)
        return next(iter(kernels.values()), None)
    h, n, lat, v = mla.num_heads, mla.nope, mla.kv_lora_rank, mla.v_dim
    g = torch.Generator().manual_seed(0)
    q, o = torch.randn(h, n, generator=g), torch.randn(h, lat, generator=g)
    y_k, y_v, counts = torch.empty(h, lat), torch.empty(h, v), torch.empty(h, dtype=torch.int64)
    ptr = torch.Tensor.data_ptr

    def pair(k: QuantKernel) -> Callable[[ProgramBuilder], object]:
        def build(b: ProgramBuilder) -> object:
            key = GroupScaledKey(k, pieces, None)  # type: ignore[arg-type]
            key.emit(b, ptr(counts), ptr(q), ptr(y_k), 1)
            b.fill_rows(h, ptr(counts))
            GroupedQuantLinear(k, rows).emit(b, ptr(counts), ptr(o), ptr(y_v))  # type: ignore[arg-type]
            return key

        return build

    w_uk, w_uv = bmm_absorbed(mla.kv_b_proj.weight.detach().view(h, n + v, lat), n)  # the layer's own bmm operands

    def bmm() -> object:
        torch.bmm(q.view(h, 1, n), w_uk)
        return torch.bmm(o.view(h, 1, lat), w_uv)

    candidates: dict[str, Callable[[], object]] = {c: _ProgramCall(pair(k), y_v) for c, k in kernels.items()}
    candidates["torch"] = bmm
    ours = "+".join(c.removeprefix("grouped ") for c in kernels)
    group = getattr(rows[0], "group_size", 0)
    key = f"op absorbed_f32 1 h{h} n{n} l{lat} v{v} w4a16-g{group} {dtype} program {ours} vs torch"
    return kernels.get(fastest(key, candidates, timer, cache, flush))


def split_wins(
    kernel: GroupedKernel, mla: MLAttention, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None,
    flush: Callable[[], None] | None = None,
) -> bool:  # fmt: skip
    """In float32 math, where kv_b_proj's values are no bf16 values: whether MLA's two products through
    grouped.SplitGrouped (`kernel`'s grouped call over each weight's two exact bf16 halves, the rows fed twice) ran
    one row faster than torch.bmm over the float32 weight, from memory, the split timed as a decode program runs it.
    False where the math is bf16, the values are bf16 values (plain grouped calls take them), no exact halves exist
    or no program runs here; untimed (a forced configuration), True where the halves exist."""
    if dtype != torch.float32 or kernel.dtype != dtype or program.library() is None:
        return False
    weights = mla.absorbed_weights()
    if all(_bf16_exact(w) for w in weights):
        return False
    uk, uv = (SplitGrouped.make(kernel, w) for w in weights)
    if uk is None or uv is None:
        return False
    if timer is None:
        return True
    h, n, lat, v = mla.num_heads, mla.nope, mla.kv_lora_rank, mla.v_dim
    g = torch.Generator().manual_seed(0)
    q, o = torch.randn(h, n, generator=g), torch.randn(h, lat, generator=g)
    y_k, y_v, counts = torch.empty(h, lat), torch.empty(h, v), torch.empty(h, dtype=torch.int64)
    ptr = torch.Tensor.data_ptr

    def build(b: ProgramBuilder) -> object:
        b.fill_rows(h, ptr(counts))
        uk.emit(b, ptr(counts), ptr(q), ptr(y_k), h, 1)
        uv.emit(b, ptr(counts), ptr(o), ptr(y_v), h, 1)
        return uk

    w_uk, w_uv = bmm_absorbed(mla.kv_b_proj.weight.detach().view(h, n + v, lat), n)  # the layer's own bmm operands

    def bmm() -> object:
        torch.bmm(q.view(h, 1, n), w_uk)
        return torch.bmm(o.view(h, 1, lat), w_uv)

    candidates: dict[str, Callable[[], object]] = {"split": _ProgramCall(build, y_v), "torch": bmm}
    key = f"op absorbed_split 1 h{h} n{n} l{lat} v{v} {dtype} program vs torch"
    return fastest(key, candidates, timer, cache, flush) == "split"


class _ProgramCall:
    """A candidate run as a decode program runs it: its ops in one C call, no Python between. Built at its first
    call, so a choice the plan cache already holds builds nothing; `what`: the object `build` emitted the ops of."""

    def __init__(self, build: Callable[[ProgramBuilder], object], output: torch.Tensor) -> None:
        self.build, self.output = build, output
        self.what: object = None
        self.program: program.Program | None = None

    def __call__(self) -> object:
        if self.program is None:
            lib = program.library()
            assert lib is not None
            b = ProgramBuilder()
            self.what = self.build(b)
            self.program = b.build(lib, self.output)
        return self.program(program.timing_step(1))


def choose_absorbed_key(
    kernel: GroupedKernel, mla: MLAttention, dtype: torch.dtype, timer: Timer | None, cache: PlanCache | None,
    flush: Callable[[], None] | None = None,
) -> QuantKernel | None:  # fmt: skip
    """The quantized grouped kernel whose W_UK call over the checkpoint's int4 key rows (the query scaled per latent
    group: engine.quant.absorbed_key) ran MLA decode's q_nope W_UK faster than `kernel`'s bf16 call at one row
    (the only rows it takes: GroupScaledKey), from memory, both timed as a decode program runs them (the scaling
    is a C op there; from Python its torch ops alone took longer than either call); None where the bf16 call won,
    kv_b_proj is not symmetric W4A16, the math is not bf16, no program runs here or no kernel fits. `flush`: as
    fastest's."""
    pieces = mla.absorbed_key_quantized()
    if pieces is None or dtype != torch.bfloat16 or program.library() is None:
        return None
    builds = _quant_grouped_builds(pieces.weights[0], dtype)
    kernels = {c: k for c, k in builds.items() if GroupScaledKey.accepts(k, pieces)}
    if not kernels or timer is None:  # untimed: the first that fits (fastest's forced configuration)
        return next(iter(kernels.values()), None)
    h, n, lat = mla.num_heads, mla.nope, mla.kv_lora_rank
    x = torch.randn(h, n, generator=torch.Generator().manual_seed(0)).to(dtype)
    y, counts = torch.empty(h, lat, dtype=dtype), torch.empty(h, dtype=torch.int64)
    ptr = torch.Tensor.data_ptr

    bf16 = functools.cache(lambda: GroupedLinear(kernel, mla.absorbed_weights()[0]))

    def int4(k: QuantKernel) -> Callable[[ProgramBuilder], object]:
        def build(b: ProgramBuilder) -> object:
            key = GroupScaledKey(k, pieces, bf16())  # type: ignore[arg-type]
            key.emit(b, ptr(counts), ptr(x), ptr(y), 1)
            return key

        return build

    def build_bf16(b: ProgramBuilder) -> object:
        b.fill_rows(h, ptr(counts))
        bf16().emit(b, ptr(counts), ptr(x), ptr(y))
        return bf16()

    candidates: dict[str, Callable[[], object]] = {c: _ProgramCall(int4(k), y) for c, k in kernels.items()}
    candidates["bf16"] = _ProgramCall(build_bf16, y)
    ours = "+".join(c.removeprefix("grouped ") for c in kernels)
    g = pieces.weights[0].shape[0]
    key = f"op absorbed_uk 1 h{h} n{n} l{lat} w4a16-g{g} {dtype} program {ours} vs bf16"
    return kernels.get(fastest(key, candidates, timer, cache, flush))


def _routed(
    tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype, g: torch.Generator
) -> tuple[list[int], torch.Tensor]:
    """`tokens` routed at random to `top_k` of `experts` each: the rows per expert, and random [pairs, hidden]
    inputs in expert-major order, as MoE.forward hands them to the experts."""
    picks = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1)[1].flatten()
    counts = torch.bincount(picks, minlength=experts).tolist()
    return counts, torch.randn(tokens * top_k, hidden, generator=g).to(dtype)


def _scheme(w: object) -> str:
    return f"w4a16-g{w.group_size}" if isinstance(w, Int4Weight) else "w8a8"


def _per_expert_paths(dtype: torch.dtype) -> list[GemmPath]:
    """oneDNN (F.linear where it is missing: what the GEMM plans never fall below) and, under float32 math, the
    bf16-weight kernel a bf16 expert's plan may take (engine.kernels.wbf16)."""
    onednn = OneDNNPath(dtype, ROWS)
    paths: list[GemmPath] = [onednn if onednn.available else TorchPath(dtype)]
    if dtype == torch.float32 and (k := wbf16.kernel()) is not None:
        paths.append(KernelPath("wbf16", k, dtype))
    return paths


def latent_attention_kernels(attn: dict[str, DecodeAttention], dtype: torch.dtype) -> dict[str, DecodeAttention]:
    """The kernels that may run MLA decode over the paged latents in place for `dtype` math: bf16, the AMX one
    (among `attn`, built for the attention layers) and, on AVX512-BF16, the heads-in-a-vector kernel
    (engine.kernels.decode_attn_latent_dp) and the dot-product kernel's latent build; float32, the float32 latent
    kernel (engine.kernels.decode_attn_latent)."""
    if dtype == torch.float32:
        found: tuple[tuple[str, DecodeAttention | None], ...] = (("latent-f32", decode_attn_latent.kernel()),)
    else:
        found = (
            ("amx", attn.get("amx")),
            ("latent-dp", decode_attn_latent_dp.kernel()),
            *decode_attn_dp.latent_kernels().items(),
        )
    return {name: k for name, k in found if k is not None}


def choose_latent_attention(
    kernels: dict[str, DecodeAttention], mla: MLAttention, dtype: torch.dtype, timer: Timer | None,
    cache: PlanCache | None,
) -> tuple[DecodeAttention | None, tuple[bool, ...]]:  # fmt: skip
    """The fastest of the kernels that read the paged latents in place, for a decode step of ROWS sequences of
    CONTEXT tokens at `mla`'s sizes, and per decode batch class (DECODE_ROWS) whether it beat gather + SDPA
    (engine.layers.mla.latent_attention) there; (None, ()) where it won at none. Without a timer, the first that
    takes the shape, at every class."""
    h, lat, width = mla.num_heads, mla.kv_lora_rank, mla.kv_lora_rank + mla.rope
    fits = {name: k for name, k in kernels.items() if k.takes_latent(h, width, dtype, BLOCK)}
    if not fits:
        return None, ()

    def probe(rows: int) -> Probe:
        # NOTE: as attention_probe: blocks scattered in the pool, and successive calls read different caches,
        # together as much as evicting the caches takes (a decode step reads every layer's latents from memory).
        # It read one hot cache in order before: DeepSeek-V2-tiny's heads at 32 rows on a 2-core Zen 4 measure
        # 1.28 ms now (dp-t, still the fastest there), 1.03 then; 1.1 ms a layer in the model.
        per_seq = CONTEXT // BLOCK
        g = torch.Generator().manual_seed(0)
        cache_rows = torch.randn(rows * per_seq + 1, BLOCK, width, generator=g).to(dtype)
        copies = max(1, min(CacheFlush().nbytes, COLD_BYTES) // (cache_rows.numel() * cache_rows.element_size()))
        turn = itertools.cycle([cache_rows] + [cache_rows.clone() for _ in range(copies - 1)])
        q = torch.randn(rows, h, width, generator=g).to(dtype)
        tables = torch.randperm(rows * per_seq, generator=g).view(rows, per_seq)
        lens, mask = torch.full((rows,), CONTEXT), torch.zeros(rows, 1, 1, CONTEXT, dtype=dtype)
        scratch, shape = torch.empty(0, dtype=dtype), (rows * per_seq, BLOCK, width)

        def in_place(kernel: DecodeAttention) -> object:
            rows4 = next(turn).unsqueeze(2)  # [blocks, block_size, 1, width]: K and V at once
            return kernel(q, rows4, rows4, tables, lens, mla.scale)

        def gathered() -> object:
            gathered = torch.index_select(next(turn), 0, tables.flatten(), out=scratch.resize_(shape))
            return latent_attention(q, gathered, mask, mla.scale, lat)

        def run(kernel: DecodeAttention | None) -> Callable[[], object]:
            return gathered if kernel is None else lambda: in_place(kernel)

        return run

    key = f"op latent_attention {{}}x{CONTEXT} h{h} w{width} {dtype} {{}}"
    return _per_class(fits, probe, key, timer, cache)


def _per_class(
    fits: dict[str, DecodeAttention], probe: Callable[[int], Probe], key: str, timer: Timer | None,
    cache: PlanCache | None,
) -> tuple[DecodeAttention | None, tuple[bool, ...]]:  # fmt: skip
    """The fastest of `fits` at ROWS rows, then per DECODE_ROWS class whether it beat torch (probe(rows)(None));
    `key` is formatted with the rows and the candidates. (None, ()) where it won at no class."""
    if timer is None:
        return next(iter(fits.values())), (True,) * len(DECODE_ROWS)
    name = next(iter(fits))
    if len(fits) > 1:
        run = probe(ROWS)
        name = fastest(key.format(ROWS, "+".join(fits)), {n: run(k) for n, k in fits.items()}, timer, cache)
    kernel, at = fits[name], []
    for rows in DECODE_ROWS:
        run = probe(rows)
        won = fastest(key.format(rows, f"{name} vs torch"), {"torch": run(None), name: run(kernel)}, timer, cache)
        at.append(won == name)
    return (kernel, tuple(at)) if any(at) else (None, ())


# a layer's W_UK and W_UV calls (MLAttention.absorbed)
Absorbed = tuple[GroupedLinear | GroupScaledKey | SplitGrouped, GroupedLinear | GroupedQuantLinear | SplitGrouped]


def absorbed_gemm(
    kernel: GroupedKernel | None,
    quantized: QuantKernel | None = None,
    key: QuantKernel | None = None,
    float32: QuantKernel | None = None,
    split: bool = False,
) -> Callable[[MLAttention], Absorbed | None]:
    """For a layer: its W_UK and W_UV per head as two grouped calls, None where the shapes do not fit; W_UV over
    the checkpoint's quantized rows through `quantized`, and W_UK over its int4 key rows through `key`, where
    given and they fit. `float32` (float32 math, choose_absorbed_float32): both over the checkpoint's int4 rows
    through it, at every row count, where they fit (else `kernel`'s calls as above). `split` (split_wins): in
    float32 math over values bf16 cannot hold, both through `kernel` over each weight's two exact bf16 halves."""

    def make(mla: MLAttention) -> Absorbed | None:
        if float32 is not None:
            pieces, rows = mla.absorbed_key_quantized(), mla.absorbed_quantized()
            if _fits_float32(float32, pieces, rows):
                return GroupScaledKey(float32, pieces, None), GroupedQuantLinear(float32, rows)  # type: ignore[arg-type]
        if kernel is None:
            return None
        weights = mla.absorbed_weights()
        uk, uv = (_bf16_exact(w) for w in weights)
        if kernel.dtype == torch.float32 and (uk is None or uv is None):
            # float32 math over values bf16 cannot hold (a quantized kv_b_proj's): each weight as two exact halves
            if not split:
                return None
            uk_split, uv_split = (SplitGrouped.make(kernel, w) for w in weights)
            return (uk_split, uv_split) if uk_split is not None and uv_split is not None else None
        if uk is None or uv is None or not (GroupedLinear.accepts(kernel, uk) and GroupedLinear.accepts(kernel, uv)):
            return None
        q = mla.absorbed_quantized() if quantized is not None else None
        v: GroupedLinear | GroupedQuantLinear = GroupedLinear(kernel, uv)
        if q is not None and GroupedQuantLinear.accepts(quantized, q):  # type: ignore[arg-type]
            v = GroupedQuantLinear(quantized, q)  # type: ignore[arg-type]
        pieces = mla.absorbed_key_quantized() if key is not None else None
        if pieces is not None and GroupScaledKey.accepts(key, pieces):  # type: ignore[arg-type]
            return GroupScaledKey(key, pieces, GroupedLinear(kernel, uk)), v  # type: ignore[arg-type]
        return GroupedLinear(kernel, uk), v

    return make


def _bf16_exact(weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The weights in bf16 where each holds only bf16 values, else None. WHY: in float32 math kv_b_proj stays
    float32 (its decode reads the plain weight), yet a bf16 checkpoint's values convert back exactly, so the grouped
    kernels over bf16 weights (wbf16's, float32 rows) compute the same products as bmm over the float32 copy."""
    if all(w.dtype == torch.bfloat16 for w in weights):
        return weights
    bf16 = [w.to(torch.bfloat16) for w in weights]
    return bf16 if all(torch.equal(b.to(w.dtype), w) for b, w in zip(bf16, weights, strict=True)) else None


def choose_absorbed_gemm(
    kernels: dict[str, GroupedKernel], mla: MLAttention, dtype: torch.dtype, timer: Timer | None,
    cache: PlanCache | None, flush: Callable[[], None] | None = None,
) -> GroupedKernel | None:  # fmt: skip
    """The grouped kernel whose two calls (one per product) ran MLA decode's per-head products (q_nope W_UK,
    o W_UV) for ROWS rows faster than the other kernels and than torch.bmm over the weights laid out for it (what
    MLAttention runs without a kernel); None where bmm won or no kernel fits. In float32 math the kernels take
    bf16 weights (a bf16 checkpoint's, exactly: absorbed_gemm) and float32 rows. `flush`: as fastest's."""
    h, n, v, lat = mla.num_heads, mla.nope, mla.v_dim, mla.kv_lora_rank
    g = torch.Generator().manual_seed(0)
    w3 = torch.randn(h, n + v, lat, generator=g).to(torch.bfloat16)
    uk, uv = per_head_absorbed(w3, n)
    fits = _absorbed_fits(kernels, mla, dtype)
    if not fits:
        return None
    bmm_uk, bmm_uv = bmm_absorbed(w3.to(dtype), n)
    q, o, heads = (
        torch.randn(ROWS, h, n, generator=g).to(dtype),
        torch.randn(ROWS, h, lat, generator=g).to(dtype),
        [ROWS] * h,
    )
    qh, oh = q.transpose(0, 1).reshape(h * ROWS, n), o.transpose(0, 1).reshape(h * ROWS, lat)

    def grouped(kernel: GroupedKernel) -> Callable[[], object]:
        grouped_uk, grouped_uv = GroupedLinear(kernel, uk), GroupedLinear(kernel, uv)
        return lambda: (grouped_uk(qh, heads), grouped_uv(oh, heads))

    def bmm() -> object:
        torch.bmm(q.transpose(0, 1), bmm_uk)
        return torch.bmm(o.transpose(0, 1), bmm_uv)

    candidates = {name: grouped(k) for name, k in fits.items()} | {"torch": bmm}
    key = f"op absorbed_gemm {ROWS} h{h} n{n} v{v} l{lat} {dtype} {'+'.join(fits)}"
    return fits.get(fastest(key, candidates, timer, cache, flush))


def _absorbed_fits(
    kernels: dict[str, GroupedKernel], mla: MLAttention, dtype: torch.dtype
) -> dict[str, GroupedKernel]:  # fmt: skip
    """The grouped kernels whose calls take MLA's per-head W_UK and W_UV (bf16 weights) with rows of `dtype`."""
    uk, uv = per_head_absorbed(torch.zeros(mla.num_heads, mla.nope + mla.v_dim, mla.kv_lora_rank, dtype=torch.bfloat16),
                               mla.nope)  # fmt: skip
    return {
        name: k
        for name, k in kernels.items()
        if k.dtype == dtype
        and dtype in (torch.bfloat16, torch.float32)
        and GroupedLinear.accepts(k, uk)
        and GroupedLinear.accepts(k, uv)
    }


def _each_expert(
    x: torch.Tensor, counts: list[int], ups: list[Callable[[torch.Tensor], torch.Tensor]],
    downs: list[Callable[[torch.Tensor], torch.Tensor]], act: ActAndMul,
) -> torch.Tensor:  # fmt: skip
    """What MoE.forward runs without the grouped kernel: a GEMM per expert and projection."""
    y, start = torch.empty_like(x), 0
    for n, up, down in zip(counts, ups, downs, strict=True):
        if n:
            y[start : start + n] = down(act(up(x[start : start + n])))
            start += n
    return y


Probe = Callable[[DecodeAttention | None], Callable[[], object]]


def _probe(
    attention: PagedAttention, dtype: torch.dtype, blocks: int, rows: int,
    context: Callable[[DecodeAttention | None], AttentionContext], copies: int = 1,
    prefill: tuple[PrefillAttention | None, int] = (None, 0),
) -> Probe:  # fmt: skip
    """A copy of `attention`'s shape over random caches of `blocks` blocks (+ a spare) and `rows` query rows:
    given a kernel (None: the torch path), the call that runs one forward under `context(kernel)`. With `copies`
    > 1, each call reads the next of that many caches, so that they come from memory as a model's layers' do.
    `prefill`: the whole prompts' kernel and the longest prompt it takes, as the layer would have them."""
    h, kv, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
    probe = PagedAttention(h, kv, d, d**-0.5, (torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)))
    probe.prefill_kernel, probe.prefill_up_to = prefill
    k_cache = torch.randn(blocks + 1, BLOCK, kv, d).to(dtype)
    v_cache = torch.randn_like(k_cache)
    # the copies hold the same values, so every call gives the same answer whichever it reads
    turn = itertools.cycle([(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(copies - 1)])
    q, kk, vv = (torch.randn(rows, n, d).to(dtype) for n in (h, kv, kv))

    def run(kernel: DecodeAttention | None) -> Callable[[], object]:
        ctx = context(kernel)

        def step() -> object:
            probe.kernel, probe.kernel_at = kernel, (True,) * len(DECODE_ROWS)  # the kernel at any rows
            probe.k_cache, probe.v_cache = next(turn)
            set_context(ctx)
            try:
                return probe(q, kk, vv)
            finally:
                reset_context()

        step.kernel, step.rows = kernel, rows  # type: ignore[attr-defined]  # what the step times (tests, logs)
        step.prefill = probe.prefill_kernel  # type: ignore[attr-defined]  # the whole prompts' kernel, if any
        return step

    return run


def attention_probe(attention: PagedAttention, dtype: torch.dtype, rows: int = ROWS) -> Probe:
    """A decode step of `rows` sequences of CONTEXT tokens through a copy of `attention`'s shape: given a kernel
    (None: gather + SDPA), the call that runs it. The sequences' blocks lie scattered in the pool, and successive
    calls read different caches, together more than the last-level cache holds (up to COLD_BYTES): a decode step
    reads every layer's cache from memory, so a kernel timed on one hot cache was ranked wrongly."""
    per_seq = CONTEXT // BLOCK
    blocks = rows * per_seq
    tables = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).view(rows, per_seq)
    mask = torch.zeros(rows, 1, 1, CONTEXT, dtype=dtype)
    ctx = AttentionContext(tables[:, -1] * BLOCK + BLOCK - 1, rows, tables, mask, [], torch.full((rows,), CONTEXT))
    one = 2 * (blocks + 1) * BLOCK * attention.num_kv_heads * attention.head_dim * dtype.itemsize
    copies = max(1, min(CacheFlush().nbytes, COLD_BYTES) // one)  # as much as evicting the caches takes
    return _probe(attention, dtype, blocks, rows, lambda kernel: ctx, copies)


def decode_attention_kernels() -> dict[str, DecodeAttention]:
    """Every decode attention kernel built for this CPU, by name; without a timer the first that fits is used."""
    found = (
        ("amx", decode_attn_amx.kernel()),
        *decode_attn_dp.kernels().items(),
        ("portable", decode_attn.kernel()),
        ("portable-prefetch", decode_attn.kernel_with_prefetch()),
    )
    return {name: k for name, k in found if k is not None}


def choose_decode_attention(
    kernels: dict[str, DecodeAttention],
    attention: PagedAttention,
    dtype: torch.dtype,
    block_size: int,
    timer: Timer | None,
    cache: PlanCache | None,
) -> tuple[DecodeAttention | None, tuple[bool, ...]]:
    """The fastest of the kernels that take `attention`'s shape (at ROWS sequences), and per decode batch class
    (DECODE_ROWS) whether it beat gather + SDPA (torch) there; (None, ()) where it won at none. Without a timer,
    the first kernel that takes the shape, at every class."""
    h, kv, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
    fits = {n: k for n, k in kernels.items() if k.takes(h, kv, d, dtype, block_size)}
    if not fits:
        return None, ()
    key = f"op decode_attention {{}}x{CONTEXT} h{h} kv{kv} d{d} {dtype} {{}}"
    return _per_class(fits, lambda rows: attention_probe(attention, dtype, rows), key, timer, cache)


def prefill_probe(
    attention: PagedAttention, dtype: torch.dtype, tokens: int, prefill: tuple[PrefillAttention | None, int] = (None, 0)
) -> Probe:
    """One prompt of `tokens` tokens through a copy of `attention`'s shape: given a kernel, its rows attend in
    place (one decode row per token, the context ending at that token); None: the whole prompt's path (SDPA, or
    `prefill`'s kernel where it takes the prompt)."""
    blocks = -(-tokens // BLOCK)
    table = torch.arange(blocks).view(1, blocks).expand(tokens, blocks).contiguous()
    slots = torch.arange(tokens)
    in_place = AttentionContext(slots, tokens, table, None, [], torch.arange(1, tokens + 1))
    whole = AttentionContext(slots, 0, None, None, [PrefillMeta(0, tokens, tokens, None, None)])
    return _probe(attention, dtype, blocks, tokens, lambda kernel: whole if kernel is None else in_place,
                  prefill=prefill)  # fmt: skip


def prefill_in_place_limit(
    kernel: DecodeAttention, attention: PagedAttention, dtype: torch.dtype, timer: Timer | None,
    cache: PlanCache | None, prefill: tuple[PrefillAttention | None, int] = (None, 0),
) -> int:  # fmt: skip
    """The longest prompt chunk (of PREFILL_LENGTHS) up to which `kernel` attending in place beat the whole
    prompt's path (SDPA, or `prefill`'s kernel where chosen) at every length timed; 0 where it lost at the
    shortest. Without a timer (a forced configuration), the longest.

    WHY: a prompt token attends exactly as a decode query whose context ends at it, so the decode kernel serves
    prefill too. At short prompts SDPA's flash kernel spends more on its blocking than on arithmetic (a 158-token
    prompt of SmolLM2's heads: ~0.6-0.9 ms a layer on a 2-core Zen 4); at long ones its tiles win."""
    if timer is None:
        return PREFILL_LENGTHS[-1]
    h, kv, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
    against = "" if prefill[0] is None else f" vs {type(prefill[0]).__name__} up to {prefill[1]}"
    limit = 0
    for tokens in PREFILL_LENGTHS:
        run = prefill_probe(attention, dtype, tokens, prefill)
        key = f"op prefill_in_place {tokens} h{h} kv{kv} d{d} {dtype} {type(kernel).__name__}{against}"
        if fastest(key, {"torch": run(None), "kernel": run(kernel)}, timer, cache) != "kernel":
            break
        limit = tokens
    return limit


def choose_prefill_attention(
    kernel: PrefillAttention | None, attention: PagedAttention, dtype: torch.dtype, timer: Timer | None,
    cache: PlanCache | None,
) -> tuple[PrefillAttention | None, int]:  # fmt: skip
    """`kernel` and the longest whole prompt (of PREFILL_LENGTHS) up to which it beat SDPA at every length timed,
    one prompt at a time; (None, 0) where it lost at the shortest or does not take the shape. Without a timer (a
    forced configuration), the kernel up to the longest length."""
    h, kv, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
    if kernel is None or not kernel.takes(h, kv, d, dtype):
        return None, 0
    if timer is None:
        return kernel, PREFILL_LENGTHS[-1]
    limit = 0
    for tokens in PREFILL_LENGTHS:
        run = prefill_probe(attention, dtype, tokens, (kernel, tokens))
        sdpa = prefill_probe(attention, dtype, tokens)
        key = f"op prefill_attention {tokens} h{h} kv{kv} d{d} {dtype} {type(kernel).__name__}"
        if fastest(key, {"torch": sdpa(None), "kernel": run(None)}, timer, cache) != "kernel":
            break
        limit = tokens
    return (kernel, limit) if limit else (None, 0)


def choose_kernels(
    model: torch.nn.Module,
    pw: PointwiseKernels | None,
    attn: dict[str, DecodeAttention],
    dtype: torch.dtype,
    timer: Timer | None,
    cache: PlanCache | None,
    block_size: int = BLOCK,
    grouped: dict[str, GroupedKernel] | None = None,
    flush: Callable[[], None] | None = None,
    programs: bool = False,
) -> CpuKernels:
    """The kernels (of those that built) that beat torch at this model's sizes on this machine; with no `timer`,
    every one that applies (a forced configuration: engine.config's gemm_path). `attn`, `grouped`: the decode
    attention and grouped GEMM kernels built here (decode_attention_kernels, grouped_kernels); `flush`: the GEMM
    selection's cache flush where the model does not stay in the caches (the experts' choice is timed cold).
    `programs`: decode programs may run (engine.models.decode_program.programs_possible): the kernels they call
    are bound whichever way their timing went (for_programs)."""
    norm = next((m for m in model.modules() if isinstance(m, RMSNorm)), None)
    layer = next((m for m in model.modules() if isinstance(m, PagedAttention)), None)
    head = getattr(model, "lm_head", None)
    k = CpuKernels()
    if pw is not None:
        if norm is not None and for_programs(
            rms_norm_wins(pw, norm.weight.shape[0], dtype, timer, cache), programs, "RMSNorm"
        ):
            k.rms_norm = pw
        if layer is not None and for_programs(
            rope_wins(pw, layer.num_heads + layer.num_kv_heads, layer.head_dim, dtype, timer, cache), programs, "RoPE"
        ):
            k.rope = pw
        if head is not None and argmax_wins(pw, head.out_features, dtype, timer, cache):
            k.argmax = pw
        if head is not None and sample_wins(pw, head.out_features, timer, cache):
            k.sample = pw
    mla = next((m for m in model.modules() if isinstance(m, MLAttention)), None)
    moe = next((m for m in model.modules() if isinstance(m, MoE)), None)
    if pw is not None and mla is not None:
        won = rope_pairs_wins(pw, mla.num_heads, mla.rope, dtype, timer, cache)
        k.rope_pairs = pw if for_programs(won, programs, "RoPE on pairs") else None
    if pw is not None and moe is not None:
        won = moe_combine_wins(pw, moe, dtype, timer, cache)
        k.moe_combine = pw if for_programs(won, programs, "the MoE combine") else None
        if pw.routes(torch.empty(1, moe.gate.weight.shape[1], dtype=dtype), moe.gate):  # (else it never runs)
            won = moe_route_wins(pw, moe, dtype, timer, cache)
            k.moe_route = pw if for_programs(won, programs, "the MoE routing") else None
    if mla is not None:
        k.latent_attn, k.latent_attn_at = choose_latent_attention(
            latent_attention_kernels(attn, dtype), mla, dtype, timer, cache
        )
    if mla is not None:
        gk = choose_absorbed_gemm(grouped, mla, dtype, timer, cache, flush) if grouped else None
        if gk is None and grouped and programs:
            # torch.bmm won this timing (at 32 rows, often by a hair), but a decode program cannot run bmm: the
            # grouped calls are bound anyway, as for_programs does. WHY: on a Zen 3 (2026-12-07) a 4% loss here
            # at 32 rows kept DeepSeek's every decode step out of programs, 1.6x its batch-1 time.
            gk = next(iter(_absorbed_fits(grouped, mla, dtype).values()), None)
            log.info("MLA's W_UK / W_UV: torch.bmm was faster at %d rows; grouped calls are bound anyway, as decode "
                     "programs call them", ROWS)  # fmt: skip
        uv = choose_absorbed_quant(gk, mla, dtype, timer, cache, flush) if gk is not None else None
        uk = choose_absorbed_key(gk, mla, dtype, timer, cache, flush) if gk is not None else None
        f32 = choose_absorbed_float32(mla, dtype, timer, cache, flush)
        split = split_wins(gk, mla, dtype, timer, cache, flush) if gk is not None and f32 is None else False
        k.absorbed = absorbed_gemm(gk, uv, uk, f32, split) if gk is not None or f32 is not None else None
    if grouped and moe is not None:
        k.moe_experts = choose_grouped_experts(grouped, moe, dtype, timer, cache, flush)
    if moe is not None:
        k.moe_quant = choose_quant_experts(moe, dtype, timer, cache, flush)
    if layer is not None:
        k.prefill_attn, k.prefill_attn_up_to = choose_prefill_attention(
            prefill_attn_amx.kernel(), layer, dtype, timer, cache
        )
        k.decode_attn, k.decode_attn_at = choose_decode_attention(attn, layer, dtype, block_size, timer, cache)
        if k.decode_attn is not None and all(k.decode_attn_at):  # prompt rows join the decodes' class
            prefill = (k.prefill_attn, k.prefill_attn_up_to)
            k.prefill_in_place = prefill_in_place_limit(k.decode_attn, layer, dtype, timer, cache, prefill)
    return k
