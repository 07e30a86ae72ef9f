"""Decode attention with AVX512-BF16 dot products (engine/kernels/decode_attn_dp.c): the same call as the
portable kernel in engine.kernels.decode_attn, for bf16 caches on CPUs with VDPBF16PS (Zen 4 and later, Cooper
Lake, Sapphire Rapids and later).

A candidate, not a default: engine.kernels.op_choice times it against the other kernels and torch at the model's
own sizes and keeps whichever is fastest.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kernels import bf16mm
from engine.kernels.cbuild import Once, build
from engine.kernels.decode_attn import DecodeAttention, bf16_slices_fit, check_against_reference, self_check_bf16

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attn_dp.c")
LATENT_STEPS = 18  # 576 = 512 + 64: DeepSeek-V2/V3's latent + rope columns


# the entry points of decode_attn_dp.c by name in the op choice: scores by reduction or over transposed keys,
# with or without asking for the next slice's rows ahead (the file's header says which won where)
VARIANTS = {"dp": "", "dp-prefetch": "_pf", "dp-t": "_t", "dp-t-prefetch": "_t_pf"}
# the heads' build also has the chunked two-pass entry (written for attention heads; the latent build keeps the four)
HEAD_VARIANTS = {**VARIANTS, "dp-chunked": "_c"}


class DotDecodeAttention(DecodeAttention):
    def __init__(self, lib: ctypes.CDLL, max_steps: int = 8, variant: str = "") -> None:
        self.lib, self.max_steps = lib, max_steps  # head_dim <= 32 * max_steps (MAX_STEPS in decode_attn_dp.c)
        self._bind({torch.bfloat16: getattr(lib, f"decode_attn_dp_bf16{variant}")})

    def takes(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """What decode_attn_dp.c needs: 16-token slices of a block, 32 of head_dim a bf16 vector."""
        return bf16_slices_fit(num_heads, num_kv_heads, head_dim, dtype, block_size) and head_dim <= 32 * self.max_steps

    def takes_latent(self, num_heads: int, width: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """MLA decode (engine.layers.mla): all query heads (at most 16) over one cached latent row of `width`
        (latent + rope) that is K and V at once; only the latent build is that wide."""
        fits = dtype == torch.bfloat16 and block_size % 16 == 0 and width % 32 == 0
        return fits and width <= 32 * self.max_steps and num_heads <= 16 and self.max_steps == LATENT_STEPS


def build_heads() -> ctypes.CDLL:
    """The library for attention heads (MAX_STEPS 8: head_dim <= 256)."""
    return build(SOURCE, ("-march=native",))


def build_latent() -> ctypes.CDLL:
    """The library for MLA's latent rows (MAX_STEPS 18: up to 576 wide)."""
    return build(SOURCE, ("-march=native", f"-DMAX_STEPS={LATENT_STEPS}"))


def _every_variant(lib: ctypes.CDLL, max_steps: int) -> dict[str, DotDecodeAttention]:
    variants = HEAD_VARIANTS if max_steps < LATENT_STEPS else VARIANTS
    return {name: DotDecodeAttention(lib, max_steps, suffix) for name, suffix in variants.items()}


def _checked(check: Callable[[DecodeAttention], None]) -> Callable[[dict[str, DotDecodeAttention]], None]:
    """Every entry point vetted; one that fails keeps the whole library out (they share all but their loops)."""

    def run(found: dict[str, DotDecodeAttention]) -> None:
        for kernel in found.values():
            check(kernel)

    return run


def check_latent(kernel: DecodeAttention) -> None:
    """DeepSeek's latent width: 16 query heads over one 576-wide row that is K and V at once."""
    check_against_reference(kernel, (torch.bfloat16,), ((16, 1, 576),), 16, (1, 17, 300))


# one compile (and one warning where it fails) per library: the heads' build and the latent build
_heads = Once(
    lambda: _every_variant(build_heads(), 8), log,
    "decode attention will not use AVX512-BF16 dot products (the portable kernel still may)",
    check=_checked(self_check_bf16),
)  # fmt: skip
_latents = Once(
    lambda: _every_variant(build_latent(), LATENT_STEPS), log,
    "MLA decode will gather its latents and run SDPA (slower)", check=_checked(check_latent),
)  # fmt: skip


def kernels() -> dict[str, DotDecodeAttention]:
    """Every entry point of the kernel (VARIANTS), for the op choice to time; empty without AVX512-BF16."""
    return (_heads() or {}) if bf16mm.supported() else {}


def latent_kernels() -> dict[str, DotDecodeAttention]:
    """Every entry point of the latent build (VARIANTS), for the op choice; empty without AVX512-BF16."""
    return (_latents() or {}) if bf16mm.supported() else {}
