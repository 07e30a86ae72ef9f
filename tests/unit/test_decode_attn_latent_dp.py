"""The bf16 MLA latent decode with the heads in one vector (engine.kernels.decode_attn_latent_dp), compiled here
with gcc, against the float32 reference read from the paged cache, and inside an MLA layer against gathering the
latents and running SDPA."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import bf16mm, decode_attn_dp, decode_attn_latent_dp
from engine.kernels.decode_attn import reference
from engine.kernels.decode_attn_latent import VALUES, WIDTH
from engine.kernels.decode_attn_latent_dp import LatentDotAttention
from engine.kernels.op_choice import latent_attention_kernels
from tests.latent_cases import assert_mla_decode_matches_gather_and_sdpa, latent_cache

pytestmark = pytest.mark.skipif(not bf16mm.supported(), reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def kernel() -> LatentDotAttention:
    k = decode_attn_latent_dp.kernel()
    assert k is not None, "the bf16 latent kernel did not build or failed its self-check (the warning says why)"
    return k


# heads: 16 (one vector), fewer (tensor parallel ranks' shares; 3 and 6: value tiles of fewer than 4 heads), more
# (groups of 16 and a partial one; DeepSeek-V2/V3's 128); lengths: one token, under, at and past a 16-token slice
# and a 32-token chunk, an odd count (a pair's second row past the end), long; blocks of 16 and 32 tokens
@pytest.mark.parametrize("h", [16, 8, 6, 3, 36, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_equals_the_reference_over_scattered_blocks_and_stale_memory(
    kernel: LatentDotAttention, h: int, block_size: int
) -> None:
    lens = (1, 15, 16, 31, 32, 33, 200, 17)
    rows, tables = latent_cache(lens, block_size, seed=h, dtype=torch.bfloat16)
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
    rows, tables = latent_cache(lens, 16, seed=5, dtype=torch.bfloat16)
    q = torch.randn(len(lens), 16, WIDTH, generator=torch.Generator().manual_seed(6)).bfloat16()
    used = torch.tensor(lens)
    for name, other in decode_attn_dp.latent_kernels().items():
        want = other(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES].float()
        got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES].float()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=name)


def test_scores_far_apart_keep_their_running_maximum(kernel: LatentDotAttention) -> None:
    """One key aligned with the query late in a long context, the rest near zero: the maximum must carry across
    chunks, or exp() overflows."""
    rows, tables = latent_cache((300,), 16, seed=3, dtype=torch.bfloat16)
    rows *= 0.01
    q = (torch.randn(1, 16, WIDTH, generator=torch.Generator().manual_seed(4)) * 4).bfloat16()
    rows.view(-1, WIDTH)[tables[0, 270 // 16] * 16 + 270 % 16] = q[0, 0] * 3
    used = torch.tensor([300])
    got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES].float()
    assert torch.isfinite(got).all()
    want = reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_one_sequence_split_over_threads_equals_the_reference(kernel: LatentDotAttention, threads: int) -> None:
    """Fewer sequences than threads: each sequence's tokens run in parts of whole chunks (at least 64 tokens a
    part), combined after. Lengths below one part, at the split's edges, past whole chunks; a single sequence
    and two of very different lengths (one split, one not); the largest score in the last part of one sequence
    and the first of another, so the parts' maxima differ by far; stale NaN rows past each context."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens in ((127,), (128,), (200,), (1000,), (513,), (1000, 40)):
            rows, tables = latent_cache(lens, 16, seed=len(lens), dtype=torch.bfloat16)
            rows *= 0.05
            q = (torch.randn(len(lens), 16, WIDTH, generator=torch.Generator().manual_seed(7)) * 2).bfloat16()
            for b, at in enumerate((lens[0] - 3, 5)[: len(lens)]):
                rows.view(-1, WIDTH)[tables[b, at // 16] * 16 + at % 16] = q[b, 0] * 2
            used = torch.tensor(lens)
            got = kernel(q, rows, rows, tables, used, WIDTH**-0.5)
            assert torch.isfinite(got.float()).all() and not got[..., VALUES:].any(), lens
            want = reference(q, rows, rows, tables, used, WIDTH**-0.5)[..., :VALUES]
            torch.testing.assert_close(got[..., :VALUES].float(), want, rtol=2e-2, atol=2e-2)
    finally:
        torch.set_num_threads(before)


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
    assert_mla_decode_matches_gather_and_sdpa(kernel, torch.bfloat16, rtol=3e-2, atol=3e-2)
