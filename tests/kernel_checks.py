"""Assertions the compiled GEMM kernels' tests share (tests/unit/test_bf16mm.py, tests/unit/test_amxmm.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
