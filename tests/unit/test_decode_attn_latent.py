"""The float32 MLA latent decode (engine.kernels.decode_attn_latent), compiled here with gcc, against the float32
reference read from the paged cache, and inside an MLA layer against gathering the latents and running SDPA.
It builds on every CPU (GCC vector extensions), so these run everywhere."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import decode_attn_latent
from engine.kernels.decode_attn import reference
from engine.kernels.decode_attn_latent import VALUES, WIDTH, LatentDecodeAttention
from tests.latent_cases import assert_mla_decode_matches_gather_and_sdpa, latent_cache


@pytest.fixture(scope="module")
def kernel() -> LatentDecodeAttention:
    k = decode_attn_latent.kernel()
    assert k is not None, "the float32 latent kernel did not build or failed its self-check (the warning says why)"
    return k


# heads: 16 (one vector of heads), fewer (tensor parallel ranks' shares), more (groups of 16 and a partial one, as
# DeepSeek-V2/V3's 128); lengths: one token, under, at and past a 32-token chunk, past 16-token blocks, long;
# blocks of 16 and 32 tokens
@pytest.mark.parametrize("h", [16, 12, 8, 4, 36, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_equals_the_reference_over_scattered_blocks_and_stale_memory(
    kernel: LatentDecodeAttention, h: int, block_size: int
) -> None:
    lens = (1, 31, 32, 33, 200, 17)
    rows, tables = latent_cache(lens, block_size, seed=h)
    q = torch.randn(len(lens), h, WIDTH, generator=torch.Generator().manual_seed(1))
    used = torch.tensor(lens)
    got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)
    want = reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
    torch.testing.assert_close(got[..., :VALUES], want, rtol=1e-4, atol=1e-5)
    assert not got[..., VALUES:].any()  # the rope columns: zeros, never stale memory


def test_scores_far_apart_keep_their_running_maximum(kernel: LatentDecodeAttention) -> None:
    """One key aligned with the query late in a long context, the rest near zero: the maximum must carry across
    chunks, or exp() overflows."""
    rows, tables = latent_cache((300,), 16, seed=3)
    rows *= 0.01
    q = torch.randn(1, 16, WIDTH, generator=torch.Generator().manual_seed(4)) * 4
    rows.view(-1, WIDTH)[tables[0, 270 // 16] * 16 + 270 % 16] = q[0, 0] * 3
    used = torch.tensor([300])
    got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES])


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_one_sequence_split_over_threads_equals_the_reference(kernel: LatentDecodeAttention, threads: int) -> None:
    """Fewer sequences x head groups than threads: each sequence's tokens run in parts of whole chunks (at least 64
    tokens a part), combined after. Lengths below one part, at the split's edges, past whole chunks; one sequence,
    two of very different lengths (one split, one not); the largest score in the last part of one sequence and the
    first of another, so the parts' maxima differ by far."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens in ((127,), (128,), (200,), (1000,), (513,), (1000, 40)):
            rows, tables = latent_cache(lens, 16, seed=len(lens))
            rows *= 0.05
            q = torch.randn(len(lens), 16, WIDTH, generator=torch.Generator().manual_seed(7)) * 2
            for b, at in enumerate((lens[0] - 3, 5)[: len(lens)]):
                rows.view(-1, WIDTH)[tables[b, at // 16] * 16 + at % 16] = q[b, 0] * 2
            used = torch.tensor(lens)
            got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)
            assert torch.isfinite(got).all() and not got[..., VALUES:].any(), lens
            want = reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
            torch.testing.assert_close(got[..., :VALUES], want, rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_takes_only_float32_latent_rows_of_its_width_and_head_counts(kernel: LatentDecodeAttention) -> None:
    assert kernel.takes_latent(16, WIDTH, torch.float32) and kernel.takes_latent(4, WIDTH, torch.float32, 32)
    assert not kernel.takes_latent(16, WIDTH, torch.bfloat16)
    assert not kernel.takes_latent(16, WIDTH - 32, torch.float32)
    assert kernel.takes_latent(128, WIDTH, torch.float32)  # DeepSeek-V2/V3: groups of 16 heads
    assert not kernel.takes_latent(6, WIDTH, torch.float32)  # not whole value tiles of 4 heads
    assert not kernel.takes_latent(0, WIDTH, torch.float32)
    assert not kernel.takes(16, 1, WIDTH, torch.float32)  # not an attention layer's kernel


def test_an_mla_layer_decodes_through_it_as_through_gather_and_sdpa(kernel: LatentDecodeAttention) -> None:
    assert_mla_decode_matches_gather_and_sdpa(kernel, torch.float32, rtol=1e-4, atol=1e-4)
