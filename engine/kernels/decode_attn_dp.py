"""Decode attention with AVX512-BF16 dot products (engine/kernels/decode_attn_dp.c): the same call as the
portable kernel in engine.kernels.decode_attn, for bf16 caches on CPUs with VDPBF16PS (Zen 4 and later, Cooper
Lake, Sapphire Rapids and later).

A candidate, not a default: engine.kernels.op_choice times it against the other kernels and torch at the model's
own sizes and keeps whichever is fastest.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels import bf16mm
from engine.kernels.cbuild import Once, build
from engine.kernels.decode_attn import DecodeAttention, bf16_slices_fit, check_against_reference, self_check_bf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attn_dp.c")
LATENT_STEPS = 18  # 576 = 512 + 64: DeepSeek-V2/V3's latent + rope columns


class DotDecodeAttention(DecodeAttention):
    def __init__(self, lib: ctypes.CDLL, max_steps: int = 8) -> None:
        self.lib, self.max_steps = lib, max_steps  # head_dim <= 32 * max_steps (MAX_STEPS in decode_attn_dp.c)
        self._bind({torch.bfloat16: lib.decode_attn_dp_bf16})

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> DotDecodeAttention:
        return cls(build(SOURCE, flags))

    @classmethod
    def build_latent(cls) -> DotDecodeAttention:
        """The build for MLA's latent rows (MAX_STEPS 18: up to 576 wide)."""
        return cls(build(SOURCE, ("-march=native", f"-DMAX_STEPS={LATENT_STEPS}")), LATENT_STEPS)

    def takes(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """What decode_attn_dp.c needs: 16-token slices of a block, 32 of head_dim a bf16 vector."""
        return bf16_slices_fit(num_heads, num_kv_heads, head_dim, dtype, block_size) and head_dim <= 32 * self.max_steps

    def takes_latent(self, num_heads: int, width: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """MLA decode (engine.layers.mla): all query heads (at most 16) over one cached latent row of `width`
        (latent + rope) that is K and V at once; only the latent build is that wide."""
        fits = dtype == torch.bfloat16 and block_size % 16 == 0 and width % 32 == 0
        return fits and width <= 32 * self.max_steps and num_heads <= 16 and self.max_steps == LATENT_STEPS


_once = Once(
    DotDecodeAttention.build, log, "decode attention will not use AVX512-BF16 dot products (the portable kernel "
    "still may)", check=self_check_bf16,
)  # fmt: skip


def kernel() -> DotDecodeAttention | None:
    """The process-wide kernel for this CPU; None without AVX512-BF16, or (logged once) where it can't be built."""
    return _once() if bf16mm.supported() else None


# the same kernel asking for the next 16-token slice's rows ahead (PF_AHEAD in decode_attn_dp.c): faster on one CPU
# measured, no faster on another, so engine.kernels.op_choice times it beside the plain build
_once_prefetch = Once(
    lambda: DotDecodeAttention.build(("-march=native", "-DPF_AHEAD=1")), log,
    "decode attention is not timed with software prefetch", check=self_check_bf16,
)  # fmt: skip


def kernel_with_prefetch() -> DotDecodeAttention | None:
    """The build with software prefetch, as kernel() otherwise."""
    return _once_prefetch() if bf16mm.supported() else None


def check_latent(kernel: DecodeAttention) -> None:
    """DeepSeek's latent width: 16 query heads over one 576-wide row that is K and V at once."""
    check_against_reference(kernel, (torch.bfloat16,), ((16, 1, 576),), 16, (1, 17, 300))


_latent = Once(
    DotDecodeAttention.build_latent, log, "MLA decode will gather its latents and run SDPA (slower)",
    check=check_latent,
)  # fmt: skip


def latent_kernel() -> DotDecodeAttention | None:
    """The process-wide latent build (MLA decode); None without AVX512-BF16, or where it can't be built."""
    return _latent() if bf16mm.supported() else None
