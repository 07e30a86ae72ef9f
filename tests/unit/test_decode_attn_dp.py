"""The AVX512-BF16 decode attention (engine.kernels.decode_attn_dp), compiled here with gcc, against the float32
reference read from the paged cache.

It is a candidate only on CPUs with AVX512-BF16, so these tests run where the CPU has it; elsewhere the selection
never sees it (the portable kernel's tests cover the rest)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.kernels import bf16mm, decode_attn, decode_attn_dp
from engine.kernels.decode_attn import check_against_reference
from engine.kernels.decode_attn_dp import HEAD_VARIANTS, LATENT_STEPS, VARIANTS, DotDecodeAttention
from tests.kernel_checks import assert_latent_rows_match

pytestmark = pytest.mark.skipif(not bf16mm.supported(), reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """The heads' build and the latent build, compiled once here: every entry point lives in each."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernels")))
    try:
        return decode_attn_dp.build_heads(), decode_attn_dp.build_latent()
    finally:
        mp.undo()


@pytest.fixture(scope="module", params=list(HEAD_VARIANTS.values()), ids=list(HEAD_VARIANTS))
def kernel(request: pytest.FixtureRequest, builds: tuple[ctypes.CDLL, ctypes.CDLL]) -> DotDecodeAttention:
    """Every entry point the op choice times: scores by reduction or over transposed keys, without and with the
    prefetch of the next slice's rows, and the chunked two-pass one (contexts over one chunk of 256 included)."""
    return DotDecodeAttention(builds[0], variant=request.param)


# G = 1, 3, 7, 8, 16 query heads per KV head; head_dim 32 to 256 (one to eight bf16 vectors); KV heads per task
# from one to eight (the kernel groups a sequence's KV heads up to 32 query heads a task)
@pytest.mark.parametrize(
    ("h", "kv", "d"), [(2, 2, 64), (9, 3, 64), (14, 2, 64), (32, 8, 128), (16, 1, 32), (8, 2, 256), (48, 24, 64)]
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_equals_the_reference_over_scattered_blocks_and_stale_memory(
    kernel: DotDecodeAttention, h: int, kv: int, d: int, block_size: int
) -> None:
    # lengths: one token, odd and even, a full block, one past it, long
    check_against_reference(kernel, (torch.bfloat16,), ((h, kv, d),), block_size, (1, 2, 15, 16, 17, 128, 129, 700))


def test_one_sequence_splits_its_kv_heads_across_tasks(kernel: DotDecodeAttention) -> None:
    """A batch of one leaves too few tasks for the threads: the KV heads are split into groups, with a short
    last group (5 KV heads in groups of 2 + 2 + 1 on two threads), and each head's output still matches."""
    check_against_reference(kernel, (torch.bfloat16,), ((40, 5, 64),), 16, (300,))
    check_against_reference(kernel, (torch.bfloat16,), ((16, 8, 128),), 16, (33,))


def test_a_large_score_range_neither_overflows_nor_loses_the_peak(kernel: DotDecodeAttention) -> None:
    decode_attn.check_peaked_scores(kernel)  # raises SelfCheckError where the running maximum is lost


def test_takes_only_the_shapes_its_vectors_fit(kernel: DotDecodeAttention) -> None:
    assert kernel.takes(14, 2, 64, torch.bfloat16, 16) and kernel.takes(32, 8, 128, torch.bfloat16, 32)
    assert not kernel.takes(14, 2, 64, torch.float32, 16)  # bf16 caches only
    assert not kernel.takes(4, 4, 16, torch.bfloat16, 16)  # head_dim under one 32-wide vector
    assert not kernel.takes(14, 2, 64, torch.bfloat16, 8)  # a 16-token slice must sit in one block
    assert not kernel.takes(34, 2, 64, torch.bfloat16, 16)  # G = 17 query heads per KV head


@pytest.fixture(scope="module", params=list(VARIANTS.values()), ids=list(VARIANTS))
def latent(request: pytest.FixtureRequest, builds: tuple[ctypes.CDLL, ctypes.CDLL]) -> DotDecodeAttention:
    return DotDecodeAttention(builds[1], LATENT_STEPS, request.param)


# MLA (engine.layers.mla): all query heads over one latent row that is K and V at once; DeepSeek-V2's 512 + 64
# columns, a narrower one, and fewer heads than 16
@pytest.mark.parametrize(("h", "width"), [(16, 576), (4, 64), (7, 320)])
def test_the_latent_build_takes_latent_rows_as_key_and_value(latent: DotDecodeAttention, h: int, width: int) -> None:
    assert_latent_rows_match(latent, h, width)


def test_only_the_latent_build_takes_latent_rows(kernel: DotDecodeAttention, latent: DotDecodeAttention) -> None:
    assert not kernel.takes_latent(16, 576, torch.bfloat16, 16)  # the heads' build: head_dim <= 256
    assert not kernel.takes(16, 1, 576, torch.bfloat16, 16) and not latent.takes(16, 1, 576, torch.bfloat16, 16)
    assert latent.takes_latent(16, 576, torch.bfloat16, 64)
    assert not latent.takes_latent(16, 608, torch.bfloat16, 16)  # past 18 steps
    assert not latent.takes_latent(17, 576, torch.bfloat16, 16)  # more query heads than a task's 16
    assert not latent.takes_latent(16, 560, torch.bfloat16, 16)  # not whole 32-wide steps
    assert not latent.takes_latent(16, 576, torch.float32, 16)
    decode_attn_dp.check_latent(latent)  # the start-up check passes
