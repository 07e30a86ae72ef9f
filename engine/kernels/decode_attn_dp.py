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
from engine.kernels.decode_attn import DecodeAttention, bf16_slices_fit, self_check_bf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attn_dp.c")


class DotDecodeAttention(DecodeAttention):
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._bind({torch.bfloat16: lib.decode_attn_dp_bf16})

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> DotDecodeAttention:
        return cls(build(SOURCE, flags))

    def takes(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """What decode_attn_dp.c needs: 16-token slices of a block, 32 of head_dim a bf16 vector."""
        return bf16_slices_fit(num_heads, num_kv_heads, head_dim, dtype, block_size)


_once = Once(
    DotDecodeAttention.build, log, "decode attention will not use AVX512-BF16 dot products (the portable kernel "
    "still may)", check=self_check_bf16,
)  # fmt: skip


def kernel() -> DotDecodeAttention | None:
    """The process-wide kernel for this CPU; None without AVX512-BF16, or (logged once) where it can't be built."""
    return _once() if bf16mm.supported() else None
