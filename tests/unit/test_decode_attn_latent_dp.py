"""The bf16 MLA latent decode with the heads in one vector (engine.kernels.decode_attn_latent_dp), compiled here
with gcc, against the float32 reference read from the paged cache, and inside an MLA layer against gathering the
latents and running SDPA."""

from __future__ import annotations

import pytest
import torch

from engine.context import AttentionContext
from engine.kernels import bf16mm, decode_attn_dp, decode_attn_latent_dp
from engine.kernels.decode_attn import DECODE_ROWS, reference
from engine.kernels.decode_attn_latent import VALUES, WIDTH
from engine.kernels.decode_attn_latent_dp import LatentDotAttention
from engine.kernels.op_choice import latent_attention_kernels
from engine.layers.mla import MLAttention

pytestmark = pytest.mark.skipif(not bf16mm.supported(), reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def kernel() -> LatentDotAttention:
    k = decode_attn_latent_dp.kernel()
    assert k is not None, "the bf16 latent kernel did not build or failed its self-check (the warning says why)"
    return k


def _cache(lens: tuple[int, ...], block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 latent rows in scattered blocks, NaN past every context's end (stale memory), and the block tables."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(-(-n // block_size) for n in lens)
    nblocks = len(lens) * per_seq + 1
    rows = torch.randn(nblocks, block_size, 1, WIDTH, generator=g)
    rows[-1] = float("nan")
    tables = torch.randperm(nblocks - 1, generator=g)[: len(lens) * per_seq].view(len(lens), per_seq)
    for i, n in enumerate(lens):
        tables[i, -(-n // block_size) :] = nblocks - 1
        rows[tables[i, (n - 1) // block_size], (n - 1) % block_size + 1 :] = float("nan")
    return rows.bfloat16(), tables


# heads: 16 (one vector), fewer (tensor parallel ranks' shares; 3 and 6: value tiles of fewer than 4 heads), more
# (groups of 16 and a partial one; DeepSeek-V2/V3's 128); lengths: one token, under, at and past a 16-token slice
# and a 32-token chunk, an odd count (a pair's second row past the end), long; blocks of 16 and 32 tokens
@pytest.mark.parametrize("h", [16, 8, 6, 3, 36, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_equals_the_reference_over_scattered_blocks_and_stale_memory(
    kernel: LatentDotAttention, h: int, block_size: int
) -> None:
    lens = (1, 15, 16, 31, 32, 33, 200, 17)
    rows, tables = _cache(lens, block_size, seed=h)
    q = torch.randn(len(lens), h, WIDTH, generator=torch.Generator().manual_seed(1)).bfloat16()
    used = torch.tensor(lens)
    got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)
    assert got.dtype == torch.bfloat16
    want = reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
    torch.testing.assert_close(got[..., :VALUES].float(), want, rtol=2e-2, atol=2e-2)
    assert not got[..., VALUES:].any()  # the rope columns: zeros, never stale memory


def test_agrees_with_the_dot_product_kernels_latent_build(kernel: LatentDotAttention) -> None:
    """The kernel it would replace: both round P to bf16 and sum in float32, so they differ by rounding only."""
    lens = (7, 64, 150)
    rows, tables = _cache(lens, 16, seed=5)
    q = torch.randn(len(lens), 16, WIDTH, generator=torch.Generator().manual_seed(6)).bfloat16()
    used = torch.tensor(lens)
    for name, other in decode_attn_dp.latent_kernels().items():
        want = other(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES].float()
        got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES].float()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=name)


def test_scores_far_apart_keep_their_running_maximum(kernel: LatentDotAttention) -> None:
    """One key aligned with the query late in a long context, the rest near zero: the maximum must carry across
    chunks, or exp() overflows."""
    rows, tables = _cache((300,), 16, seed=3)
    rows *= 0.01
    q = (torch.randn(1, 16, WIDTH, generator=torch.Generator().manual_seed(4)) * 4).bfloat16()
    rows.view(-1, WIDTH)[tables[0, 270 // 16] * 16 + 270 % 16] = q[0, 0] * 3
    used = torch.tensor([300])
    got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES].float()
    assert torch.isfinite(got).all()
    want = reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_takes_only_bf16_latent_rows_of_its_width_in_16_token_slices(kernel: LatentDotAttention) -> None:
    assert kernel.takes_latent(16, WIDTH, torch.bfloat16) and kernel.takes_latent(3, WIDTH, torch.bfloat16, 32)
    assert kernel.takes_latent(128, WIDTH, torch.bfloat16)  # DeepSeek-V2/V3: groups of 16 heads
    assert not kernel.takes_latent(16, WIDTH, torch.float32)
    assert not kernel.takes_latent(16, WIDTH - 32, torch.bfloat16)
    assert not kernel.takes_latent(16, WIDTH, torch.bfloat16, 8)  # a slice would straddle blocks
    assert not kernel.takes_latent(0, WIDTH, torch.bfloat16)
    assert not kernel.takes(16, 1, WIDTH, torch.bfloat16)  # not an attention layer's kernel


def test_the_op_choice_times_it_for_bf16_math(kernel: LatentDotAttention) -> None:
    assert latent_attention_kernels({}, torch.bfloat16)["latent-dp"] is kernel
    assert "latent-dp" not in latent_attention_kernels({}, torch.float32)


def test_an_mla_layer_decodes_through_it_as_through_gather_and_sdpa(kernel: LatentDotAttention) -> None:
    """The layer's decode path alone (W_UK, attention, W_UV) in bf16: the same latents and queries, kernel bound
    or not."""
    torch.manual_seed(0)
    heads, nope, rope, v = 16, 32, 64, 32
    scratch = torch.empty(0, dtype=torch.bfloat16)  # as a model built in bf16 makes it
    mla = MLAttention(64, heads, None, VALUES, nope, rope, v, False, 0.1, False, scratch).bfloat16()
    mla.kv_b_proj.weight.data.normal_(std=VALUES**-0.5)  # outputs of order one, as a trained layer's
    lens = (1, 40, 16, 100)
    rows, tables = _cache(lens, 16, seed=7)
    mla.kv_cache = rows.squeeze(2).nan_to_num(0.0)  # SDPA's path reads the padding too (masked); NaN * 0 is NaN
    used = torch.tensor(lens)
    width = tables.shape[1] * 16
    mask = torch.zeros(len(lens), 1, 1, width).masked_fill(torch.arange(width) >= used[:, None, None, None], -torch.inf)
    ctx = AttentionContext(tables[:, -1] * 16, len(lens), tables, mask.bfloat16(), [], used)
    q_nope, q_pe = torch.randn(len(lens), heads, nope).bfloat16(), torch.randn(len(lens), heads, rope).bfloat16()
    plain = mla._decode(q_nope, q_pe, ctx)
    mla.kernel, mla.kernel_at = kernel, (True,) * len(DECODE_ROWS)  # every batch class
    assert mla.in_place(len(lens))
    torch.testing.assert_close(mla._decode(q_nope, q_pe, ctx).float(), plain.float(), rtol=3e-2, atol=3e-2)
