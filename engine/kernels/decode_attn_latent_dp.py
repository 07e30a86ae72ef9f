"""MLA decode over the paged latent cache in place with AVX512-BF16 dot products, the query heads in one vector
(engine/kernels/decode_attn_latent_dp.c): for bf16 caches on CPUs with VDPBF16PS.

A candidate, not a default: engine.kernels.op_choice times it against the other latent kernels (decode_attn_dp's
latent build, the AMX one) and gathering the latents for SDPA, at the model's sizes, and keeps the fastest.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.kernels import bf16mm
from engine.kernels.cbuild import Once, build
from engine.kernels.decode_attn import DecodeAttention
from engine.kernels.decode_attn_latent import GROUP, WIDTH, check_latent

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attn_latent_dp.c")


class LatentDotAttention(DecodeAttention):
    """The family's call (engine.kernels.decode_attn.DecodeAttention) with the latent rows as K and V at once;
    it writes the first VALUES columns of each head's output (what MLA reads) and zeros the rest."""

    def __init__(self, lib: object) -> None:
        self.lib = lib
        self._bind({torch.bfloat16: lib.decode_attn_latent_dp})  # type: ignore[attr-defined]

    @classmethod
    def build(cls) -> LatentDotAttention:
        return cls(build(SOURCE, ("-march=native",)))

    def takes(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        return False  # MLA's latent rows only

    def takes_latent(self, num_heads: int, width: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """bf16 rows of DeepSeek's width in 16-token slices, any number of heads (groups of up to 16 a task)."""
        return dtype == torch.bfloat16 and width == WIDTH and block_size % 16 == 0 and num_heads > 0


def self_check(kernel: LatentDotAttention) -> None:
    """Heads in two groups and a part of one (3: a value tile of fewer heads than its four), one group."""
    check_latent(kernel, torch.bfloat16, (2 * GROUP + 3, GROUP), 2e-2, 2e-2)


_once = Once(
    LatentDotAttention.build, log, "MLA decode will not use the heads-in-a-vector kernel", check=self_check
)  # fmt: skip


def kernel() -> LatentDotAttention | None:
    """The process-wide kernel; None without AVX512-BF16, or (logged once) where it can't be built."""
    return _once() if bf16mm.supported() else None
