"""The float32 MLA latent decode (engine.kernels.decode_attn_latent), compiled here with gcc, against the float32
reference read from the paged cache, and inside an MLA layer against gathering the latents and running SDPA.
It builds on every CPU (GCC vector extensions), so these run everywhere."""

from __future__ import annotations

import pytest
import torch

from engine.context import AttentionContext
from engine.kernels import decode_attn_latent
from engine.kernels.decode_attn import DECODE_ROWS, reference
from engine.kernels.decode_attn_latent import VALUES, WIDTH, LatentDecodeAttention
from engine.layers.mla import MLAttention


@pytest.fixture(scope="module")
def kernel() -> LatentDecodeAttention:
    k = decode_attn_latent.kernel()
    assert k is not None, "the float32 latent kernel did not build or failed its self-check (the warning says why)"
    return k


def _cache(lens: tuple[int, ...], block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows in scattered blocks, NaN past every context's end (stale memory), and the block tables."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(-(-n // block_size) for n in lens)
    nblocks = len(lens) * per_seq + 1
    rows = torch.randn(nblocks, block_size, 1, WIDTH, generator=g)
    rows[-1] = float("nan")
    tables = torch.randperm(nblocks - 1, generator=g)[: len(lens) * per_seq].view(len(lens), per_seq)
    for i, n in enumerate(lens):
        tables[i, -(-n // block_size) :] = nblocks - 1
        rows[tables[i, (n - 1) // block_size], (n - 1) % block_size + 1 :] = float("nan")
    return rows, tables


# heads: 16 (one vector of heads), fewer (tensor parallel ranks' shares), more (groups of 16 and a partial one, as
# DeepSeek-V2/V3's 128); lengths: one token, under, at and past a 32-token chunk, past 16-token blocks, long;
# blocks of 16 and 32 tokens
@pytest.mark.parametrize("h", [16, 12, 8, 4, 36, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_equals_the_reference_over_scattered_blocks_and_stale_memory(
    kernel: LatentDecodeAttention, h: int, block_size: int
) -> None:
    lens = (1, 31, 32, 33, 200, 17)
    rows, tables = _cache(lens, block_size, seed=h)
    q = torch.randn(len(lens), h, WIDTH, generator=torch.Generator().manual_seed(1))
    used = torch.tensor(lens)
    got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)
    want = reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
    torch.testing.assert_close(got[..., :VALUES], want, rtol=1e-4, atol=1e-5)
    assert not got[..., VALUES:].any()  # the rope columns: zeros, never stale memory


def test_scores_far_apart_keep_their_running_maximum(kernel: LatentDecodeAttention) -> None:
    """One key aligned with the query late in a long context, the rest near zero: the maximum must carry across
    chunks, or exp() overflows."""
    rows, tables = _cache((300,), 16, seed=3)
    rows *= 0.01
    q = torch.randn(1, 16, WIDTH, generator=torch.Generator().manual_seed(4)) * 4
    rows.view(-1, WIDTH)[tables[0, 270 // 16] * 16 + 270 % 16] = q[0, 0] * 3
    used = torch.tensor([300])
    got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES])


def test_takes_only_float32_latent_rows_of_its_width_and_head_counts(kernel: LatentDecodeAttention) -> None:
    assert kernel.takes_latent(16, WIDTH, torch.float32) and kernel.takes_latent(4, WIDTH, torch.float32, 32)
    assert not kernel.takes_latent(16, WIDTH, torch.bfloat16)
    assert not kernel.takes_latent(16, WIDTH - 32, torch.float32)
    assert kernel.takes_latent(128, WIDTH, torch.float32)  # DeepSeek-V2/V3: groups of 16 heads
    assert not kernel.takes_latent(6, WIDTH, torch.float32)  # not whole value tiles of 4 heads
    assert not kernel.takes_latent(0, WIDTH, torch.float32)
    assert not kernel.takes(16, 1, WIDTH, torch.float32)  # not an attention layer's kernel


def test_an_mla_layer_decodes_through_it_as_through_gather_and_sdpa(kernel: LatentDecodeAttention) -> None:
    """The layer's decode path alone (W_UK, attention, W_UV): the same latents and queries, kernel bound or not."""
    torch.manual_seed(0)
    heads, nope, rope, v = 16, 32, 64, 32
    mla = MLAttention(64, heads, None, VALUES, nope, rope, v, False, 0.1, False)
    mla.kv_b_proj.weight.data.normal_(std=VALUES**-0.5)  # outputs of order one, as a trained layer's
    lens = (1, 40, 16, 100)
    rows, tables = _cache(lens, 16, seed=7)
    mla.kv_cache = rows.squeeze(2).nan_to_num(0.0)  # SDPA's path reads the padding too (masked); NaN * 0 is NaN
    used = torch.tensor(lens)
    width = tables.shape[1] * 16
    mask = torch.zeros(len(lens), 1, 1, width).masked_fill(torch.arange(width) >= used[:, None, None, None], -torch.inf)
    ctx = AttentionContext(tables[:, -1] * 16, len(lens), tables, mask, [], used)
    q_nope, q_pe = torch.randn(len(lens), heads, nope), torch.randn(len(lens), heads, rope)
    plain = mla._decode(q_nope, q_pe, ctx)
    mla.kernel, mla.kernel_at = kernel, (True,) * len(DECODE_ROWS)  # every batch class
    assert mla.in_place(len(lens))
    torch.testing.assert_close(mla._decode(q_nope, q_pe, ctx), plain, rtol=1e-4, atol=1e-4)
