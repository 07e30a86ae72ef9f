"""Assertions the compiled kernels' tests share (tests/unit/test_bf16mm.py, test_amxmm.py, test_decode_attn_*.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.decode_attn import DecodeAttention, reference
from engine.kernels.gemm import GemmKernel, SiluMulKernel


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def assert_fused_silu_equals_unfused(
    kernel: GemmKernel, fused: SiluMulKernel, m: int, inter: int, k: int, with_bias: bool
) -> None:
    """A gated MLP's [gate | up] projection through the fused epilogue against the same projection through
    `kernel` unfused, then torch's SiLU and multiply in bf16 (what the engine runs without it, and what
    transformers runs)."""
    w, x = bf16(2 * inter, k, seed=10), bf16(m, k, seed=11)
    b = bf16(2 * inter, seed=12) if with_bias else None
    assert fused.accepts(w) and not fused.accepts(w[:-32]) and not fused.accepts(w.float())
    gate, up = kernel.linear(x, kernel.pack(w), 2 * inter, b).chunk(2, dim=-1)
    want = F.silu(gate).mul_(up)
    got = fused.linear(x, fused.pack(w), 2 * inter, b)
    assert got.shape == (m, inter) and got.dtype == torch.bfloat16
    # the exp differs from torch's (SLEEF) in the last float32 bits: now and then one bf16 step apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    assert (got != want).float().mean() < 0.02


def assert_latent_rows_match(kernel: DecodeAttention, h: int, width: int) -> None:
    """MLA decode (engine.layers.mla): `h` query heads over one cached latent row of `width` that is K and V at
    once, over scattered 16-token blocks, against the float32 reference."""
    g = torch.Generator().manual_seed(5)
    lens = (1, 17, 130, 300)
    per_seq = max(-(-n // 16) for n in lens)
    rows = torch.randn(len(lens) * per_seq + 1, 16, 1, width, generator=g).bfloat16()
    q = torch.randn(len(lens), h, width, generator=g).bfloat16()
    tables = torch.randperm(len(lens) * per_seq, generator=g).view(len(lens), per_seq)
    used = torch.tensor(lens)
    got = kernel(q, rows, rows, tables, used, 0.05).float()
    torch.testing.assert_close(got, reference(q, rows, rows, tables, used, 0.05), rtol=2e-2, atol=2e-2)
    assert kernel.takes_latent(h, width, torch.bfloat16, 16)
