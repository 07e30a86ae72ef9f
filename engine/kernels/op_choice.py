"""The same choice by measurement for the kernels beside the GEMMs: each of RMSNorm, RoPE, greedy argmax and
paged decode attention is timed against its torch code at the model's own sizes, and kept only where faster.

The kernels were each checked against torch when they were built (engine.kernels.cbuild.Once); here only speed
is in question. Timings go into the same on-disk table as the GEMMs' (engine.kernels.select.PlanCache)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.context import AttentionContext, reset_context, set_context
from engine.kernels.decode_attn import DecodeAttention
from engine.kernels.kernel_set import CpuKernels
from engine.kernels.pointwise import PointwiseKernels, apply_rotary, rms_norm
from engine.kernels.select import MIN_ROUNDS, PlanCache, ShapeChoice, Timer
from engine.layers.attention import PagedAttention
from engine.layers.norm import RMSNorm

ROWS = 32  # a decode batch: where these ops' per-call overhead matters
CONTEXT = 256  # decode attention's tokens of context per sequence
BLOCK = 16


def faster(
    key: str, ours: Callable[[], object], theirs: Callable[[], object], timer: Timer | None, cache: PlanCache | None
) -> bool:
    """Whether `ours` beat `theirs` (the torch code) on this machine; cached under `key`. No timer: yes."""
    if timer is None:
        return True
    cached = cache.get(key) if cache is not None else None
    if cached is not None:
        return cached.per_class == ["kernel"]
    ours(), theirs()  # warm-up
    best = {"kernel": math.inf, "torch": math.inf}
    for _ in range(MIN_ROUNDS * 2):
        best["kernel"] = min(best["kernel"], timer(ours))
        best["torch"] = min(best["torch"], timer(theirs))
    won = best["kernel"] < best["torch"]
    if cache is not None:
        cache.put(key, ShapeChoice(["kernel" if won else "torch"], {k: [v * 1e6] for k, v in best.items()}))
    return won


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


def argmax_wins(k: PointwiseKernels, vocab: int, timer: Timer | None, cache: PlanCache | None) -> bool:
    logits = torch.randn(ROWS, vocab)
    return faster(f"op argmax {ROWS}x{vocab}", lambda: k.argmax(logits), lambda: logits.argmax(dim=-1), timer, cache)


def decode_attention_wins(
    k: DecodeAttention,
    attention: PagedAttention,
    dtype: torch.dtype,
    timer: Timer | None,
    cache: PlanCache | None,
) -> bool:
    """`attention` (a PagedAttention) decoding ROWS sequences of CONTEXT tokens, with the kernel and without."""
    h, kv, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
    probe = PagedAttention(h, kv, d, d**-0.5, (torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)))
    per_seq = CONTEXT // BLOCK
    probe.k_cache = torch.randn(ROWS * per_seq + 1, BLOCK, kv, d).to(dtype)
    probe.v_cache = torch.randn_like(probe.k_cache)
    tables = torch.arange(ROWS * per_seq).view(ROWS, per_seq)
    lens = torch.full((ROWS,), CONTEXT)
    mask = torch.zeros(ROWS, 1, 1, CONTEXT, dtype=dtype)
    ctx = AttentionContext(tables[:, -1] * BLOCK + BLOCK - 1, ROWS, tables, mask, [], lens)
    q, kk, vv = (
        torch.randn(ROWS, h, d).to(dtype),
        torch.randn(ROWS, kv, d).to(dtype),
        torch.randn(ROWS, kv, d).to(dtype),
    )

    def run(kernel: DecodeAttention | None) -> Callable[[], object]:
        def step() -> object:
            probe.kernel = kernel
            set_context(ctx)
            try:
                return probe(q, kk, vv)
            finally:
                reset_context()

        return step

    key = f"op decode_attention {ROWS}x{CONTEXT} h{h} kv{kv} d{d} {dtype}"
    return faster(key, run(k), run(None), timer, cache)


def choose_kernels(
    model: torch.nn.Module,
    pw: PointwiseKernels | None,
    attn: DecodeAttention | None,
    dtype: torch.dtype,
    timer: Timer | None,
    cache: PlanCache | None,
) -> CpuKernels:
    """The kernels (of those that built) that beat torch at this model's sizes on this machine; with no `timer`,
    every one that applies (a forced configuration: engine.config's gemm_path)."""
    norm = next((m for m in model.modules() if isinstance(m, RMSNorm)), None)
    layer = next((m for m in model.modules() if isinstance(m, PagedAttention)), None)
    head = getattr(model, "lm_head", None)
    k = CpuKernels()
    if pw is not None:
        if norm is not None and rms_norm_wins(pw, norm.weight.shape[0], dtype, timer, cache):
            k.rms_norm = pw
        if layer is not None and rope_wins(
            pw, layer.num_heads + layer.num_kv_heads, layer.head_dim, dtype, timer, cache
        ):
            k.rope = pw
        if head is not None and argmax_wins(pw, head.out_features, timer, cache):
            k.argmax = pw
    if (
        attn is not None
        and layer is not None
        and attn.takes(layer.num_heads, layer.num_kv_heads, layer.head_dim, dtype)
    ) and decode_attention_wins(attn, layer, dtype, timer, cache):
        k.decode_attn = attn
    return k
