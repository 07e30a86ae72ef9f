"""Decode attention on AMX tiles (engine/kernels/decode_attn_amx.c): the same call as the portable kernel in
engine.kernels.decode_attn, for bf16 caches on CPUs with AMX-BF16.

A candidate, not a default: engine.kernels.op_choice times it against the portable kernel and torch at the
model's own sizes and keeps whichever is fastest.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.kernels import amxmm
from engine.kernels.cbuild import BuildError, Once, build
from engine.kernels.decode_attn import DecodeAttention, bf16_slices_fit, self_check_bf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attn_amx.c")


class AMXDecodeAttention(DecodeAttention):
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.decode_attn_amx_init.restype = ctypes.c_int
        if lib.decode_attn_amx_init() != 0:
            raise BuildError("the kernel cannot use AMX: Linux refused the tile state (arch_prctl)")
        self._bind({torch.bfloat16: lib.decode_attn_amx_bf16})

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native", "-mamx-tile", "-mamx-bf16")) -> AMXDecodeAttention:
        return cls(build(SOURCE, flags))

    def takes(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """What the tile layout needs (decode_attn_amx.c): 16-token slices of a block, 32 of head_dim a tile."""
        return bf16_slices_fit(num_heads, num_kv_heads, head_dim, dtype, block_size)

    def takes_latent(self, num_heads: int, width: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """MLA decode (engine.layers.mla): all query heads over one cached latent row of `width` (latent + rope),
        which is K and V at once."""
        return dtype == torch.bfloat16 and block_size % 16 == 0 and width % 32 == 0 and width <= 576 and num_heads <= 16


_once = Once(
    AMXDecodeAttention.build, log, "decode attention will not use AMX tiles (the portable kernel still may)",
    check=self_check_bf16,
)  # fmt: skip


def kernel() -> AMXDecodeAttention | None:
    """The process-wide kernel for this CPU; None without AMX, or (logged once) where it can't be built."""
    return _once() if amxmm.supported() else None
