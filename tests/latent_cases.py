"""What the MLA latent decode kernels' tests share (tests/unit/test_decode_attn_latent.py for float32,
test_decode_attn_latent_dp.py for bf16): a paged latent cache with stale memory, and an MLA layer's decode through a
kernel against gather + SDPA."""

from __future__ import annotations

import torch

from engine.context import AttentionContext
from engine.kernels.decode_attn import DECODE_ROWS, DecodeAttention
from engine.kernels.decode_attn_latent import VALUES, WIDTH
from engine.layers.mla import MLAttention


def latent_cache(
    lens: tuple[int, ...], block_size: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Latent rows [blocks, block_size, 1, WIDTH] in scattered blocks, NaN past every context's end (stale memory),
    and the block tables."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(-(-n // block_size) for n in lens)
    nblocks = len(lens) * per_seq + 1
    rows = torch.randn(nblocks, block_size, 1, WIDTH, generator=g)
    rows[-1] = float("nan")
    tables = torch.randperm(nblocks - 1, generator=g)[: len(lens) * per_seq].view(len(lens), per_seq)
    for i, n in enumerate(lens):
        tables[i, -(-n // block_size) :] = nblocks - 1
        rows[tables[i, (n - 1) // block_size], (n - 1) % block_size + 1 :] = float("nan")
    return rows.to(dtype), tables


def assert_mla_decode_matches_gather_and_sdpa(
    kernel: DecodeAttention, dtype: torch.dtype, rtol: float, atol: float
) -> None:  # fmt: skip
    """An MLA layer's decode path alone (W_UK, attention, W_UV) in `dtype`: the same latents and queries, with
    `kernel` bound at every batch class or not."""
    torch.manual_seed(0)
    heads, nope, rope, v = 16, 32, 64, 32
    scratch = torch.empty(0, dtype=dtype)  # as a model built in `dtype` makes it
    mla = MLAttention(64, heads, None, VALUES, nope, rope, v, False, 0.1, False, scratch).to(dtype)
    mla.kv_b_proj.weight.data.normal_(std=VALUES**-0.5)  # outputs of order one, as a trained layer's
    lens = (1, 40, 16, 100)
    rows, tables = latent_cache(lens, 16, seed=7, dtype=dtype)
    mla.kv_cache = rows.squeeze(2).nan_to_num(0.0)  # SDPA's path reads the padding too (masked); NaN * 0 is NaN
    used = torch.tensor(lens)
    width = tables.shape[1] * 16
    mask = torch.zeros(len(lens), 1, 1, width).masked_fill(torch.arange(width) >= used[:, None, None, None], -torch.inf)
    ctx = AttentionContext(tables[:, -1] * 16, len(lens), tables, mask.to(dtype), [], used)
    q_nope, q_pe = torch.randn(len(lens), heads, nope).to(dtype), torch.randn(len(lens), heads, rope).to(dtype)
    plain = mla._decode(q_nope, q_pe, ctx)
    mla.kernel, mla.kernel_at = kernel, (True,) * len(DECODE_ROWS)  # every batch class
    assert mla.in_place(len(lens))
    torch.testing.assert_close(mla._decode(q_nope, q_pe, ctx).float(), plain.float(), rtol=rtol, atol=atol)
