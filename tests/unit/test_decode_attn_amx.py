"""The AMX decode attention (engine.kernels.decode_attn_amx), compiled here with gcc, against the float32
reference read from the paged cache.

It is a candidate only on CPUs with AMX tiles, so these tests run where the CPU has them; elsewhere the
selection never sees it (the portable kernel's tests cover the rest)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import amxmm, cbuild, decode_attn
from engine.kernels.decode_attn import check_against_reference
from engine.kernels.decode_attn_amx import AMXDecodeAttention
from tests.kernel_checks import assert_latent_rows_match

pytestmark = pytest.mark.skipif(not amxmm.supported(), reason="this CPU has no AMX tiles")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> AMXDecodeAttention:
    mp = pytest.MonkeyPatch()
    mp.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernels")))
    try:
        return AMXDecodeAttention.build()
    finally:
        mp.undo()


# G = 1, 3, 7, 8, 16 query heads per KV head; head_dim 32, 64, 128, 256 (one to eight 32-wide tile steps); a
# task takes a sequence's KV heads up to 32 query heads: 64 over 4 KV heads is two tasks a sequence
@pytest.mark.parametrize(
    ("h", "kv", "d"), [(2, 2, 64), (9, 3, 64), (14, 2, 64), (32, 4, 128), (16, 1, 32), (8, 2, 256), (64, 4, 64)]
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_equals_the_reference_over_scattered_blocks_and_stale_memory(
    kernel: AMXDecodeAttention, h: int, kv: int, d: int, block_size: int
) -> None:
    # lengths: one token, odd and even, a full block, one past it, a 128-token segment and one past it, long
    check_against_reference(kernel, (torch.bfloat16,), ((h, kv, d),), block_size, (1, 2, 15, 16, 17, 128, 129, 700))


def test_a_large_score_range_neither_overflows_nor_loses_the_peak(kernel: AMXDecodeAttention) -> None:
    decode_attn.check_peaked_scores(kernel)  # raises SelfCheckError where the running maximum is lost


def test_takes_only_the_shapes_the_tiles_fit(kernel: AMXDecodeAttention) -> None:
    assert kernel.takes(14, 2, 64, torch.bfloat16, 16) and kernel.takes(32, 8, 128, torch.bfloat16, 32)
    assert not kernel.takes(14, 2, 64, torch.float32, 16)  # bf16 caches only
    assert not kernel.takes(14, 2, 64, torch.bfloat16, 8)  # a 16-row tile would cross blocks
    assert not kernel.takes(14, 2, 48, torch.bfloat16, 16)  # head_dim not a multiple of 32
    assert not kernel.takes(34, 2, 64, torch.bfloat16, 16)  # 17 query heads per KV head: more than a tile's 16


def test_self_check_catches_a_wrong_kernel(kernel: AMXDecodeAttention, monkeypatch: pytest.MonkeyPatch) -> None:
    decode_attn.self_check_bf16(kernel)
    monkeypatch.setattr(AMXDecodeAttention, "__call__", lambda self, q, *args: q * 1.1)
    with pytest.raises(cbuild.SelfCheckError, match="self-check failed"):
        decode_attn.self_check_bf16(kernel)


# MLA (engine.layers.mla): all query heads over one latent row that is K and V at once; DeepSeek-V2's
# 512 + 64 columns (18 tile steps), and a small one
@pytest.mark.parametrize(("h", "width"), [(16, 576), (4, 64)])
def test_latent_rows_as_key_and_value_equal_the_reference(kernel: AMXDecodeAttention, h: int, width: int) -> None:
    assert_latent_rows_match(kernel, h, width)


def test_takes_only_the_latent_widths_the_tiles_fit(kernel: AMXDecodeAttention) -> None:
    assert kernel.takes_latent(16, 576, torch.bfloat16, 64)
    assert not kernel.takes_latent(16, 608, torch.bfloat16, 16)  # past 18 tile steps
    assert not kernel.takes_latent(17, 576, torch.bfloat16, 16)  # more query heads than a tile's 16
    assert not kernel.takes_latent(16, 560, torch.bfloat16, 16)  # not whole 32-wide steps
    assert not kernel.takes_latent(16, 576, torch.float32, 16)
