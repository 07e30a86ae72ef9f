"""The AMX GEMM (engine.kernels.amxmm), compiled here with gcc, against float32 math rounded to bf16.

It is a candidate only on CPUs with AMX tiles (Sapphire Rapids and later), so these tests run where the CPU
has them; elsewhere the selection never sees it."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import amxmm
from engine.kernels.amxmm import AMXMM, SiluMulAMXMM
from engine.kernels.cbuild import SelfCheckError
from tests.kernel_checks import assert_fused_silu_equals_unfused
from tests.kernel_checks import bf16 as _bf16

pytestmark = pytest.mark.skipif(not amxmm.supported(), reason="this CPU has no AMX tiles")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> AMXMM:
    mp = pytest.MonkeyPatch()
    mp.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernels")))
    try:
        return AMXMM.build()
    finally:
        mp.undo()


# rows: one, a partial 16-row tile, exactly 16, 16 + a few (the second tile partial), 32, past one 32-row block
@pytest.mark.parametrize("m", [1, 5, 16, 19, 32, 45, 100])
@pytest.mark.parametrize(("n", "k"), [(32, 32), (70, 64), (130, 96), (48, 896)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_float32_math_rounded_to_bf16(kernel: AMXMM, m: int, n: int, k: int, bias: bool) -> None:
    w, x = _bf16(n, k, seed=1), _bf16(m, k, seed=2)
    b = _bf16(n, seed=3) if bias else None
    got = kernel.linear(x, kernel.pack(w), n, b)
    want32 = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # products are exact in fp32; only the order of fp32 sums differs: within one bf16 step of float32's value
    step = want32.abs().clamp_min(2**-20) * 2**-7
    assert ((got.float() - want32).abs() <= step).all()


@pytest.mark.parametrize("fused", [False, True])
def test_a_long_call_runs_in_passes_with_the_same_sums_as_short_calls(kernel: AMXMM, fused: bool) -> None:
    """Past 512 rows the kernel runs passes of 512 (amxmm.c's in_passes): every row bit-identical to the same row
    in a call of its own pass's size, across the passes and a tail."""
    k, n = 96, 128
    w, x, b = _bf16(n, k, seed=8), _bf16(1100, k, seed=9), _bf16(n, seed=10)
    op = SiluMulAMXMM(kernel) if fused else kernel
    packed = op.pack(w)
    whole = op.linear(x, packed, n, b)
    parts = torch.cat([op.linear(x[i : i + 300], packed, n, b) for i in range(0, 1100, 300)])
    assert whole.shape == (1100, n // 2 if fused else n) and torch.equal(whole, parts)


@pytest.mark.parametrize("fused", [False, True])
def test_every_block_is_dealt_once_whatever_the_thread_count(kernel: AMXMM, fused: bool) -> None:
    """deal.h gives each thread a contiguous run of column blocks and lets it steal from the others' ends: with
    one thread, more threads than blocks, or an odd count, every block is computed once, so the bits never change."""
    k, n = 64, 7 * 64  # 14 blocks of 32 columns (7 gate/up pairs)
    w, x, b = _bf16(n, k, seed=11), _bf16(40, k, seed=12), _bf16(n, seed=13)
    op = SiluMulAMXMM(kernel) if fused else kernel
    packed = op.pack(w)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 5, 16):
            torch.set_num_threads(threads)
            outs.append(op.linear(x, packed, n, b))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    want = x.float() @ w.float().t() + b.float()
    if not fused:
        assert ((outs[0].float() - want).abs() <= want.abs().clamp_min(2**-20) * 2**-7).all()


def test_3d_and_strided_inputs(kernel: AMXMM) -> None:
    w = _bf16(64, 64, seed=4)
    x = _bf16(3, 7, 128, seed=5)[..., ::2]  # [B, T, K] with a stride: the kernel sees a contiguous copy
    got = kernel.linear(x, kernel.pack(w), 64, None)
    torch.testing.assert_close(got.float(), (x.float() @ w.float().t()), rtol=1e-2, atol=1e-2)


def test_it_takes_only_k_in_whole_tiles(kernel: AMXMM) -> None:
    assert kernel.accepts(torch.empty(8, 64, dtype=torch.bfloat16))
    assert not kernel.accepts(torch.empty(8, 48, dtype=torch.bfloat16))  # K % 32 != 0: oneDNN takes it
    assert not kernel.accepts(torch.empty(8, 64, dtype=torch.float32))


def test_nan_and_inf_propagate_like_float32(kernel: AMXMM) -> None:
    w, x = _bf16(32, 32, seed=6), _bf16(2, 32, seed=7)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    got = kernel.linear(x, kernel.pack(w), 32, None).float()
    want = x.float() @ w.float().t()
    assert torch.isnan(got[0]).all() and torch.equal(torch.isnan(got[1]), torch.isnan(want[1]))


# rows: one, a partial tile, 32, past a 32-row block (a tail of 8); gate/up halves of 1, 5 and 76 blocks of 32
@pytest.mark.parametrize("m", [1, 7, 32, 40])
@pytest.mark.parametrize(("inter", "k"), [(32, 32), (160, 64), (4864 // 2, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_silu_mul_equals_the_unfused_torch_code(
    kernel: AMXMM, m: int, inter: int, k: int, with_bias: bool
) -> None:
    assert_fused_silu_equals_unfused(kernel, SiluMulAMXMM(kernel), m, inter, k, with_bias)


def test_fused_silu_takes_k_only_in_whole_tiles(kernel: AMXMM) -> None:
    assert not SiluMulAMXMM(kernel).accepts(torch.empty(64, 48, dtype=torch.bfloat16))  # K % 32 != 0


def test_the_self_check_catches_a_wrong_fused_epilogue(kernel: AMXMM, monkeypatch: pytest.MonkeyPatch) -> None:
    amxmm.self_check(kernel)
    monkeypatch.setattr(SiluMulAMXMM, "linear", lambda self, x, packed, n, b: torch.zeros(x.shape[0], n // 2))
    with pytest.raises(SelfCheckError, match="fused SiLU"):
        amxmm.self_check(kernel)
