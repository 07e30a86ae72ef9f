"""MLA decode over the paged latent cache in place, in float32 (engine/kernels/decode_attn_latent.c): for CPUs
without bf16 arithmetic, where the dot-product and AMX latent kernels cannot run and the engine computes in
float32.

A candidate, not a default: engine.kernels.op_choice times it against gathering the latents and running SDPA
(engine.layers.mla.latent_attention) at the model's sizes and keeps whichever is faster.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.kernels.cbuild import Once, SelfCheckError, build
from engine.kernels.decode_attn import DecodeAttention, reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attn_latent.c")
WIDTH, VALUES = 576, 512  # LD and LV in decode_attn_latent.c: DeepSeek-V2/V3's latent + rope, and the latent
HEADS_STEP, GROUP = 4, 16  # HB and MAX_H: heads come in value tiles of 4, in groups of 16 per task


class LatentDecodeAttention(DecodeAttention):
    """The family's call (engine.kernels.decode_attn.DecodeAttention) with the latent rows as K and V at once;
    it writes the first VALUES columns of each head's output (what MLA reads) and zeros the rest."""

    def __init__(self, lib: object) -> None:
        self.lib = lib
        self._bind({torch.float32: lib.decode_attn_latent_f32})  # type: ignore[attr-defined]

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> LatentDecodeAttention:
        return cls(build(SOURCE, flags))

    def takes(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        return False  # MLA's latent rows only

    def takes_latent(self, num_heads: int, width: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        return dtype == torch.float32 and width == WIDTH and num_heads > 0 and num_heads % HEADS_STEP == 0


def self_check(kernel: LatentDecodeAttention) -> None:
    """check_latent in float32."""
    check_latent(kernel, torch.float32, (GROUP + HEADS_STEP, GROUP, HEADS_STEP), 1e-4, 1e-5)


def check_latent(
    kernel: DecodeAttention, dtype: torch.dtype, heads: tuple[int, ...], rtol: float, atol: float
) -> None:  # fmt: skip
    """`heads` query heads over scattered 16-token blocks of `dtype` latent rows, contexts under, at and over one
    chunk and block, stale (NaN) cache memory past each context's end; scores far apart (a late peak) so the
    running maximum must carry. The first VALUES columns against the reference, the rest zero."""
    g = torch.Generator().manual_seed(0)
    lens = (1, 16, 33, 300)
    width = max(-(-n // 16) for n in lens)
    nblocks = len(lens) * width + 1
    rows = torch.randn(nblocks, 16, 1, WIDTH, generator=g)
    rows[-1] = float("nan")
    tables = torch.randperm(nblocks - 1, generator=g)[: len(lens) * width].view(len(lens), width)
    for i, n in enumerate(lens):
        tables[i, -(-n // 16) :] = nblocks - 1
        rows[tables[i, (n - 1) // 16], (n - 1) % 16 + 1 :] = float("nan")
    rows[tables[3, 250 // 16], 250 % 16] *= 6  # the peak, past the first chunks
    rows = rows.to(dtype)
    used = torch.tensor(lens)
    for h in heads:
        q = torch.randn(len(lens), h, WIDTH, generator=g).to(dtype)
        got = kernel(q, rows, rows, tables, used, WIDTH**-0.5).float()
        want = reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
        ok = torch.allclose(got[..., :VALUES], want, rtol=rtol, atol=atol) and not got[..., VALUES:].any()
        if not ok:
            err = (got[..., :VALUES] - want).abs().max().item()
            raise SelfCheckError(f"latent self-check failed for {h} heads of {dtype}: max error {err:.3g}")


# The process-wide kernel built for this CPU, or None (logged once) where it cannot be built.
kernel = Once(
    LatentDecodeAttention.build, log, "float32 MLA decode will gather its latents and run SDPA", check=self_check
)
